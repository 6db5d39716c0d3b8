"""Replays of trace slices: determinism, the metrics' bookkeeping, and what each policy does to
the real scheduler's steps."""
import numpy as np
import pytest

from kvflow.sim import CostModel, get_gpu, get_model, scheduler_config, simulate, summarize
from kvflow.sim.metrics import request_metrics
from kvflow.sim.workload import (data_dir, load_trace, synthetic, with_arrivals, with_priorities,
                                 with_shared_prefix)

CM = CostModel(get_model("Llama-3-8B"), get_gpu("h100"))
CONV = data_dir() / "splitwise_conv.csv"


def _conv(n, rate, seed):
    return with_arrivals(load_trace(CONV).head(n), "poisson", rate, seed)


def test_replay_is_deterministic_for_a_seed():
    cfg = scheduler_config("vllm", num_blocks=4000, max_num_batched_tokens=2048)
    a = simulate(_conv(300, 12.0, seed=3), CM, cfg)
    b = simulate(_conv(300, 12.0, seed=3), CM, cfg)
    c = simulate(_conv(300, 12.0, seed=4), CM, cfg)
    for field in ("first_scheduled", "first_token", "finish", "itl", "preemptions"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    for k in a.steps:
        np.testing.assert_array_equal(a.steps[k], b.steps[k])
    assert a.sim_time == b.sim_time
    sa, sc = summarize(a), summarize(c)
    assert sa["mean_ttft_ms"] != sc["mean_ttft_ms"]     # another seed, other arrivals
    assert sa["total_output_tokens"] == sc["total_output_tokens"]   # same requests


def test_trace_replay_keeps_the_traces_arrival_times_and_lengths():
    wl = load_trace(CONV).head(200)
    r = simulate(wl, CM, scheduler_config("vllm", num_blocks=20_000))
    s = summarize(r)
    assert s["completed"] == 200
    np.testing.assert_array_equal(r.num_output, wl.output_lens)
    assert (r.first_scheduled >= r.arrival).all()
    assert s["total_output_tokens"] == int(wl.output_lens.sum())
    assert s["duration_s"] >= wl.duration


def test_metrics_bookkeeping_per_request():
    wl = with_arrivals(synthetic(120, 600, 40, "uniform", seed=1), "poisson", 20.0, seed=1)
    r = simulate(wl, CM, scheduler_config("vllm", num_blocks=3000, max_num_batched_tokens=1024))
    m = request_metrics(r)
    assert (m["queue"] >= 0).all()
    assert (m["ttft"] >= m["queue"]).all()
    assert (m["e2e"] >= m["ttft"]).all()
    # One ITL per token after the first; TPOT is their per-request mean.
    assert len(r.itl) == int((wl.output_lens - 1).sum())
    assert np.isclose(np.nansum(m["tpot"] * (r.num_output - 1)), r.itl.sum())
    # The clock only advances by modelled steps (plus idle jumps to the next arrival).
    assert np.all(np.diff(r.steps["t"]) >= r.steps["dt"][:-1] - 1e-12)


def test_idle_time_is_skipped_not_stepped_through():
    wl = synthetic(2, 100, 5)
    wl.arrivals[:] = [0.0, 3600.0]
    r = simulate(wl, CM, scheduler_config("vllm", num_blocks=100))
    assert r.num_steps == 10                # 5 steps per request, none while idle
    assert r.first_scheduled[1] == 3600.0


def test_kv_pressure_preempts_and_every_request_still_completes():
    wl = synthetic(40, 400, 300, "uniform", seed=2)
    r = simulate(wl, CM, scheduler_config("vllm", num_blocks=120, max_num_seqs=32))
    s = summarize(r)
    assert s["completed"] == 40
    assert s["num_preemptions"] > 0 and s["num_preempted_requests"] > 0
    assert s["max_kv_usage"] > 0.9


def test_prefix_caching_cuts_ttft_when_prompts_share_a_system_prompt():
    wl = with_arrivals(with_shared_prefix(synthetic(200, 2048, 32, seed=5), 1536),
                       "poisson", 15.0, seed=5)
    on = summarize(simulate(wl, CM, scheduler_config("vllm", num_blocks=8000)))
    off = summarize(simulate(wl, CM, scheduler_config("vllm", num_blocks=8000,
                                                      enable_prefix_caching=False)))
    assert on["mean_ttft_ms"] < 0.6 * off["mean_ttft_ms"]
    assert on["completed"] == off["completed"] == 200


def _steps_of(policy, wl, **cfg):
    seen = []
    simulate(wl, CM, scheduler_config(policy, **cfg), policy,
             step_hook=lambda drv, so, outs, t0, t1: seen.append(
                 (so, {rid: drv.scheduler.requests[rid].num_prompt_tokens
                       for rid in so.scheduled_new_req_ids if rid in drv.scheduler.requests})))
    return seen


def test_nano_steps_are_prefill_only_or_decode_only_and_never_chunk():
    wl = with_arrivals(synthetic(80, 700, 60, "uniform", seed=7), "poisson", 25.0, seed=7)
    steps = _steps_of("nano", wl, num_blocks=4000)
    mixed = [so for so, _ in steps if so.scheduled_new_req_ids and so.scheduled_running_req_ids]
    assert not mixed
    for so, prompts in steps:
        for rid, n_prompt in prompts.items():
            assert so.num_scheduled_tokens[rid] == n_prompt        # whole prompt at once
    # The same workload under vllm mixes admissions into decode steps.
    vsteps = _steps_of("vllm", wl, num_blocks=4000)
    assert any(so.scheduled_new_req_ids and so.scheduled_running_req_ids for so, _ in vsteps)


def test_static_batching_admits_only_when_the_whole_batch_has_finished():
    wl = with_arrivals(synthetic(60, 200, 50, "exponential", seed=8), "poisson", 30.0, seed=8)
    steps = _steps_of("static", wl, num_blocks=4000, max_num_seqs=16)
    admitting = [so for so, _ in steps if so.scheduled_new_req_ids]
    assert len(admitting) >= 60 / 16
    for so in admitting:
        assert not so.scheduled_running_req_ids
        assert len(so.scheduled_new_req_ids) <= 16


def test_priority_serves_short_prompts_first_under_load():
    wl = with_priorities(with_arrivals(synthetic(300, 1500, 60, "lognormal", seed=9),
                                       "poisson", 40.0, seed=9))
    short = wl.prompt_lens <= np.median(wl.prompt_lens)
    assert (wl.priorities == np.where(short, 0, 1)).all()
    res = {}
    for policy in ("vllm", "priority"):
        r = simulate(wl, CM, scheduler_config(policy, num_blocks=6000), policy)
        res[policy] = request_metrics(r)["queue"]
    assert np.median(res["priority"][short]) < np.median(res["vllm"][short])
    assert np.median(res["priority"][~short]) > np.median(res["vllm"][~short])


def test_measured_scheduler_time_is_optional_and_only_changes_the_clock():
    wl = synthetic(30, 300, 20, "uniform", seed=10)
    cfg = scheduler_config("vllm", num_blocks=2000)
    fixed = simulate(wl, CM, cfg)
    measured = simulate(wl, CM, cfg, include_scheduler_time=True)
    assert (measured.num_output == fixed.num_output).all()
    assert measured.num_steps == fixed.num_steps            # same decisions, other timestamps
    assert measured.sim_time != fixed.sim_time


def test_the_traces_ship_with_the_package_and_load_by_bare_name():
    for name, n in (("splitwise_conv.csv", 19_366), ("splitwise_code.csv", 8_819),
                    ("sharegpt_8k.csv", 30_731)):
        assert len(load_trace(name).prompt_lens) == n
