"""`kvflow serve`: the OpenAI-compatible server in the foreground (FastAPI + uvicorn)."""
from __future__ import annotations

import importlib
import os
import sys
import threading

from kvflow import envs
from kvflow.server.http_common import PARENT_PID_ENV, add_http_args

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


def add_serve_parser(sub) -> None:
    from kvflow.engine.arg_utils import EngineArgs      # torch-free
    p = sub.add_parser("serve", help="run the OpenAI-compatible server")
    p.add_argument("model_tag", nargs="?", default=None,
                   help="model path, as in `vllm serve MODEL` (same as --model)")
    EngineArgs.add_cli_args(p)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use (default: the model path's basename, or "
                        f"{DEFAULT_SERVED_NAME} for the embedded model)")
    add_http_args(p)
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="run this many replicas (ports --port+1 .. --port+N on 127.0.0.1, "
                        "--num-threads split between them unless given) behind a router on "
                        "--host/--port (see `kvflow router`)")
    p.add_argument("--router-policy", default="prefix",
                   choices=["prefix", "round_robin", "least_load"],
                   help="with --data-parallel-size > 1: how the router picks a replica "
                        "(default: prefix)")
    p.set_defaults(func=cmd_serve, serve_parser=p)


def served_name(model: str | None) -> str:
    if model is None:
        return DEFAULT_SERVED_NAME
    return os.path.basename(os.path.normpath(model)) or model


def _import_server_modules() -> None:
    for name in ("kvflow.server.api_server", "kvflow.server.http_server"):
        importlib.import_module(name)


def cmd_serve(args) -> int:
    if args.data_parallel_size != 1:
        from kvflow.server.replicas import run_data_parallel
        return run_data_parallel(args, args.serve_parser)
    from kvflow.engine.arg_utils import EngineArgs
    from kvflow.engine.async_llm import AsyncLLM

    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    model = args.model_tag or args.model
    engine_args = EngineArgs.from_cli_args(args, model=model)
    from kvflow.engine.tp_worker import run_if_worker
    code = run_if_worker(engine_args)     # torchrun, rank > 0: a worker, not a server
    if code is not None:
        return code
    # The server's imports (FastAPI, uvicorn) load while the engine core loads the model.
    web = threading.Thread(target=_import_server_modules, daemon=True)
    web.start()
    llm = AsyncLLM.from_engine_args(engine_args)
    web.join()
    from kvflow.server.api_server import build_app
    from kvflow.server.http_server import make_server
    names = args.served_model_name or [served_name(model)]
    if model is None:
        from kvflow.model.loader.gguf_loader import default_model_path
        path = default_model_path()
    else:
        path = model
    app = build_app(llm, names, api_key=args.api_key,
                    max_body_bytes=args.max_request_body_bytes, model_path=path,
                    public_metrics=args.metrics_no_auth)
    c = llm.scheduler_config
    print(f"kvflow serve: {names[0]} on http://{args.host}:{args.port} (max_model_len "
          f"{c.max_model_len}, {c.num_blocks} KV blocks of {c.block_size}, max_num_seqs "
          f"{c.max_num_seqs}, load {llm.load_time:.1f} s)", file=sys.stderr)
    server = make_server(app, host=args.host, port=args.port, log_level=args.log_level,
                         header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                         shutdown_timeout=args.shutdown_timeout)
    # A failed step leaves nothing to serve: stop (in-flight requests get their error) and exit
    # non-zero so that a supervisor restarts the server, rather than answer 503 forever.
    llm.on_engine_dead(lambda err: setattr(server, "should_exit", True))
    _exit_with_parent(server)
    try:
        server.run()
    except KeyboardInterrupt:       # uvicorn re-raises the Ctrl-C it shut down for (as uvicorn.run)
        pass
    finally:
        llm.shutdown()
    if llm.step_error is not None:
        print(f"kvflow serve: the engine failed ({llm.step_error!r}); exiting", file=sys.stderr)
        return 1
    return 0 if server.started else 3       # 3: uvicorn.run's exit code for a failed startup


def _exit_with_parent(server) -> None:
    """A replica of `kvflow serve --data-parallel-size N` shuts down when the router's process
    is gone, however it went (SIGKILL included): no orphan holds the port and the memory."""
    from kvflow.engine.parent_watch import watch_parent
    pid = envs.get(PARENT_PID_ENV)
    os.environ.pop(PARENT_PID_ENV, None)    # not inherited by this process's own children
    if pid:
        watch_parent(pid, lambda: setattr(server, "should_exit", True))
