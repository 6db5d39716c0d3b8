"""`kvflow serve --data-parallel-size N`: N `kvflow serve` processes on 127.0.0.1 (ports
--port+1 .. --port+N, the same engine flags, the threads split between them), and the router
(kvflow/server/router.py) on --host/--port in this process.

No replica outlives the router: they are stopped (SIGTERM, then SIGKILL) however this process
exits normally or by signal, and each watches its parent (cli._exit_with_parent) for the case
that this process is killed outright.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

from kvflow import envs
from kvflow.server.http_common import PARENT_PID_ENV

# Flags of the `serve` parser that are the front's, not the replicas'.
_FRONT_ONLY = {"host", "port", "api_key", "data_parallel_size", "router_policy", "help"}
_STARTUP_S = 600.0      # a replica has this long to load its model and answer /health


def replica_argv(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """args as command-line flags again (those that differ from their defaults), less the
    front's own."""
    out: list[str] = []
    for a in parser._actions:
        if a.dest in _FRONT_ONLY or not hasattr(args, a.dest):
            continue
        value = getattr(args, a.dest)
        if value == a.default or value is None:
            continue
        if not a.option_strings:            # the positional model
            out.append(str(value))
        elif isinstance(a, argparse.BooleanOptionalAction):
            out.append(a.option_strings[0] if value else a.option_strings[1])
        elif a.nargs == 0:                  # store_true
            out.append(a.option_strings[0])
        else:
            values = value if isinstance(value, list) else [value]
            out += [a.option_strings[0], *(json.dumps(v) if isinstance(v, dict) else str(v)
                                           for v in values)]
    return out


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:      # not Linux
        return os.cpu_count() or 1


def _spawn(argv: list[str], port: int, api_key: str | None) -> subprocess.Popen:
    env = envs.set_process_defaults({**os.environ, PARENT_PID_ENV: str(os.getpid())})
    env.pop("KVFLOW_API_KEY", None)
    if api_key:
        env["KVFLOW_API_KEY"] = api_key        # not on the command line, where ps shows it
    cmd = [sys.executable, "-m", "kvflow.cli", "serve", *argv, "--host", "127.0.0.1",
           "--port", str(port)]
    return subprocess.Popen(cmd, env=env)


def _wait_ready(procs: list[subprocess.Popen], urls: list[str]) -> None:
    import httpx
    deadline, pending = time.monotonic() + _STARTUP_S, set(range(len(urls)))
    while pending:
        for i in sorted(pending):
            if procs[i].poll() is not None:
                raise RuntimeError(f"replica {i} ({urls[i]}) exited with code "
                                   f"{procs[i].returncode} before it was ready")
            try:
                if httpx.get(urls[i] + "/health", timeout=2.0).status_code == 200:
                    pending.discard(i)
            except httpx.HTTPError:
                pass
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"replicas {sorted(pending)} not ready after {_STARTUP_S:g} s")
        time.sleep(0.2)


def _stop(procs: list[subprocess.Popen], grace: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)      # so that the `finally` below stops the replicas


def run_data_parallel(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    n = args.data_parallel_size
    if n < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {n}")
    if not 0 < args.port <= 65535 - n:
        raise ValueError(f"--port must leave room for the replicas' ports --port+1 .. --port+{n}")
    argv = replica_argv(args, parser)
    if args.num_threads is None:
        argv += ["--num-threads", str(max(1, _cores() // n))]
    urls = [f"http://127.0.0.1:{args.port + 1 + i}" for i in range(n)]
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    procs: list[subprocess.Popen] = []
    try:
        procs = [_spawn(argv, args.port + 1 + i, args.api_key) for i in range(n)]
        _wait_ready(procs, urls)
        from kvflow.server.router_cli import run_router
        return run_router(args, urls, args.router_policy, backend_api_key=args.api_key)
    finally:
        _stop(procs, args.shutdown_timeout + 5.0)
