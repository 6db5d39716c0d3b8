"""kvflow's quantized GEMV/GEMM (torch.ops.kvflow.quant_linear, csrc/cpu_quant.cpp) against
float32 F.linear on the dequantized weight, at the default model's (SmolLM2-135M) shapes:

    python benchmarks/quant_gemv.py [ROUNDS] [--qtypes Q4_1,Q8_0] [--tokens 1,2,4,8,16,32,128]
                                    [--shapes qkv,o,gate_up,down,lm_head] [--threads 2]

    python benchmarks/quant_gemv.py --walk [--tokens 1,32]

Per shape, qtype and token count T: median ms per call over alternating rounds (quant, float,
quant, ...), and effective GB/s = weight bytes read per call / time (the blocks for quant_linear,
the float32 matrix for F.linear). The last rows sum one decode token (T=1) over the whole model:
30 layers of qkv + o + gate_up + down in the linears' qtype, plus the Q8_0 LM head.
That sum repeats each matrix, which then sits in L3; --walk instead times one whole model step
over 30 distinct layers' weights (~85 MB at Q4_1, as a decode step reads them: from DRAM) and
prints the median ms per step and per token.
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from cpu_info import cpu_line
from skinny_gemm import medians

from kvflow.model.kernels import cpu_ops
from kvflow.model.quantization import quant

# name: (in_features, out_features)
SHAPES = {"qkv": (576, 576 + 2 * 192), "o": (576, 576), "gate_up": (576, 2 * 1536),
          "down": (1536, 576)}
LM_HEAD = ("lm_head", 576, 49152)
LAYERS = 30


def make_qweight(qtype: int, o: int, i: int) -> torch.Tensor:
    w = torch.randn(o, i) * 0.05
    if qtype == quant.Q4_1:
        return quant.quantize_q4_1(w)
    if qtype == quant.KVFLOW_I8_PC:
        return quant.quantize_int8_pc(w)
    from gguf.quants import quantize
    return torch.from_numpy(quantize(w.numpy(), qtype))


def bench(name, qtype, i, o, tokens, rounds, totals):
    qw = make_qweight(qtype, o, i)
    wf = torch.ops.kvflow.quant_dequantize(qw, qtype, i)
    qbytes, fbytes = qw.numel(), wf.numel() * 4
    for t in tokens:
        x = torch.randn(t, i)
        calls = max(5, int(rounds * min(50.0, 2e7 / (o * i * max(t, 4)))))
        m = medians({"q": lambda: torch.ops.kvflow.quant_linear(x, qw, qtype, i),
                     "f": lambda: F.linear(x, wf)}, calls)
        if t == 1:
            n = 1 if name == "lm_head" else LAYERS
            totals["q"] += n * m["q"]
            totals["f"] += n * m["f"]
            totals["qb"] += n * qbytes
            totals["fb"] += n * fbytes
        print(f"| {name} {i}x{o} | {quant.NAMES[qtype]} | {t} | {m['q']:.3f} | "
              f"{qbytes / m['q'] / 1e6:.1f} | {m['f']:.3f} | {fbytes / m['f'] / 1e6:.1f} | "
              f"{m['f'] / m['q']:.2f}x |", flush=True)


def model_walk(op, qtype: int, tokens, rounds: int) -> None:
    """Median time of one model step (30 layers of distinct weights + the LM head) per T."""
    layers = [{n: make_qweight(qtype, o, i) for n, (i, o) in SHAPES.items()} for _ in range(LAYERS)]
    head = make_qweight(quant.Q8_0, LM_HEAD[2], LM_HEAD[1])
    nbytes = sum(w.numel() for lay in layers for w in lay.values()) + head.numel()
    for t in tokens:
        xs = {i: torch.randn(t, i) for i in {576, 1536}}

        def step():
            for lay in layers:
                for n, (i, o) in SHAPES.items():
                    op(xs[i], lay[n], qtype, i)
            op(xs[576], head, quant.Q8_0, 576)
        step()
        times = []
        for _ in range(max(3, rounds)):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
        m = statistics.median(times)
        print(f"| model step, {quant.NAMES[qtype]} layers + Q8_0 head | T={t} | {m:.2f} ms | "
              f"{m / t:.3f} ms/token | {nbytes / m / 1e6:.1f} GB/s |", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("rounds", nargs="?", type=int, default=10)
    ap.add_argument("--qtypes", default="Q4_1,Q8_0")
    ap.add_argument("--tokens", default="1,2,4,8,16,32,128")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down,lm_head")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--walk", action="store_true", help="whole model steps over distinct weights")
    a = ap.parse_args()
    assert cpu_ops.available(), "kvflow's CPU kernels are not built"
    torch.set_num_threads(a.threads)
    tokens = [int(t) for t in a.tokens.split(",")]
    names = {v: k for k, v in quant.NAMES.items()}
    shapes = a.shapes.split(",")
    print(cpu_line())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"quant ISA {torch.ops.kvflow.quant_isa()}")
    if a.walk:
        for qname in a.qtypes.split(","):
            model_walk(torch.ops.kvflow.quant_linear, names[qname], tokens, a.rounds)
        return
    print("| shape (I x O) | qtype | T | quant_linear ms | GB/s | F.linear fp32 ms | GB/s | "
          "speedup |\n|---|---|---|---|---|---|---|---|")
    for qname in a.qtypes.split(","):
        qtype = names[qname]
        totals = dict(q=0.0, f=0.0, qb=0, fb=0)
        for name in shapes:
            if name == "lm_head":
                continue
            i, o = SHAPES[name]
            bench(name, qtype, i, o, tokens, a.rounds, totals)
        if "lm_head" in shapes:
            bench(LM_HEAD[0], quant.Q8_0, LM_HEAD[1], LM_HEAD[2], tokens, a.rounds, totals)
        if 1 in tokens and len(shapes) == 5:
            print(f"| whole model, T=1 ({LAYERS} layers {qname} + Q8_0 head) | | 1 | "
                  f"{totals['q']:.2f} | {totals['qb'] / totals['q'] / 1e6:.1f} | "
                  f"{totals['f']:.2f} | {totals['fb'] / totals['f'] / 1e6:.1f} | "
                  f"{totals['f'] / totals['q']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
