"""A tensor-parallel worker: ranks 1..N-1. It builds its shard of the model and a KV cache for
its own heads, then executes each step rank 0 broadcasts, without ever sampling.

Started by rank 0 (tp_executor: `python -m kvflow.engine.tp_worker PARENT_PID ARGS_JSON`,
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in its environment), or by torchrun through
`kvflow serve ... --tensor-parallel-size N` on ranks > 0 (run_if_worker): the same loop.

It exits when rank 0 says so, when rank 0's sockets close (it died: the collective raises),
or, when rank 0 started it, as soon as its parent process is gone: never an orphan.
"""
from __future__ import annotations

import logging
import os
import sys
import traceback

import msgspec

from kvflow.engine.arg_utils import EngineArgs     # torch-free: run_if_worker loads no torch
from kvflow.engine.parent_watch import watch_parent
from kvflow.engine.tp_messages import InitWorkers, ShutdownWorkers

logger = logging.getLogger(__name__)


def torchrun_env() -> tuple[int, int, str, int, int] | None:
    """(rank, world size, master address, master port, local rank) from torchrun's variables,
    or None when they are not set."""
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    return (int(env["RANK"]), int(env["WORLD_SIZE"]), env.get("MASTER_ADDR", "127.0.0.1"),
            int(env.get("MASTER_PORT", "29500")), int(env.get("LOCAL_RANK", "0")))


def run_if_worker(args: EngineArgs) -> int | None:
    """Under torchrun on a rank > 0, with tensor_parallel_size > 1: run the worker loop and
    return its exit code. Else None (this process is rank 0, or not parallel)."""
    env = torchrun_env()
    if args.tensor_parallel_size == 1 or env is None or env[0] == 0:
        return None
    return run_worker(args)


def run_worker(args: EngineArgs, parent_pid: int | None = None) -> int:
    import torch

    from kvflow.model.attention.selector import resolve_device
    from kvflow.model.distributed.parallel import destroy, init_distributed
    if parent_pid is not None:
        watch_parent(parent_pid, lambda: os._exit(1), "kvflow-tp-parent-watch")
    rank, world, addr, port, local = torchrun_env()
    if world != args.tensor_parallel_size:
        print(f"kvflow tp_worker: WORLD_SIZE={world} != tensor_parallel_size="
              f"{args.tensor_parallel_size}", file=sys.stderr)
        return 2
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    device = resolve_device(args.device)
    tp = init_distributed(rank, world, device, addr, port, local)
    try:
        runner = _build(args, tp, device)
        _loop(tp, runner)
        return 0
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        try:
            destroy(tp)
        except Exception:
            pass


def _build(args: EngineArgs, tp, device: str):
    from kvflow.engine.worker import load_model, make_model_runner
    from kvflow.model.attention.selector import make_backend, resolve_attention_backend
    backend = make_backend(resolve_attention_backend(args.attention_backend, device), device)
    cfg, model, dtype = load_model(args, device, tp)
    init = tp.recv()        # rank 0 decides the KV cache's size (num_blocks)
    assert isinstance(init, InitWorkers), init
    runner = make_model_runner(args, model, cfg, dtype, backend, device,
                               init.scheduler_config)
    runner.samples = False      # rank 0 alone samples and scores prompts
    tp.barrier()
    return runner


def _loop(tp, runner) -> None:
    import torch
    with torch.inference_mode():
        _steps(tp, runner)


def _steps(tp, runner) -> None:
    while True:
        msg = tp.recv()
        if isinstance(msg, ShutdownWorkers):
            return
        # The tokens rank 0 sampled last step: rank 0's runner appended them to its request
        # states as it sampled; here they arrive one step later, before they are needed.
        reqs = runner.requests
        for rid, toks in msg.sampled.items():
            st = reqs.get(rid)
            if st is not None:
                st.token_ids.extend(toks)
        if msg.failed:
            runner.skip_failed(msg.failed)
        runner.execute_model(msg.scheduler_output)


if __name__ == "__main__":
    ppid, args_json = sys.argv[1:3]
    sys.exit(run_worker(msgspec.json.decode(args_json, type=EngineArgs), int(ppid)))
