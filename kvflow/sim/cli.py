"""`kvflow simulate`: replay a workload through the real scheduler on a GPU cost model.

    python -m kvflow.sim.cli --trace splitwise_conv.csv --model Llama-3-8B --gpu h100 \\
        --policy vllm --output out/

kvflow/cli.py mounts the same arguments as its `simulate` subcommand via add_simulate_parser().
Scheduler flags mirror SchedulerConfig's fields (--max-num-batched-tokens, ...).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from kvflow.sim.hardware import get_gpu, get_model
from kvflow.sim.policies import POLICIES
from kvflow.sim.workload import ARRIVALS, SCENARIOS

DESCRIPTION = ("Replay a trace through kvflow's real Scheduler with a discrete-event clock and a "
               "GPU roofline cost model. Writes summary.json, PNG plots and optionally a "
               "step-by-step HTML page. All latencies are simulated, not measured.")
PLOTS = ("timeline", "frontier", "capacity")


def _csv_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _csv_strs(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _spec_config(text: str):
    """--speculative-config JSON -> SpeculativeConfig (the engine's parser, minus its torch)."""
    from kvflow.core.config import SpeculativeConfig
    try:
        return SpeculativeConfig.from_dict(json.loads(text))
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _probability(text: str) -> float:
    v = float(text)
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {v}")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    src = w.add_mutually_exclusive_group()
    src.add_argument("--trace", help="CSV with num_prefill_tokens, num_decode_tokens "
                     "[, arrived_at]; a bare file name is looked up in the traces kvflow ships")
    src.add_argument("--scenario", choices=sorted(SCENARIOS),
                     help="long-short: doc 000's 1 long + 7 short (+14 more short); "
                          "long-prefill: doc 004's 30,000-token prompt among decodes")
    src.add_argument("--synthetic", choices=("fixed", "uniform", "exponential", "lognormal"),
                     help="synthetic lengths around --prompt-len / --output-len")
    w.add_argument("--prompt-len", type=int, default=1024)
    w.add_argument("--output-len", type=int, default=128)
    w.add_argument("--num-requests", type=int, help="use the first N requests")
    w.add_argument("--request-rate", type=float,
                   help="req/s; implies --arrival poisson unless --arrival says otherwise")
    w.add_argument("--arrival", choices=ARRIVALS,
                   help="trace (default with a trace's own times), poisson, gamma, or scaled "
                        "(the trace's gaps scaled to --request-rate)")
    w.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--shared-prefix-len", type=int, default=0,
                   help="every prompt starts with one of --num-shared-prefixes system prompts "
                        "of this many tokens (what prefix caching can hit)")
    w.add_argument("--num-shared-prefixes", type=int, default=1)
    w.add_argument("--priority-threshold", type=int,
                   help="policy priority: prompts up to this many tokens get priority 0, longer "
                        "ones 1 (default: the median prompt length)")

    m = p.add_argument_group("model, hardware and cost model")
    m.add_argument("--model", default="Llama-3-8B", help="a built-in name or a config.json")
    m.add_argument("--gpu", default="h100", help="h100, h200, a100, a100-40gb")
    m.add_argument("--mfu", type=float, help="fraction of peak FLOP/s reached (default 0.6)")
    m.add_argument("--mbu", type=float, help="fraction of peak HBM bandwidth (default 0.8)")
    m.add_argument("--step-overhead-ms", type=float, help="fixed per-step overhead (default 1)")
    m.add_argument("--cost-constants", help="JSON written by --calibrate")
    m.add_argument("--include-scheduler-time", action="store_true",
                   help="add the measured host time of schedule()/update_from_output() to "
                        "each step instead of the constant (makes replays non-deterministic)")
    m.add_argument("--calibrate", metavar="MEASURED.jsonl",
                   help="fit the cost constants to measured steps, report the error, write "
                        "DIR/calibration.json, and exit")

    s = p.add_argument_group("scheduler (SchedulerConfig fields)")
    s.add_argument("--policy", choices=POLICIES, default="vllm")
    s.add_argument("--max-num-batched-tokens", type=int,
                   help="token budget per step (default 8192; nano: max(16384, max_model_len))")
    s.add_argument("--max-num-seqs", type=int, default=256)
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--num-gpu-blocks", type=int,
                   help="KV blocks (default: what fits in --gpu-memory-utilization of the GPU)")
    s.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    s.add_argument("--max-model-len", type=int, help="default: the model's context length")
    s.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=None, help="default on (off for nano)")
    s.add_argument("--long-prefill-token-threshold", type=int, default=0)
    s.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    s.add_argument("--watermark", type=float, default=0.0)
    s.add_argument("--reserve-full-sequence", action=argparse.BooleanOptionalAction, default=True)
    s.add_argument("--speculative-config", type=_spec_config, metavar="JSON",
                   help='speculative decoding, e.g. {"method": "ngram", '
                        '"num_speculative_tokens": 4}: synthetic drafts, accepted at random')
    s.add_argument("--spec-acceptance", type=_probability, default=0.7,
                   help="probability that a draft token is accepted if all before it were "
                        "(seeded by --seed; default 0.7)")

    o = p.add_argument_group("output")
    o.add_argument("--output", default="sim_out", help="directory for summary.json and plots")
    o.add_argument("--plots", type=_csv_strs, default=list(PLOTS),
                   help=f"comma list of {','.join(PLOTS)} (default all); '' for none")
    o.add_argument("--slo-itl-ms", type=float,
                   help="P99 TBT SLO for capacity (default: 5x the modelled decode step of "
                        "batch 32 at 4k context, after Sarathi-Serve's strict SLO)")
    o.add_argument("--max-median-queue-s", type=float, default=2.0)
    o.add_argument("--capacity-policies", type=_csv_strs, default=list(POLICIES))
    o.add_argument("--sweep-requests", type=int, default=500,
                   help="requests per capacity/frontier replay")
    o.add_argument("--capacity-start-rate", type=float, default=1.0)
    o.add_argument("--capacity-max-trials", type=int, default=16)
    o.add_argument("--frontier-rate", type=float,
                   help="req/s for the frontier (default: --request-rate or the trace's rate)")
    o.add_argument("--frontier-budgets", type=_csv_ints, default=[256, 512, 1024, 2048, 4096, 8192])
    o.add_argument("--frontier-thresholds", type=_csv_ints, default=[128, 256, 512, 1024, 2048])
    o.add_argument("--trace-steps", action="store_true",
                   help="also write DIR/steps.html, a step-by-step view of the first steps")
    o.add_argument("--trace-steps-max", type=int, default=300, help="frames in steps.html")
    o.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")


def add_simulate_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("simulate", help="replay a trace through the scheduler on a GPU "
                              "cost model", description=DESCRIPTION)
    add_arguments(p)
    p.set_defaults(func=run_simulate)
    return p


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvflow simulate", description=DESCRIPTION)
    add_arguments(p)
    p.set_defaults(func=run_simulate)
    return p


def _cost_model(args, shape, gpu):
    from kvflow.sim.cost_model import CostConstants, CostModel
    c = CostConstants()
    if args.cost_constants:
        c = CostConstants(**json.loads(Path(args.cost_constants).read_text())["constants"])
    for flag, field, scale in (("mfu", "mfu", 1), ("mbu", "mbu", 1),
                               ("step_overhead_ms", "step_overhead_s", 1e-3)):
        v = getattr(args, flag)
        if v is not None:
            setattr(c, field, v * scale)
    c.__post_init__()
    return CostModel(shape, gpu, c)


def _run_calibration(args, out: Path) -> int:
    from kvflow.sim.calibrate import fit, load_samples
    from kvflow.sim.hardware import GPUSpec, ModelShape
    header, samples = load_samples(args.calibrate)
    shape = (ModelShape(**header["model"]) if isinstance(header.get("model"), dict)
             else get_model(header.get("model", args.model)))
    gpu = GPUSpec(**header["gpu"]) if "gpu" in header else get_gpu(args.gpu)
    cal = fit(shape, gpu, samples)
    print(f"calibration of {shape.name} on {gpu.name}\n{cal.report()}")
    (out / "calibration.json").write_text(json.dumps(
        {"model": shape.name, "gpu": gpu.name, "constants": asdict(cal.constants),
         "fit_mape": cal.fit_mape, "holdout_mape": cal.holdout_mape,
         "holdout_max_ape": cal.holdout_max_ape,
         "default_constants_holdout_mape": cal.default_holdout_mape,
         "num_samples": cal.num_samples}, indent=2))
    return 0


def run_simulate(args: argparse.Namespace) -> int:
    from kvflow.sim import experiment
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    if args.calibrate:
        return _run_calibration(args, out)
    shape, gpu = get_model(args.model), get_gpu(args.gpu)
    summary = experiment.run(args, shape, gpu, _cost_model(args, shape, gpu), out)
    print(experiment.format_report(summary))
    print(f"wrote {out}/summary.json" + "".join(f", {f}" for f in summary["files"]))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"kvflow simulate: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
