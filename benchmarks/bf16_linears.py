"""The bf16 linear candidates on this CPU, one matmul at a time: which fallback to use where oneDNN
cannot pack bf16 weights (kvflow/model/models/layers.py, prepare_linears).

    python benchmarks/bf16_linears.py [THREADS] [--rows 64,256] [--kept-only]

Shapes are the 62.9M bench Llama's (make_bench_model.py) at 64 and 256 decode rows (--rows picks
others). Each candidate runs 10 calls per round, rounds alternating, median of 5 rounds, in ms
per call. --kept-only times just kvflow's bf16w_linear (bf16 weights kept, csrc/cpu_bf16.cpp)
against the float32 weight copies it replaced, with bf16 and with float32 activations (the
dtype="bfloat16" and dtype="auto" models), skipping torch's slow unpacked candidates.
"""
import argparse
import statistics
import time

from kvflow import envs
envs.set_process_defaults()     # first: GOMP_SPINCOUNT must be set before torch loads
from kvflow.model.kernels import cpu_ops  # noqa: E402
from kvflow.model.models import layers  # noqa: E402

import torch
import torch.nn.functional as F
from cpu_info import cpu_line

SHAPES = {"qkv": (768, 1280), "o_proj": (768, 768), "gate_up": (768, 4096),
          "down": (2048, 768), "lm_head": (768, 8192)}


def candidates(x: torch.Tensor, w: torch.Tensor, kept_only: bool) -> dict:
    w32, x32 = w.float(), x.float()
    c = {"float32 weight copies (fallback)": lambda: F.linear(x.float(), w32).bfloat16(),
         "float32 model (x float32 too)": lambda: F.linear(x32, w32)}
    if cpu_ops.available():
        bf16w = torch.ops.kvflow.bf16w_linear
        c["bf16w_linear, x bf16"] = lambda: bf16w(x, w)
        c["bf16w_linear, x float32"] = lambda: bf16w(x32, w)
    if kept_only:
        return c
    c["bf16 F.linear (unpacked)"] = lambda: F.linear(x, w)
    c["bf16 weights upcast per call"] = lambda: F.linear(x.float(), w.float()).bfloat16()
    if layers.bf16_pack_supported():
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 256)
        c["oneDNN packed bf16"] = lambda: torch.ops.mkldnn._linear_pointwise(
            x, packed, None, "none", [], "")
    return c


def time_candidates(c: dict) -> dict:
    times = {key: [] for key in c}
    for f in c.values():
        f()
    for _ in range(5):
        for key, f in c.items():
            t = time.perf_counter()
            for _ in range(10):
                f()
            times[key].append((time.perf_counter() - t) / 10 * 1e3)
    return {key: statistics.median(v) for key, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("threads", type=int, nargs="?", default=1)
    ap.add_argument("--rows", default="64,256")
    ap.add_argument("--kept-only", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"{cpu_line()}\ntorch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"oneDNN bf16 packing supported: {layers.bf16_pack_supported()}")
    g = torch.Generator().manual_seed(0)
    for rows in map(int, a.rows.split(",")):
        for name, (k, n) in SHAPES.items():
            x = torch.randn(rows, k, generator=g).bfloat16()
            w = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
            med = time_candidates(candidates(x, w, a.kept_only))
            print(f"{rows} x {k} x {n} ({name}): " + "; ".join(
                f"{key} {v:.3f}" for key, v in med.items()), flush=True)


if __name__ == "__main__":
    main()
