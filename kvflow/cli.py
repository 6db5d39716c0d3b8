"""`kvflow generate`, `kvflow chat`, `kvflow simulate`, `kvflow serve`, `kvflow router`,
`kvflow bench serve`."""
from __future__ import annotations

import argparse
import sys
import time

from kvflow import envs
from kvflow.engine.arg_utils import EngineArgs, engine_kwargs  # noqa: F401  (torch-free)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--stop", action="append", default=[])


def _sampling(args):
    from kvflow import SamplingParams
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_tokens=args.max_tokens, stop=args.stop, seed=args.seed)


def _report(outs, t0: float, t_load: float) -> None:
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    dt = time.perf_counter() - t0
    print(f"[{n} tokens in {dt:.2f} s: {n / dt:.1f} tok/s; model load {t_load:.2f} s]",
          file=sys.stderr)


def _run_if_worker(args) -> int | None:
    """Under torchrun, ranks > 0 of a tensor-parallel engine run the worker loop (tp_worker)."""
    from kvflow.engine.tp_worker import run_if_worker
    return run_if_worker(EngineArgs.from_cli_args(args))


def _cmd_generate(args) -> int:
    from kvflow import LLM
    code = _run_if_worker(args)
    if code is not None:
        return code
    t = time.perf_counter()
    llm = LLM(args.model, **engine_kwargs(args))
    t_load = time.perf_counter() - t
    t0 = time.perf_counter()
    outs = llm.generate(args.prompt, _sampling(args), use_tqdm=False)
    for o in outs:
        print(o.outputs[0].text)
    _report(outs, t0, t_load)
    return 0


def _cmd_chat(args) -> int:
    from kvflow import LLM
    code = _run_if_worker(args)
    if code is not None:
        return code
    t = time.perf_counter()
    llm = LLM(args.model, **engine_kwargs(args))
    t_load = time.perf_counter() - t
    sp = _sampling(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    if args.message:        # one turn, for scripts and `make demo`
        history.append({"role": "user", "content": " ".join(args.message)})
        t0 = time.perf_counter()
        outs = llm.chat(history, sp, use_tqdm=False)
        print(outs[0].outputs[0].text)
        _report(outs, t0, t_load)
        return 0
    print("kvflow chat: type a message, an empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        history.append({"role": "user", "content": line})
        t0 = time.perf_counter()
        outs = llm.chat(history, sp, use_tqdm=False)
        text = outs[0].outputs[0].text
        print(text)
        _report(outs, t0, t_load)
        history.append({"role": "assistant", "content": text})
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvflow", description="kvflow LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete prompts with a model")
    g.add_argument("prompt", nargs="+", help="one or more prompts")
    EngineArgs.add_cli_args(g)
    _add_sampling_args(g)
    g.set_defaults(func=_cmd_generate)
    c = sub.add_parser("chat", help="chat with a model (interactive, or one message)")
    c.add_argument("message", nargs="*", help="a single user message; omit for interactive")
    c.add_argument("--system", default=None, help="a system prompt")
    EngineArgs.add_cli_args(c)
    _add_sampling_args(c)
    c.set_defaults(func=_cmd_chat)
    from kvflow.sim.cli import add_simulate_parser     # torch-free; cheap to import
    add_simulate_parser(sub)
    from kvflow.server.cli import add_serve_parser      # argparse only; FastAPI loads on use
    add_serve_parser(sub)
    from kvflow.server.router_cli import add_router_parser
    add_router_parser(sub)
    from kvflow.bench.cli import add_bench_parser
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # First, before any command imports torch: libgomp reads GOMP_SPINCOUNT once, when it loads.
    envs.set_process_defaults()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"kvflow: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
