"""Time one engine step: a batch of N prompts prefilled in one step, then the median decode step.

    python benchmarks/decode_step.py [THREADS] [--model DIR] [--dtype auto|bfloat16|float32]

The model defaults to the 62.9M bench Llama of make_bench_model.py. Used for the before/after
numbers of the decode-path optimisations in BENCHMARKS.md (one thread, 256 x 32-token prompts).
"""
import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from kvflow import envs
envs.set_process_defaults()     # first: GOMP_SPINCOUNT must be set before torch loads
from kvflow import SamplingParams  # noqa: E402
from kvflow.engine import EngineArgs, LLMEngine  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("threads", type=int, nargs="?", default=2)
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--dtype", default="auto")
    # Measurement only: bf16 weights as loaded, through torch's own unpacked bf16 matmul.
    ap.add_argument("--plain-bf16-linears", action="store_true")
    # The whole batch prefills in one step, so the timed steps are all decodes.
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    a = ap.parse_args()
    if a.plain_bf16_linears:
        from kvflow.model.models import layers
        layers.prepare_linears = lambda linears, dtype, device: None
    if a.model is None:
        from make_bench_model import ensure_model
        a.model = str(ensure_model())
    e = LLMEngine(EngineArgs(model=a.model, num_threads=a.threads, dtype=a.dtype,
                             max_num_batched_tokens=max(a.max_num_batched_tokens, 32 * a.num_prompts)))
    rng = random.Random(0)
    sp = SamplingParams(temperature=0, max_tokens=a.steps + 1, ignore_eos=True)
    for i in range(a.num_prompts):
        e.add_request(str(i), [rng.randrange(e.model_config.vocab_size) for _ in range(32)], sp)
    t = time.perf_counter()
    e.step()
    prefill = time.perf_counter() - t
    ts = []
    for _ in range(a.steps):
        t = time.perf_counter()
        e.step()
        ts.append(time.perf_counter() - t)
    med = statistics.median(ts)
    print(f"threads {a.threads}: prefill step {prefill * 1e3:.0f} ms; decode step median "
          f"{med * 1e3:.1f} ms, min {min(ts) * 1e3:.1f} ms -> {a.num_prompts / med:.0f} tok/s")


if __name__ == "__main__":
    main()
