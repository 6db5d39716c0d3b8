"""The bf16 linear candidates on this CPU, one matmul at a time: which fallback to use where oneDNN
cannot pack bf16 weights (kvflow/model/layers.py, prepare_linears).

    python benchmarks/bf16_linears.py [THREADS]

Shapes are the 62.9M bench Llama's (make_bench_model.py) at 64 and 256 decode rows. Each
candidate runs 10 calls per round, rounds alternating, median of 5 rounds, in ms per call.
"""
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from cpu_info import cpu_line

from kvflow.model import layers

SHAPES = {"qkv": (768, 1280), "o_proj": (768, 768), "gate_up": (768, 4096),
          "down": (2048, 768), "lm_head": (768, 8192)}


def candidates(x: torch.Tensor, w: torch.Tensor) -> dict:
    w32 = w.float()
    c = {"bf16 F.linear (unpacked)": lambda: F.linear(x, w),
         "bf16 weights upcast per call": lambda: F.linear(x.float(), w.float()).bfloat16(),
         "float32 weight copies (fallback)": lambda: F.linear(x.float(), w32).bfloat16(),
         "float32 model (x float32 too)": (lambda x32: lambda: F.linear(x32, w32))(x.float())}
    if layers.bf16_pack_supported():
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 256)
        c["oneDNN packed bf16"] = lambda: torch.ops.mkldnn._linear_pointwise(
            x, packed, None, "none", [], "")
    return c


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    print(f"{cpu_line()}\ntorch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"oneDNN bf16 packing supported: {layers.bf16_pack_supported()}")
    g = torch.Generator().manual_seed(0)
    for rows in (64, 256):
        for name, (k, n) in SHAPES.items():
            x = torch.randn(rows, k, generator=g).bfloat16()
            w = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
            c = candidates(x, w)
            times = {key: [] for key in c}
            for f in c.values():
                f()
            for _ in range(5):
                for key, f in c.items():
                    t = time.perf_counter()
                    for _ in range(10):
                        f()
                    times[key].append((time.perf_counter() - t) / 10 * 1e3)
            print(f"{rows} x {k} x {n} ({name}): " + "; ".join(
                f"{key} {statistics.median(v):.2f}" for key, v in times.items()), flush=True)


if __name__ == "__main__":
    main()
