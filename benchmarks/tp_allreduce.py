"""Tensor parallelism on CPU (issue 17): what one gloo all-reduce costs, and TP=1 vs TP=2 decode.

    python benchmarks/tp_allreduce.py                 # all-reduce of [T, hidden] float32:
                                                      # gloo, and kvflow's PeerSockets
    python benchmarks/tp_allreduce.py --decode        # + the default model's decode tok/s

A Llama-shaped step all-reduces twice a layer (after o_proj and down_proj) plus once for the
embedding: the default model (30 layers, hidden 576) pays 61 all-reduces of [T, 576] a step,
T = the step's tokens (1 per running request in decode; up to max_num_batched_tokens in a
prefill). Run on a quiet machine: the figures are latencies of two processes that must both
be scheduled.
"""
from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _allreduce_worker(rank: int, world: int, port: int, hidden: int, sizes: list[int],
                      out: dict) -> None:
    from kvflow.model.distributed.parallel import init_distributed
    torch.set_num_threads(1)
    tp = init_distributed(rank, world, "cpu", "127.0.0.1", port)
    if rank == 0:
        out["limit"] = tp.peers.limit
    for t in sizes:
        x = torch.randn(t, hidden)
        for name, fn in (("gloo", dist.all_reduce), ("sockets", tp.peers.all_reduce)):
            if name == "sockets" and x.nbytes > tp.peers.limit:
                continue
            for _ in range(10):
                fn(x)
            n = max(20, min(500, 2_000_000 // (t * hidden)))
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                fn(x)
            if rank == 0:
                out[(t, name)] = (time.perf_counter() - t0) / n
    tp.peers.close()
    dist.destroy_process_group()


def allreduce_table(hidden: int, sizes: list[int], world: int = 2) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as m:
        out = m.dict()
        mp.spawn(_allreduce_worker, args=(world, port, hidden, sizes, out), nprocs=world)
        return dict(out)


def decode_tok_s(tp: int, batch: int, max_tokens: int, threads: int) -> float:
    """Output tok/s of `batch` short prompts (decode dominates) on the default model."""
    from kvflow import LLM, SamplingParams
    llm = LLM(None, tensor_parallel_size=tp, num_threads=threads, max_model_len=512)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    prompts = [f"Write a story about the number {i}." for i in range(batch)]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)     # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    llm.llm_engine.shutdown()
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32, 256, 2048])
    p.add_argument("--decode", action="store_true", help="also TP=1 vs TP=2 decode tok/s")
    p.add_argument("--max-tokens", type=int, default=32)
    a = p.parse_args()
    print(f"all-reduce of [T, {a.hidden}] float32, 2 processes x 1 thread (us):")
    res = allreduce_table(a.hidden, a.sizes)
    print(f"  (PeerSockets limit: {res.pop('limit') / 1024:.0f} KiB)")
    for t in a.sizes:
        cells = "  ".join(f"{name} {res[(t, name)] * 1e6:6.0f}" for name in ("gloo", "sockets")
                          if (t, name) in res)
        print(f"  T={t:5d}  {t * a.hidden * 4 / 1024:8.1f} KiB  {cells}")
    if a.decode:
        cores = os.cpu_count() or 1
        # TP > 1 dequantizes the GGUF's blocks to float32: the fair TP=1 baseline is float32 too
        # (KVFLOW_CPU_QUANT=0); TP=1 on the blocks is the default engine.
        runs = (("TP=1 blocks", 1, cores, "1"), ("TP=1 float32", 1, cores, "0"),
                ("TP=1 float32", 1, 1, "0"), ("TP=2 float32", 2, max(cores // 2, 1), "0"))
        for batch in (1, 16):
            res = []
            for label, tp, th, quant in runs:
                os.environ["KVFLOW_CPU_QUANT"] = quant
                res.append(f"{label} x {th} thread(s): "
                           f"{decode_tok_s(tp, batch, a.max_tokens, th):.1f} tok/s")
            print(f"batch {batch}: " + "; ".join(res))

if __name__ == "__main__":
    main()
