"""Per-step cost of structured outputs at N running JSON-schema requests (default 64) on the
default model's vocabulary (49,152): filling the grammar bitmask in the engine core (xgrammar
matchers, one row per request) and applying it to the logits in the runner, as a median over
many decode steps. For scale, the same step's plain sampling (temperature 1) is timed too.

Each request's grammar is advanced with the argmax of random logits under its mask, so the
matchers walk through real JSON states; a request whose grammar ends starts over.

    python benchmarks/structured_output_cost.py [--requests 64] [--steps 300] [--model PATH]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cpu_info import cpu_line  # noqa: E402

from kvflow import SamplingParams  # noqa: E402
from kvflow.engine.structured_output import StructuredOutputManager  # noqa: E402
from kvflow.engine.tokenizer import Tokenizer  # noqa: E402
from kvflow.model.loader.checkpoint import default_model_path, open_checkpoint  # noqa: E402
from kvflow.model.sample.grammar import apply_grammar_bitmask  # noqa: E402
from kvflow.model.sample.sampler import Sampler  # noqa: E402
from kvflow.sampling_params import StructuredOutputsParams  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "zip": {"type": "integer"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "color", "tags", "address"],
}


class _Req:
    def __init__(self, rid: str) -> None:
        self.req_id = rid


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def _manager(model: str | None) -> tuple[StructuredOutputManager, int, float]:
    ckpt = open_checkpoint(model or default_model_path())
    tok = Tokenizer.from_checkpoint(ckpt)
    vocab = ckpt.config.get("vocab_size") or tok.vocab_size
    mgr = StructuredOutputManager(tok, vocab, [tok.eos_token_id])
    t0 = time.perf_counter()
    mgr.compile(StructuredOutputsParams(json=SCHEMA))
    return mgr, vocab, time.perf_counter() - t0


def run(args) -> None:
    torch.set_num_threads(args.threads)
    mgr, vocab, compile_s = _manager(args.model)
    so_params = StructuredOutputsParams(json=SCHEMA)
    ids = [f"r{i}" for i in range(args.requests)]
    for rid in ids:
        mgr.add_request(rid, so_params)
    reqs, drafts = [_Req(r) for r in ids], [[] for _ in ids]
    sampler = Sampler(0)
    params = [SamplingParams(temperature=1.0)] * len(ids)
    greedy = [SamplingParams(temperature=0.0)] * len(ids)
    gen = torch.Generator().manual_seed(0)
    fill, apply, sample, argmax, restarts = [], [], [], [], 0
    for _ in range(args.steps):
        logits = torch.randn(len(ids), vocab, generator=gen).to(args.dtype)
        t0 = time.perf_counter()
        bitmask = mgr.grammar_bitmask(ids)
        t1 = time.perf_counter()
        apply_grammar_bitmask(logits, bitmask, ids, reqs, drafts)
        t2 = time.perf_counter()
        sampler(logits, params, [None] * len(ids))
        t3 = time.perf_counter()
        sampler(logits, greedy, [None] * len(ids))
        argmax.append(time.perf_counter() - t3)
        fill.append(t1 - t0)
        apply.append(t2 - t1)
        sample.append(t3 - t2)
        for rid, tok in zip(ids, logits.float().argmax(dim=-1).tolist()):
            _, ended = mgr.accept_tokens(rid, [tok])
            if ended:       # the request is done: a new one takes its place
                mgr.remove_requests([rid])
                mgr.add_request(rid, so_params)
                restarts += 1
    _report(args, vocab, compile_s, fill, apply, sample, argmax, restarts)


def _report(args, vocab, compile_s, fill, apply, sample, argmax, restarts) -> None:
    f, a, s, g = _median_ms(fill), _median_ms(apply), _median_ms(sample), _median_ms(argmax)
    print(f"# {cpu_line()}")
    print(f"# torch {torch.__version__}, {args.threads} thread(s); logits {args.dtype}")
    print(f"requests={args.requests} vocab={vocab} steps={args.steps} "
          f"(grammars completed and restarted: {restarts})")
    print(f"first compile of the schema: {compile_s * 1e3:.1f} ms")
    print(f"fill bitmask (engine core): median {f:.3f} ms/step "
          f"({f * 1e3 / args.requests:.1f} us/request)")
    print(f"apply bitmask (runner):     median {a:.3f} ms/step")
    print(f"plain sampling, same rows:  median {s:.3f} ms/step (temperature 1), "
          f"{g:.3f} ms/step (greedy)")
    print(f"fill + apply = {f + a:.3f} ms/step = {(f + a) / s * 100:.0f}% of sampling at "
          f"temperature 1, {(f + a) / g * 100:.0f}% of greedy")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--model", default=None, help="checkpoint (default: kvflow's default model)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args()
    args.dtype = getattr(torch, args.dtype)
    run(args)


if __name__ == "__main__":
    main()
