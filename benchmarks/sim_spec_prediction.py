"""Predict what n-gram speculation (k=4) does to kvflow's CPU output tok/s, with the simulator.

    python benchmarks/sim_spec_prediction.py [--prompt-len 128] [--output-len 256] [--seeds 8]

Model: SmolLM2-135M (kvflow's default model), float32, the engine on the 2-core dev VM. Two cost
models, because the simulator's CPU roofline cannot represent the measured small-T behaviour:

- table: the engine step time of one request verifying T rows, measured on this VM with
  benchmarks/spec_step_cost.py (MEASURED_S below; interpolated between, extended past 16), plus
  roofline decode attention at the VM's measured fp32 peaks and 2.72 ms per extra request (the
  CPU calibration's host term). The "range" column re-runs it with T=1 at 40 and 60 ms.
- roofline: the simulator's CostModel with the constants fitted to docs/sim/calibration_cpu.jsonl
  (bf16, one thread, 2026-11-22): extra rows are nearly free (weight-bound), i.e. what a CPU
  step that followed the roofline would give; an upper bound for after the kernel fix.

Drafts are synthetic (every n-gram lookup hits), each accepted with probability alpha if all
before it were. The real proposer drafts only when the n-gram matches, so a measured run mixes
verification steps with plain decodes; compare against it through the measured tokens per
verification and acceptance rate (vllm:spec_decode_* style), not alpha alone.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvflow.core.config import SpeculativeConfig                           # noqa: E402
from kvflow.sim import CostConstants, CostModel, get_model, scheduler_config, simulate  # noqa
from kvflow.sim.calibrate import fit, load_samples                          # noqa: E402
from kvflow.sim.cost_model import RowTableCostModel                         # noqa: E402
from kvflow.sim.hardware import GPUSpec, ModelShape                         # noqa: E402
from kvflow.sim.workload import synthetic                                   # noqa: E402

# benchmarks/spec_step_cost.py, one request with m drafts = 1 + m rows, after the skinny GEMM
# kernel (2026-11-23): 2 rows 40 ms, 3: 47, 5: 53, 9: 85, 16: 141; one row 43 ms (two requests
# without drafts; the first, one-row configuration also paid the KV cache's first touch, 60 ms).
MEASURED_S = {1: 0.043, 2: 0.043, 3: 0.047, 5: 0.053, 9: 0.085, 16: 0.141}
T1_RANGE = (0.040, 0.060)
# torch 2.13 on this VM, 2 threads, best of 5: fp32 1024^3 matmul, fp32 copy (read + write).
CPU_FP32 = GPUSpec("dev VM, 2 cores, fp32 (measured)", 85.9e9, 26.8e9, 0,
                   "torch matmul / copy on the 2-core dev VM, 2026-11-23")
K = 4
ALPHAS = (0.3, 0.5, 0.6, 0.7, 0.8, 0.9)


def table_model(t1: float) -> CostModel:
    shape = dataclasses.replace(get_model("SmolLM2-135M"), dtype_bytes=4)
    c = CostConstants(mfu=1.0, mbu=1.0, step_overhead_s=0.0, host_s_per_request=2.72e-3)
    return RowTableCostModel(shape, CPU_FP32, MEASURED_S | {1: t1}, c)


def roofline_model() -> CostModel:
    header, samples = load_samples(ROOT / "docs/sim/calibration_cpu.jsonl")
    shape, gpu = ModelShape(**header["model"]), GPUSpec(**header["gpu"])
    return CostModel(shape, gpu, fit(shape, gpu, samples).constants)


def replay(cost: CostModel, batch: int, args, alpha: float | None) -> tuple[float, float, dict]:
    """(output tokens, simulated seconds, spec stats summed) over args.seeds replays."""
    spec = None if alpha is None else SpeculativeConfig(num_speculative_tokens=K)
    cfg = scheduler_config("vllm", num_blocks=4096, max_num_batched_tokens=2048,
                           max_num_seqs=max(batch, 1), max_model_len=8192,
                           speculative_config=spec)
    wl = synthetic(batch, args.prompt_len, args.output_len)
    tok = secs = 0.0
    st = {"verifications": 0, "drafted": 0, "accepted": 0}
    for seed in range(args.seeds if alpha is not None else 1):
        r = simulate(wl, cost, cfg, spec_acceptance=alpha or 0.0, spec_seed=seed)
        tok += float(r.num_output.sum())
        secs += r.sim_time
        if r.spec is not None:
            st["verifications"] += r.spec.num_drafts
            st["drafted"] += r.spec.num_draft_tokens
            st["accepted"] += r.spec.num_accepted_tokens
    return tok, secs, st


def speedup(cost: CostModel, batch: int, args, alpha: float) -> tuple[float, float, dict]:
    tok0, s0, _ = replay(cost, batch, args, None)
    tok1, s1, st = replay(cost, batch, args, alpha)
    return tok1 / s1 / (tok0 / s0), tok0 / s0, st


def rows(args) -> list[str]:
    models = {"table": table_model(MEASURED_S[1]), "lo": table_model(T1_RANGE[0]),
              "hi": table_model(T1_RANGE[1]), "roof": roofline_model()}
    out = []
    for batch in (1, 32):
        for alpha in ALPHAS if batch == 1 else (ALPHAS[0], ALPHAS[-1]):
            sp, base, st = speedup(models["table"], batch, args, alpha)
            lo = speedup(models["lo"], batch, args, alpha)[0]
            hi = speedup(models["hi"], batch, args, alpha)[0]
            roof = speedup(models["roof"], batch, args, alpha)[0]
            v = st["verifications"]
            acc = f"{st['accepted'] / st['drafted']:.1%}" if v else "-"
            tpv = f"{1 + st['accepted'] / v:.2f}" if v else "-"
            out.append(f"{batch:>5} {alpha:>5.1f} {K if v else 0:>6} {acc:>8} {tpv:>8} "
                       f"{base:>10.1f} {base * sp:>10.1f} {sp:>8.2f}x {lo:>5.2f}-{hi:.2f}x "
                       f"{roof:>9.2f}x")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--seeds", type=int, default=8, help="replays per acceptance rate")
    args = p.parse_args()
    t = table_model(MEASURED_S[1])
    print(f"SmolLM2-135M fp32, 2-core CPU, n-gram speculation k={K} (max_batch_tokens "
          f"{SpeculativeConfig().max_batch_tokens}); "
          f"prompt {args.prompt_len}, output {args.output_len} tokens, all requests at t=0; "
          f"{args.seeds} seeds per alpha. Simulated, not measured.")
    print(f"table model step cost: T=1 {t.rows_time(1) * 1e3:.0f} ms, T={K + 1} "
          f"{t.rows_time(K + 1) * 1e3:.0f} ms -> speculation pays once tokens/verification "
          f"> {t.rows_time(K + 1) / t.rows_time(1):.2f}")
    print(f"{'batch':>5} {'alpha':>5} {'drafts':>6} {'acc.rate':>8} {'tok/ver':>8} "
          f"{'tok/s off':>10} {'tok/s on':>10} {'speedup':>9} {'T1 40-60ms':>11} "
          f"{'roofline':>10}")
    for line in rows(args):
        print(line)
    print("drafts: per verification at that batch (num_drafts_for); acc.rate: accepted / "
          "drafted tokens; tok/ver: tokens emitted per verification step (1 + accepted); "
          "tok/s: table model; roofline: CPU-calibrated roofline (bf16, weight-bound, so extra "
          "rows nearly free).")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
