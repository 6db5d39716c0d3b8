"""Measure real engine steps and calibrate the simulator's cost model against them.

The steps are kvflow's own: an LLMEngine (the real Scheduler, the real ModelRunner, the model
loaded from its checkpoint) serves a synthetic workload, and every SchedulerOutput the scheduler
produces is timed in ModelRunner.execute_model (this script wraps that method; nothing in the
engine is changed). The workload mixes what the simulator sees: prompts of lognormal lengths
arriving over the run at a rising rate (Poisson in engine steps), greedy outputs of 8-48 tokens,
a CPU-sized token budget, so steps range from a lone decode to a full budget of prefill chunks
beside dozens of decodes. Each step is run `--repeats` times in a row, the runner's request
states restored before each rerun (re-running a SchedulerOutput from the same states is
idempotent under greedy sampling: it rewrites the same K/V into the same slots and samples the
same tokens), the whole workload is served `--passes` times (fresh prompt ids, same schedule),
and each step's minimum over all its runs is kept. The device's peaks (matmul FLOP/s in the
engine's dtype, memory copy bandwidth) are measured first and stand in for the datasheet numbers,
so the fitted mfu/mbu are fractions of what this machine can do.

    python benchmarks/sim_calibrate.py [--model HF_DIR] [--dtype auto] [--requests 80]
        [--passes 2] [--repeats 2] [--threads 1] [--out docs/sim/calibration_cpu.jsonl]

Default model: the embedded SmolLM2-135M-Instruct (bf16 on CPUs with AMX/AVX512-BF16, else
fp32). It then runs the same fit as `kvflow simulate --calibrate FILE` and prints the prediction
error: on the held-out half of the fit (every other step), and on a harder split (fitted on the
first half of the run, checked on the second). The engine is CPU-only in this build, so this is a
CPU calibration; a GPU one needs a GPU model runner.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvflow.sim.calibrate import StepSample, errors, fit                    # noqa: E402
from kvflow.sim.hardware import GPUSpec, ModelShape                         # noqa: E402


def measure_peaks(dtype: torch.dtype, n: int = 2048, copy_mib: int = 256,
                  reps: int = 5) -> tuple[float, float]:
    """Best-of-reps matmul FLOP/s (n x n x n in `dtype`) and copy bandwidth (read + write)."""
    def best(fn):
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return min(ts)

    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    a @ b                                                               # warm-up (oneDNN setup)
    flops = 2 * n**3 / best(lambda: a @ b)
    x = torch.empty(copy_mib << 18, dtype=torch.float32)
    y = torch.empty_like(x)
    y.copy_(x)
    bw = 2 * x.numel() * 4 / best(lambda: y.copy_(x))
    return flops, bw


def engine_shape(engine, name: str) -> ModelShape:
    """The cost model's view of the model the engine loaded (in the dtype it runs)."""
    c = engine.model_config
    return ModelShape(name, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim,
                      c.intermediate_size, c.vocab_size, c.tie_word_embeddings,
                      engine.scheduler_config.max_model_len, engine.dtype.itemsize)


_PASS = itertools.count()


@dataclass(slots=True)
class Arrival:
    step: int               # added to the engine before this engine step
    prompt: list[int]
    max_tokens: int


def make_workload(num_requests: int, vocab: int, seed: int, prompt_median: int = 96,
                  max_prompt: int = 768, output_range: tuple[int, int] = (8, 48),
                  gap_range: tuple[float, float] = (3.0, 0.5), ids_seed: int = 0) -> list[Arrival]:
    """Lognormal prompt lengths (sigma 0.9, clipped to [8, max_prompt]), uniform output lengths,
    Poisson arrivals counted in engine steps whose mean gap falls linearly from gap_range[0] to
    gap_range[1], so the batch grows from one request to many and then drains. The token ids
    (random, so nothing hits the prefix cache) also depend on ids_seed: the same schedule can be
    replayed on one engine with fresh prompts."""
    rng = np.random.default_rng(seed)
    plen = np.clip(rng.lognormal(np.log(prompt_median), 0.9, num_requests), 8, max_prompt)
    olen = rng.integers(output_range[0], output_range[1] + 1, num_requests)
    gaps = rng.exponential(np.linspace(gap_range[0], gap_range[1], num_requests))
    steps = np.floor(np.cumsum(gaps) - gaps[0]).astype(int)
    ids = np.random.default_rng([seed, ids_seed])
    # Token ids from 3 up: clear of the usual special ids (ignore_eos makes it moot anyway).
    return [Arrival(int(s), ids.integers(3, vocab, int(p)).tolist(), int(o))
            for s, p, o in zip(steps, plen, olen)]


def _copy_states(states: dict) -> dict:
    return {rid: dataclasses.replace(st, token_ids=list(st.token_ids),
                                     block_ids=list(st.block_ids)) for rid, st in states.items()}


def time_engine_steps(engine, workload: list[Arrival], repeats: int = 2,
                      max_steps: int | None = None) -> list[StepSample]:
    """Serve the workload on the engine; time each step's execute_model (min of `repeats` runs).

    Each sample's reqs are (tokens scheduled, context length after the step) per request, read
    from the SchedulerOutput when execute_model is called.
    """
    from kvflow.sampling_params import SamplingParams

    runner = engine.runner
    execute = runner.execute_model
    samples: list[StepSample] = []

    def timed(so, grammar_bitmask=None):
        ctx = so.context_lens()
        reqs = [(n, ctx[rid]) for rid, n in so.num_scheduled_tokens.items()]
        best, out = float("inf"), None
        before = _copy_states(runner.requests)
        for k in range(max(1, repeats)):
            if k:
                runner.requests = _copy_states(before)
            t0 = time.perf_counter()
            out = execute(so, grammar_bitmask)
            best = min(best, time.perf_counter() - t0)
        if reqs:
            samples.append(StepSample(reqs, best))
        return out

    pending = sorted(workload, key=lambda a: a.step)
    tag = next(_PASS)
    runner.execute_model = timed
    try:
        step, i = 0, 0
        while (i < len(pending) or engine.has_unfinished_requests()) and \
                (max_steps is None or step < max_steps):
            while i < len(pending) and (pending[i].step <= step
                                        or not engine.has_unfinished_requests()):
                a = pending[i]
                engine.add_request(f"cal{tag}-{i}", a.prompt, SamplingParams(
                    temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True))
                i += 1
            engine.step()
            step += 1
    finally:
        del runner.execute_model                # back to the class's method
    return samples


def write_samples(path: str | Path, shape: ModelShape, gpu: GPUSpec,
                  samples: list[StepSample], measured: dict) -> None:
    with open(path, "w") as f:
        f.write(json.dumps({"model": asdict(shape), "gpu": asdict(gpu),
                            "measured": measured}) + "\n")
        for k, s in enumerate(samples):
            f.write(json.dumps({"step": k, "seconds": round(s.seconds, 7),
                                "reqs": [list(r) for r in s.reqs]}) + "\n")


def source_version() -> str:
    """The commit the engine was loaded from, '+dirty' when kvflow/ has uncommitted changes."""
    import subprocess
    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                             capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "kvflow"], cwd=root,
                               text=True, capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + ("+dirty" if dirty else "")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="HF checkpoint dir or .gguf (default: the embedded SmolLM2-135M)")
    p.add_argument("--name", default=None, help="shape name in the output (default: from --model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--requests", type=int, default=80)
    p.add_argument("--prompt-median", type=int, default=96)
    p.add_argument("--max-prompt", type=int, default=768)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-steps", type=int, default=None, help="stop timing after this many steps")
    p.add_argument("--repeats", type=int, default=2,
                   help="run each step this often in a row, keep the min")
    p.add_argument("--passes", type=int, default=2,
                   help="serve the workload this often (fresh prompt ids, same schedule) and "
                        "keep each step's min over all runs: spreads the runs of a step over "
                        "time, so one burst of load on a shared machine does not hit them all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: steadier timings on a shared 2-core machine)")
    p.add_argument("--peak-matmul-n", type=int, default=2048, help=argparse.SUPPRESS)
    p.add_argument("--peak-copy-mib", type=int, default=256, help=argparse.SUPPRESS)
    p.add_argument("--out", default="docs/sim/calibration_cpu.jsonl")
    a = p.parse_args(argv)

    from kvflow.engine.llm_engine import EngineArgs, LLMEngine

    version = source_version()
    load0 = os.getloadavg()[0]
    t_start = time.perf_counter()
    engine = LLMEngine(EngineArgs(model=a.model, dtype=a.dtype, num_threads=a.threads,
                                  max_num_batched_tokens=a.max_num_batched_tokens,
                                  max_num_seqs=a.max_num_seqs, seed=a.seed))
    name = a.name or (Path(a.model).name if a.model else "SmolLM2-135M-Instruct")
    shape = engine_shape(engine, name)
    max_prompt = min(a.max_prompt, shape.max_model_len - 64)
    flops, bw = measure_peaks(engine.dtype, a.peak_matmul_n, a.peak_copy_mib)
    dt = str(engine.dtype).removeprefix("torch.")
    gpu = GPUSpec(f"{cpu_name()}, {torch.get_num_threads()} thread(s) (measured peaks)", flops, bw,
                  0, f"measured by sim_calibrate.py: {dt} matmul, fp32 copy")
    print(f"{name} ({dt}, {shape.num_params / 1e6:.1f}M params) loaded in "
          f"{engine.load_time:.1f} s; device peaks: {flops / 1e9:.1f} GFLOP/s {dt} matmul, "
          f"{bw / 1e9:.1f} GB/s copy; torch threads {torch.get_num_threads()}")

    t0 = time.perf_counter()
    samples: list[StepSample] = []
    for k in range(max(1, a.passes)):
        wl = make_workload(a.requests, shape.vocab_size, a.seed, a.prompt_median, max_prompt,
                           ids_seed=k)
        got = time_engine_steps(engine, wl, a.repeats, a.max_steps)
        if not samples:
            samples = got
        elif [s.reqs for s in got] == [s.reqs for s in samples]:
            samples = [StepSample(s.reqs, min(s.seconds, g.seconds))
                       for s, g in zip(samples, got)]
        else:           # not expected: the schedule depends on lengths and arrivals only
            print(f"pass {k + 1} scheduled different steps; keeping the earlier passes")
            break
    took = time.perf_counter() - t0
    load1 = os.getloadavg()[0]
    sizes = [len(s.reqs) for s in samples]
    n_mixed = sum(any(n > 1 for n, _ in s.reqs) for s in samples)
    print(f"timed {len(samples)} engine steps ({n_mixed} with a prefill chunk, "
          f"{len(samples) - n_mixed} pure decode; 1-{max(sizes)} requests, "
          f"{min(sum(n for n, _ in s.reqs) for s in samples)}-"
          f"{max(sum(n for n, _ in s.reqs) for s in samples)} tokens; "
          f"min of {a.passes} x {a.repeats} runs each) in {took:.0f} s; "
          f"load average {load0:.2f} -> {load1:.2f}; kvflow at {version}")

    measured = {"runner": "kvflow.model.runner.model_runner.ModelRunner.execute_model",
                "commit": version,
                "dtype": dt,
                "threads": torch.get_num_threads(), "passes": a.passes, "repeats": a.repeats,
                "requests": a.requests, "max_num_batched_tokens": a.max_num_batched_tokens,
                "max_num_seqs": a.max_num_seqs, "seed": a.seed,
                "loadavg_1min": [round(load0, 2), round(load1, 2)],
                "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    write_samples(a.out, shape, gpu, samples, measured)

    cal = fit(shape, gpu, samples)
    print(f"calibration of {shape.name} ({dt}) on {gpu.name}\n{cal.report()}")
    half = len(samples) // 2
    if half >= 4:
        early = fit(shape, gpu, samples[:half])
        late = errors(shape, gpu, early.constants, samples[half:])
        print(f"time split (fitted on steps 0-{half - 1}, checked on {half}-{len(samples) - 1}): "
              f"{late.mean():.1%} mean, {late.max():.1%} max")
    print(f"wrote {a.out} ({time.perf_counter() - t_start:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
