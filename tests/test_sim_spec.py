"""Speculative decoding in the simulator: synthetic drafts verified by the real Scheduler, a
seeded acceptance draw, and verification steps in the cost model."""
import json
import math

import numpy as np
import pytest

from kvflow.core.config import SpeculativeConfig
from kvflow.sim import CostModel, get_gpu, get_model, scheduler_config, simulate, summarize
from kvflow.sim.cli import main
from kvflow.sim.cost_model import RowTableCostModel
from kvflow.sim.workload import data_dir, load_trace, synthetic, with_arrivals

CM = CostModel(get_model("Llama-3-8B"), get_gpu("h100"))
CONV = data_dir() / "splitwise_conv.csv"


def _spec(k=4, **kw):
    # The batch rule's budget pinned at 16 rows: the tests' counts below follow from it.
    return SpeculativeConfig(num_speculative_tokens=k, **({"max_batch_tokens": 16} | kw))


def _run(wl, spec=None, alpha=0.7, seed=0, policy="vllm", **fields):
    fields = {"num_blocks": 4000, "max_num_batched_tokens": 2048} | fields
    cfg = scheduler_config(policy, speculative_config=spec, **fields)
    drivers = []
    r = simulate(wl, CM, cfg, policy, spec_acceptance=alpha, spec_seed=seed,
                 step_hook=lambda d, *a: drivers.append(d) if not drivers else None)
    return r, drivers[0] if drivers else None


def test_with_acceptance_0_speculation_emits_the_same_tokens_in_the_same_steps_but_slower():
    wl = synthetic(3, 200, 60, "uniform", seed=2)       # 3 requests: 4 drafts each (16 // 3 - 1)
    base, _ = _run(wl)
    spec, _ = _run(wl, _spec(), alpha=0.0)
    np.testing.assert_array_equal(spec.num_output, base.num_output)
    assert spec.num_steps == base.num_steps
    np.testing.assert_array_equal(spec.steps["accepted_tokens"], 0)
    assert spec.steps["draft_tokens"].sum() > 0
    assert (spec.steps["tokens"] >= base.steps["tokens"]).all()
    assert spec.sim_time > base.sim_time             # every verification step costs more
    s = summarize(spec)
    assert s["spec_acceptance_rate"] == 0.0 and s["spec_mean_tokens_per_verification"] == 1.0


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("out_len", [1, 2, 5, 41, 42])
def test_with_acceptance_1_a_lone_request_emits_k_plus_1_tokens_per_step(k, out_len):
    r, _ = _run(synthetic(1, 100, out_len), _spec(k), alpha=1.0)
    assert r.num_output[0] == out_len                # drafts never overshoot max_tokens
    assert r.num_steps == 1 + math.ceil((out_len - 1) / (k + 1))     # prefill, then verifies
    if out_len > 2:     # with 1 token left there is no room for a draft
        assert summarize(r)["spec_acceptance_rate"] == 1.0


@pytest.mark.parametrize("policy", ["vllm", "nano", "static", "priority"])
def test_every_request_finishes_with_its_output_length_and_no_block_leaks(policy):
    # Few blocks and a small budget: preemptions and drafts cut by the budget happen.
    wl = synthetic(12, 60, 80, "uniform", seed=5)
    budget = None if policy == "nano" else 48       # nano never chunks a prompt
    r, driver = _run(wl, _spec(4, max_batch_tokens=64), alpha=0.6, policy=policy,
                     num_blocks=40, max_num_batched_tokens=budget, max_num_seqs=8)
    np.testing.assert_array_equal(r.num_output, wl.output_lens)
    assert r.spec.num_accepted_tokens > 0
    pool = driver.scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks == 40
    if policy == "vllm":
        assert r.preemptions.sum() > 0


def test_a_trace_replay_with_speculation_is_repeatable_and_the_seed_moves_the_draws():
    wl = with_arrivals(load_trace(CONV).head(60), "poisson", 4.0, seed=1)
    a, _ = _run(wl, _spec(), alpha=0.6, seed=3)
    b, _ = _run(wl, _spec(), alpha=0.6, seed=3)
    c, _ = _run(wl, _spec(), alpha=0.6, seed=4)
    for k in a.steps:
        np.testing.assert_array_equal(a.steps[k], b.steps[k])
    np.testing.assert_array_equal(a.finish, b.finish)
    assert a.sim_time == b.sim_time and a.spec == b.spec
    assert a.spec.num_accepted_tokens != c.spec.num_accepted_tokens
    np.testing.assert_array_equal(a.num_output, wl.output_lens)


def test_accepted_counts_follow_the_truncated_geometric():
    alpha, k = 0.6, 4
    r, _ = _run(synthetic(3, 50, 2000), _spec(k), alpha=alpha)
    sp = r.spec
    pos = np.array(sp.num_accepted_tokens_per_pos, dtype=float)
    # Draft i is accepted only if all before it were: P(>= i+1 accepted) = alpha^(i+1).
    # (3 requests: 4 drafts each; the cap near the end shortens a handful.)
    assert len(pos) == k
    np.testing.assert_allclose(pos / sp.num_drafts, alpha ** np.arange(1, k + 1), rtol=0.1)
    expected = sum(alpha ** i for i in range(k + 1))
    assert summarize(r)["spec_mean_tokens_per_verification"] == pytest.approx(expected, rel=0.04)


def test_drafts_shrink_as_the_batch_grows_and_stop_past_the_row_budget():
    r4, _ = _run(synthetic(4, 50, 30), _spec(4), alpha=1.0)
    assert len(r4.spec.num_accepted_tokens_per_pos) == 3           # 16 // 4 - 1
    wl = synthetic(32, 50, 30)
    base, _ = _run(wl)
    r32, _ = _run(wl, _spec(4), alpha=1.0)
    assert r32.spec.num_drafts == 0
    assert r32.sim_time == base.sim_time and r32.num_steps == base.num_steps


def test_a_verified_request_is_decode_rows_not_a_prefill_chunk():
    class R:
        def __init__(self, c):
            self.num_computed_tokens = c

    ctx, m = 2048, 4
    reqs = {"v": R(ctx + m), "d": R(700)}
    t = CM.step_time({"v": 1 + m, "d": 1}, reqs, spec_tokens={"v": [7] * m})
    # Rows see ctx .. ctx + m keys; 5 + 1 LM-head rows.
    rows_ctx = sum(range(ctx, ctx + m + 1))
    assert t == CM.time_from_totals(2, 1 + m + 1, 1 + m + 1, rows_ctx + 700, 0, 0, 1 + m + 1)
    assert t != CM.step_time({"v": 1 + m, "d": 1}, reqs)           # the prefill-chunk reading
    assert CM.verify_step_time(ctx, 0) == CM.decode_step_time(1, ctx)


def test_a_verification_costs_more_than_a_decode_and_less_than_its_tokens_as_decode_steps():
    # Batch-1 decode of Llama-3-8B on an H100 is bandwidth-bound: extra rows ride on the
    # weight stream, only their KV reads add up.
    ctx = 2048
    for m in (1, 2, 4, 8):
        t = CM.verify_step_time(ctx, m)
        assert CM.decode_step_time(1, ctx) < t < (1 + 0.03 * m) * CM.decode_step_time(1, ctx)
        assert t < sum(CM.decode_step_time(1, ctx + j) for j in range(m + 1))
        # kvflow's runner reads the context once per row; a prefill chunk of the same tokens
        # reads it once, so the verification costs more, not less.
        assert t > CM.prefill_step_time(ctx + m, cached=ctx - 1)


def test_a_row_table_replaces_the_roofline_for_small_batches():
    shape = get_model("SmolLM2-135M")
    table = {1: 0.079, 2: 0.130, 3: 0.160, 5: 0.125}
    cm = RowTableCostModel(shape, get_gpu("h100"), table)
    assert cm.rows_time(1) == 0.079 and cm.rows_time(5) == 0.125
    assert cm.rows_time(4) == pytest.approx(0.1425)
    assert cm.rows_time(7) == pytest.approx(0.125 + 2 * (0.125 - 0.160) / 2)   # last slope
    assert cm.verify_step_time(100, 2) > cm.verify_step_time(100, 4)          # as measured
    with pytest.raises(ValueError):
        RowTableCostModel(shape, get_gpu("h100"), {1: 0.1})


def test_cli_takes_a_speculative_config_and_reports_acceptance(tmp_path, capsys):
    rc = main(["--synthetic", "fixed", "--num-requests", "2", "--prompt-len", "64",
               "--output-len", "100", "--plots", "", "--output", str(tmp_path), "--no-progress",
               "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}',
               "--spec-acceptance", "0.7"])
    assert rc == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["scheduler_config"]["speculative_config"]["num_speculative_tokens"] == 4
    assert 0 < s["spec_acceptance_rate"] < 1 and s["spec_mean_tokens_per_verification"] > 1.5
    assert s["total_output_tokens"] == 200 and s["spec_acceptance_arg"] == 0.7
    assert "Mean tokens per verification" in capsys.readouterr().out
    for bad in ('{"method": "eagle"}', "{not json", '{"k": 4}'):
        with pytest.raises(SystemExit):
            main(["--synthetic", "fixed", "--speculative-config", bad])
    with pytest.raises(SystemExit):
        main(["--synthetic", "fixed", "--spec-acceptance", "1.5"])
