"""Measure real step times and calibrate the simulator's cost model against them.

The steps to time come from the simulator itself (a small replay, so their mix of decodes and
prefill chunks is what the scheduler really produces). Each is run through a transformer of the
named shape with random weights, written here in plain torch (paged-KV bookkeeping is not needed
to time the arithmetic): QKV/O and gated-MLP GEMMs over all the step's tokens, causal attention
of each request's new tokens against its context, the LM head on one position per request.
The device's peaks (matmul FLOP/s, memory copy bandwidth) are measured first and stand in for
the datasheet numbers, so the fitted mfu/mbu are fractions of what this machine can do.

    python benchmarks/sim_calibrate.py [--model SmolLM2-135M] [--steps 80] [--device cpu]
        [--out docs/sim/calibration_cpu.jsonl]

It then runs the same fit as `kvflow simulate --calibrate FILE` and prints the prediction error.
On a GPU machine pass --device cuda (bf16); untested here, the dev machine has no GPU.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, replace

import numpy as np
import torch
import torch.nn.functional as F

from kvflow.sim import CostModel, get_model, scheduler_config, simulate
from kvflow.sim.calibrate import StepSample, fit
from kvflow.sim.hardware import GPUSpec
from kvflow.sim.workload import synthetic, with_arrivals


def measure_peaks(device: str, dtype: torch.dtype) -> tuple[float, float]:
    def best(fn, reps=5):
        ts = []
        for _ in range(reps):
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            ts.append(time.perf_counter() - t0)
        return min(ts)

    n = 2048
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    flops = 2 * n**3 / best(lambda: a @ b)
    x = torch.empty(64 << 20, device=device, dtype=torch.float32)      # 256 MiB
    y = torch.empty_like(x)
    bw = 2 * x.numel() * 4 / best(lambda: y.copy_(x))                  # read + write
    return flops, bw


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class RandomTransformer:
    def __init__(self, shape, device: str, dtype: torch.dtype, max_ctx_tokens: int) -> None:
        s = shape
        self.s, self.device, self.dtype = s, device, dtype
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        g = lambda *d: torch.randn(*d, device=device, dtype=dtype) * 0.02    # noqa: E731
        self.layers = [(g(s.hidden_size, q + 2 * kv), g(q, s.hidden_size),
                        g(s.hidden_size, 2 * s.intermediate_size),
                        g(s.intermediate_size, s.hidden_size))
                       for _ in range(s.num_layers)]
        self.lm_head = g(s.hidden_size, s.vocab_size)
        # One K/V pool shared by all layers: each request reads its own slice of it, so the bytes
        # streamed per step match the model's (the pool is far larger than any CPU cache).
        self.k = g(max_ctx_tokens, s.num_kv_heads, s.head_dim)
        self.v = g(max_ctx_tokens, s.num_kv_heads, s.head_dim)

    @torch.inference_mode()
    def step(self, reqs: list[tuple[int, int]]) -> None:
        s = self.s
        T = sum(n for n, _ in reqs)
        x = torch.randn(T, s.hidden_size, device=self.device, dtype=self.dtype)
        H, KV, d = s.num_heads, s.num_kv_heads, s.head_dim
        offsets, base, off = [], 0, 0
        for n, c in reqs:
            offsets.append((off, n, base, c))
            off += n
            base += c
        for wqkv, wo, wgu, wd in self.layers:
            qkv = x @ wqkv
            q = qkv[:, :H * d].view(T, H, d)
            k_new = qkv[:, H * d:(H + KV) * d].view(T, KV, d)
            v_new = qkv[:, (H + KV) * d:].view(T, KV, d)
            outs = []
            for o, n, b, c in offsets:
                self.k[b + c - n:b + c] = k_new[o:o + n]
                self.v[b + c - n:b + c] = v_new[o:o + n]
                mask = None
                if n > 1:
                    mask = torch.ones(n, c, dtype=torch.bool, device=self.device).tril(c - n)
                outs.append(F.scaled_dot_product_attention(
                    q[o:o + n].transpose(0, 1), self.k[b:b + c].transpose(0, 1),
                    self.v[b:b + c].transpose(0, 1), attn_mask=mask,
                    enable_gqa=True).transpose(0, 1))
            x = x + torch.cat(outs).reshape(T, H * d) @ wo
            gu = x @ wgu
            x = x + (F.silu(gu[:, :s.intermediate_size]) * gu[:, s.intermediate_size:]) @ wd
        last = torch.tensor([o + n - 1 for o, n, _, _ in offsets], device=self.device)
        (x[last] @ self.lm_head).argmax(-1).tolist()


def steps_from_a_replay(shape, n_steps: int, seed: int) -> list[list[tuple[int, int]]]:
    """(new tokens, context after) per request for steps the real scheduler produced: half of
    them with a prefill chunk in, half pure decode, batch sizes from 1 to max_num_seqs."""
    wl = with_arrivals(synthetic(240, 192, 96, "lognormal", seed), "poisson", 60.0, seed)
    cfg = scheduler_config("vllm", max_num_batched_tokens=384, num_blocks=4096, max_model_len=2048,
                           max_num_seqs=48)
    seen: list[list[tuple[int, int]]] = []

    # Contexts must be read before update_from_output frees finished requests, which is when
    # the simulator asks the cost model: record them there.
    class Recorder(CostModel):
        def step_time(self, num_scheduled, requests, pad_decodes=0, pad_context=0):
            seen.append([(n, requests[rid].num_computed_tokens)
                         for rid, n in num_scheduled.items()])
            return super().step_time(num_scheduled, requests, pad_decodes, pad_context)

    # A slow device (SmolLM2 on a CPU-like roofline) so that requests pile up into big batches.
    simulate(wl, Recorder(shape, GPUSpec("slow", 2e12, 50e9, 0, "")), cfg)
    rng = np.random.default_rng(seed)
    mixed = [s for s in seen if any(n > 1 for n, _ in s)]
    decode = [s for s in seen if all(n == 1 for n, _ in s)]
    k = min(n_steps // 2, len(mixed))
    picks = [mixed[i] for i in rng.choice(len(mixed), k, replace=False)]
    picks += [decode[i] for i in rng.choice(len(decode), min(n_steps - k, len(decode)),
                                            replace=False)]
    return [picks[i] for i in rng.permutation(len(picks))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="SmolLM2-135M")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--repeats", type=int, default=3, help="time each step this often, keep the min")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: steadier timings on a shared 2-core machine)")
    p.add_argument("--out", default="docs/sim/calibration_cpu.jsonl")
    a = p.parse_args()
    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    dtype = torch.float32 if a.device == "cpu" else torch.bfloat16
    shape = replace(get_model(a.model), dtype_bytes=4 if dtype == torch.float32 else 2)
    flops, bw = measure_peaks(a.device, dtype)
    gpu = GPUSpec(f"{a.device} (measured peaks)", flops, bw, 0, "measured by sim_calibrate.py")
    print(f"device peaks: {flops / 1e9:.1f} GFLOP/s matmul, {bw / 1e9:.1f} GB/s copy; "
          f"torch threads {torch.get_num_threads()}")
    steps = steps_from_a_replay(shape, a.steps, a.seed)
    model = RandomTransformer(shape, a.device, dtype, max(sum(c for _, c in r) for r in steps))
    model.step([(8, 8)])                                    # warm-up
    samples = []
    t_start = time.perf_counter()
    for reqs in steps:
        ts = []
        for _ in range(a.repeats):
            sync(a.device)
            t0 = time.perf_counter()
            model.step(reqs)
            sync(a.device)
            ts.append(time.perf_counter() - t0)
        samples.append(StepSample(reqs, min(ts)))
    print(f"timed {len(samples)} steps ({a.repeats} repeats each) in "
          f"{time.perf_counter() - t_start:.0f} s")
    with open(a.out, "w") as f:
        f.write(json.dumps({"model": asdict(shape), "gpu": asdict(gpu)}) + "\n")
        for s in samples:
            f.write(json.dumps({"seconds": s.seconds, "reqs": s.reqs}) + "\n")
    cal = fit(shape, gpu, samples)
    print(f"calibration of {shape.name} (fp{8 * shape.dtype_bytes}) on {gpu.name}\n{cal.report()}")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
