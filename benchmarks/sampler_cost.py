"""What vLLM's sampling extras cost per engine step at 64 running requests on the default model
(SmolLM2-135M, vocab 49152): plain sampling (temperature 0.8, top_p 0.95) against the same with
presence/frequency/repetition penalties, logprobs=5 and a JSON schema (structured outputs).

Times, per decode step with all 64 requests running (median over steps, then over rounds; the
two configurations alternate, so a noisy neighbour hits both):
  step      EngineCore.step: schedule, forward, grammar bitmasks, sampling, update
  sampling  the runner's sample() (bias, penalties, the draw, logprobs) plus the grammar
            bitmask's fill (engine core) and application (runner)

    python benchmarks/sampler_cost.py [--rounds 3] [--requests 64] [--tokens 24] [--seed S]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_info import cpu_line  # noqa: E402

from kvflow import envs  # noqa: E402
envs.set_process_defaults()     # first: GOMP_SPINCOUNT must be set before torch loads
from kvflow import LLM, SamplingParams  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
    "score": {"type": "integer"}}, "required": ["name", "tags", "score"]}


def configs(tokens: int, seed: int | None) -> dict[str, SamplingParams]:
    base = dict(temperature=0.8, top_p=0.95, seed=seed, max_tokens=tokens, ignore_eos=True)
    extra = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
                 logprobs=5)
    try:
        from kvflow.sampling_params import StructuredOutputsParams
        extra["structured_outputs"] = StructuredOutputsParams(json=SCHEMA)
    except ImportError:
        pass
    return {"plain": SamplingParams(**base), "extras": SamplingParams(**base, **extra)}


class Timers:
    """Wall time of named callables, per step (methods patched on their instances)."""

    def __init__(self) -> None:
        self.cur: dict[str, float] = {}

    def wrap(self, obj, name: str, key: str) -> None:
        fn = getattr(obj, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.cur[key] = self.cur.get(key, 0.0) + time.perf_counter() - t0
        timed.__wrapped__ = fn
        setattr(obj, name, timed)


def run(llm: LLM, sp: SamplingParams, n: int) -> tuple[float, float]:
    """(median step ms, median sampling ms) over steps with n requests decoding."""
    core = llm.llm_engine.engine_core
    timers = Timers()
    timers.wrap(core.runner, "sample", "sampling")
    for obj, name in grammar_hooks(core):
        timers.wrap(obj, name, "sampling")
    steps, samplings = [], []
    step = core.step

    def timed_step():
        timers.cur = {}
        t0 = time.perf_counter()
        out = step()
        dt = time.perf_counter() - t0
        running = core.scheduler.running        # a decode step: every request past its prompt
        if len(running) == n and all(r.num_output_tokens > 1 for r in running):
            steps.append(dt)
            samplings.append(timers.cur.get("sampling", 0.0))
        return out
    core.step = timed_step
    try:
        prompts = [f"Describe item number {i} as JSON:" for i in range(n)]
        llm.generate(prompts, sp, use_tqdm=False)
    finally:
        del core.step
        for obj, name in grammar_hooks(core):   # unwrap (instance attribute or module global)
            if obj.__dict__.get(name) is not None and hasattr(obj.__dict__[name], "__wrapped__"):
                setattr(obj, name, obj.__dict__[name].__wrapped__)
    return statistics.median(steps) * 1e3, statistics.median(samplings) * 1e3


def grammar_hooks(core) -> list[tuple[object, str]]:
    """The grammar bitmask's fill (the core's manager, made now rather than at the first
    structured request) and its application (the runner module's function)."""
    import kvflow.model.runner.model_runner as runner_module
    return [(core._structured_outputs(), "grammar_bitmask"),
            (runner_module, "apply_grammar_bitmask")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=None,
                    help="seed every request (each then draws from its own generator)")
    a = ap.parse_args()
    llm = LLM(dtype="float32", max_num_seqs=a.requests, num_threads=a.threads)
    cfgs = configs(a.tokens, a.seed)
    print(f"CPU: {cpu_line()}")
    names = ("presence_penalty", "logprobs", "structured_outputs")
    print("extras:", ", ".join(k for k in names if getattr(cfgs["extras"], k, None)))
    res = {k: [] for k in cfgs}
    run(llm, cfgs["plain"], a.requests)     # warm-up
    for r in range(a.rounds):
        for name, sp in cfgs.items():
            res[name].append(run(llm, sp, a.requests))
            print(f"round {r} {name:6s} step {res[name][-1][0]:7.2f} ms, "
                  f"sampling {res[name][-1][1]:6.2f} ms", flush=True)
    med = {k: (statistics.median(s for s, _ in v), statistics.median(x for _, x in v))
           for k, v in res.items()}
    (ps, px), (es, ex) = med["plain"], med["extras"]
    print(f"\nmedian step: plain {ps:.2f} ms, extras {es:.2f} ms ({es / ps - 1:+.1%})")
    print(f"median sampling: plain {px:.2f} ms, extras {ex:.2f} ms "
          f"(+{ex - px:.2f} ms = {(ex - px) / ps:+.1%} of a plain step)")


if __name__ == "__main__":
    main()
