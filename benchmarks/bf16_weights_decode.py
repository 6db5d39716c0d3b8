"""Single-stream decode of a bf16 checkpoint with dtype="auto" on a CPU without fast bf16: its
weights kept bf16 for kvflow's bf16w_linear (new) against float32 copies (KVFLOW_CPU_BF16W=0, old).

    python benchmarks/bf16_weights_decode.py [THREADS] [--model DIR] [--steps 64] [--rounds 5]

Both engines load up front; each round times one request's decode steps on each, alternating, and
prints the median tok/s per path. KVFLOW_CPU_BF16_PACK=0 is set so that CPUs which can pack bf16
take the same path. The model defaults to make_bench_model.py's 62.9M bf16 Llama.
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from kvflow import envs
envs.set_process_defaults()     # first: GOMP_SPINCOUNT must be set before torch loads
from kvflow import SamplingParams  # noqa: E402
from kvflow.engine import EngineArgs, LLMEngine  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))


def load(model: str, threads: int, bf16w: str) -> LLMEngine:
    os.environ["KVFLOW_CPU_BF16W"] = bf16w      # read while the model loads
    return LLMEngine(EngineArgs(model=model, num_threads=threads, dtype="auto"))


def weight_mib(e: LLMEngine) -> float:
    return sum(p.numel() * p.element_size() for p in e.runner.model.parameters()) / 2 ** 20


def tok_per_s(e: LLMEngine, steps: int, rid: str) -> float:
    e.add_request(rid, list(range(3, 35)), SamplingParams(temperature=0, max_tokens=steps + 1,
                                                          ignore_eos=True))
    e.step()        # the prefill
    t = time.perf_counter()
    for _ in range(steps):
        e.step()
    return steps / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("threads", type=int, nargs="?", default=2)
    ap.add_argument("--model", default=None)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    os.environ["KVFLOW_CPU_BF16_PACK"] = "0"
    if a.model is None:
        from make_bench_model import ensure_model
        a.model = str(ensure_model())
    from cpu_info import cpu_line
    print(cpu_line())
    engines = {"bf16 weights kept (bf16w_linear)": load(a.model, a.threads, "1"),
               "float32 weight copies (old)": load(a.model, a.threads, "0")}
    for name, e in engines.items():
        print(f"{name}: dtype {e.dtype}, weights {weight_mib(e):.0f} MiB")
    rates = {name: [] for name in engines}
    for r in range(a.rounds):
        for name, e in engines.items():
            rates[name].append(tok_per_s(e, a.steps, f"{r}"))
    for name, v in rates.items():
        print(f"{name}: median {statistics.median(v):.1f} tok/s "
              f"(rounds: {', '.join(f'{x:.1f}' for x in v)})")


if __name__ == "__main__":
    main()
