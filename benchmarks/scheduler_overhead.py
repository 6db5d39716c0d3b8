"""Scheduler CPU overhead in steady-state decode.

N requests are prefilled, then every step each one decodes one token with a fake executor (the
sampled ids are precomputed, so only schedule() and update_from_output() are timed). Prints
microseconds per step and per running request, median over repeats.

    python benchmarks/scheduler_overhead.py [--num-running 256 512 1024] [--steps 200]
"""
from __future__ import annotations

from overhead_common import parser, run, time_steps, workload

from kvflow import SamplingParams
from kvflow.core import Request, Scheduler, SchedulerConfig


def build(n: int, seed: int, block_size: int) -> tuple[Scheduler, dict[str, list[int]]]:
    prompts, tokens = workload(n, seed)
    cfg = SchedulerConfig(block_size=block_size, num_blocks=1 << 17, max_num_seqs=n,
                          max_num_batched_tokens=8192, max_model_len=8192)
    sched = Scheduler(cfg)
    sp = SamplingParams(max_tokens=4096, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        sched.add_request(Request(f"req-{i}", prompt, sp, eos_token_id=2))
    # Prefill until every request is one token behind: a pure decode state.
    while sched.waiting or any(r.num_tokens - r.num_computed_tokens != 1 for r in sched.running):
        sched.update_from_output(sched.schedule(), tokens)
    return sched, tokens


def main() -> None:
    a = parser(__doc__).parse_args()

    def measure(n: int, seed: int) -> dict:
        sched, tokens = build(n, seed, a.block_size)
        return time_steps(sched.schedule, lambda so: sched.update_from_output(so, tokens),
                          n, a.steps)

    run("kvflow scheduler overhead", measure, a)


if __name__ == "__main__":
    main()
