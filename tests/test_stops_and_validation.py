"""Stop rules, finishing and aborting, and the ValueErrors of add_request and the configs."""
import pytest
from helpers import make_sched, req, step

from kvflow import SamplingParams
from kvflow.core import Request, RequestStatus, SchedulerStats

EOS = 2


def _only(outs, rid):
    (o,) = [o for o in outs if o.request_id == rid]
    return o


# ---- stops -------------------------------------------------------------------------------------
def test_eos_stops_and_is_kept_in_the_output():
    s = make_sched(block_size=16, num_blocks=16)
    s.add_request(req("a", 10, max_tokens=16, eos=EOS))
    step(s, lambda rid: [5])
    _, outs = step(s, lambda rid: [EOS])
    o = _only(outs, "a")
    assert (o.new_token_ids, o.finished, o.finish_reason, o.stop_reason) == ([EOS], True, "stop",
                                                                            None)


def test_eos_is_just_a_token_with_ignore_eos():
    s = make_sched(block_size=16, num_blocks=16)
    r = req("a", 10, max_tokens=3, eos=EOS, ignore_eos=True)
    s.add_request(r)
    outs = [step(s, lambda rid: [EOS])[1] for _ in range(3)]
    assert [o[0].finished for o in outs] == [False, False, True]
    assert outs[-1][0].finish_reason == "length"
    assert r.output_token_ids == [EOS] * 3


def test_stop_token_id_stops_is_kept_and_is_the_stop_reason():
    s = make_sched(block_size=16, num_blocks=16)
    r = req("a", 10, max_tokens=16, stop_token_ids=[9, 42])
    s.add_request(r)
    _, outs = step(s, lambda rid: [42])
    o = _only(outs, "a")
    assert (o.new_token_ids, o.finish_reason, o.stop_reason) == ([42], "stop", 42)
    assert r.stop_reason == 42 and r.status == RequestStatus.FINISHED_STOPPED


def test_tokens_after_a_stop_token_in_the_same_step_are_dropped():
    s = make_sched(block_size=16, num_blocks=16)
    r = req("a", 10, max_tokens=16, stop_token_ids=[9])
    s.add_request(r)
    _, outs = step(s, lambda rid: [5, 9, 6, 7])
    assert _only(outs, "a").new_token_ids == [5, 9]
    assert r.output_token_ids == [5, 9]


def test_tokens_after_eos_in_the_same_step_are_dropped():
    s = make_sched(block_size=16, num_blocks=16)
    r = req("a", 10, max_tokens=16, eos=EOS)
    s.add_request(r)
    _, outs = step(s, lambda rid: [5, EOS, 6])
    o = _only(outs, "a")
    assert (o.new_token_ids, o.finish_reason, o.stop_reason) == ([5, EOS], "stop", None)


def test_eos_and_stop_tokens_are_ignored_while_fewer_than_min_tokens_are_generated():
    s = make_sched(block_size=16, num_blocks=16)
    r = req("a", 10, max_tokens=16, eos=EOS, stop_token_ids=[9], min_tokens=3)
    s.add_request(r)
    _, o1 = step(s, lambda rid: [EOS])
    _, o2 = step(s, lambda rid: [9])
    _, o3 = step(s, lambda rid: [9])
    assert not o1[0].finished and not o2[0].finished
    assert (o3[0].finished, o3[0].finish_reason, o3[0].stop_reason) == (True, "stop", 9)
    assert r.output_token_ids == [EOS, 9, 9]


def test_max_tokens_finishes_with_length():
    s = make_sched(block_size=16, num_blocks=16)
    r = req("a", 10, max_tokens=4)
    s.add_request(r)
    finished = [step(s)[1][0] for _ in range(4)]
    assert [o.finished for o in finished] == [False, False, False, True]
    assert (finished[-1].finish_reason, finished[-1].stop_reason) == ("length", None)
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED and r.num_output_tokens == 4


def test_eos_checked_before_max_tokens_on_the_last_token():
    s = make_sched(block_size=16, num_blocks=16)
    s.add_request(req("a", 10, max_tokens=1, eos=EOS))
    _, outs = step(s, lambda rid: [EOS])
    assert outs[0].finish_reason == "stop"


def test_stop_token_checked_before_max_tokens_on_the_last_token():
    s = make_sched(block_size=16, num_blocks=16)
    s.add_request(req("a", 10, max_tokens=1, stop_token_ids=[9]))
    _, outs = step(s, lambda rid: [9])
    assert (outs[0].finish_reason, outs[0].stop_reason) == ("stop", 9)


def test_max_tokens_also_caps_several_tokens_returned_in_one_step():
    s = make_sched(block_size=16, num_blocks=16)
    r = req("a", 10, max_tokens=2)
    s.add_request(r)
    _, outs = step(s, lambda rid: [5, 6, 7])
    assert (outs[0].new_token_ids, outs[0].finish_reason) == ([5, 6], "length")


def test_max_model_len_finishes_with_length_even_under_min_tokens():
    s = make_sched(block_size=16, num_blocks=16, max_model_len=20)
    r = req("a", 10, max_tokens=None, min_tokens=15)
    s.add_request(r)
    outs = [step(s)[1][0] for _ in range(10)]
    assert [o.finished for o in outs] == [False] * 9 + [True]
    assert outs[-1].finish_reason == "length"
    assert r.num_tokens == 20 and r.num_output_tokens == 10


def test_a_prefill_chunk_short_of_the_end_samples_nothing():
    s = make_sched(block_size=16, num_blocks=16, max_num_batched_tokens=8)
    r = req("a", 10)
    s.add_request(r)
    so, outs = step(s, lambda rid: [5])                 # 8 of 10 tokens
    assert outs == [] and r.output_token_ids == []
    so, outs = step(s, lambda rid: [5])
    assert so.num_scheduled_tokens == {"a": 2}
    assert _only(outs, "a").new_token_ids == [5]


def test_finished_requests_free_their_blocks_at_once_and_leave_requests():
    s = make_sched(block_size=16, num_blocks=16)
    s.add_request(req("a", 40, max_tokens=1))
    s.add_request(req("b", 40, max_tokens=3))
    step(s)
    kvm = s.kv_cache_manager
    assert "a" not in s.requests and "b" in s.requests
    assert kvm.get_block_ids("a") == [] and kvm.num_free_blocks == 16 - 3
    assert [r.request_id for r in s.running] == ["b"]
    assert s.get_num_unfinished_requests() == 1 and s.has_unfinished_requests()
    step(s)
    step(s)
    assert s.requests == {} and kvm.num_free_blocks == 16
    assert s.get_num_unfinished_requests() == 0 and not s.has_unfinished_requests()


# ---- aborts ------------------------------------------------------------------------------------
def test_abort_a_running_request_frees_its_blocks():
    s = make_sched(block_size=16, num_blocks=16)
    a = req("a", 40)
    s.add_request(a)
    step(s)
    assert s.kv_cache_manager.num_free_blocks == 13
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert a.status == RequestStatus.FINISHED_ABORTED and a.is_finished()
    assert a.get_finished_reason() == "abort"
    assert s.kv_cache_manager.num_free_blocks == 16
    assert s.running == [] and "a" not in s.requests
    so = s.schedule()
    assert so.finished_req_ids == {"a"} and so.num_scheduled_tokens == {}


def test_abort_waiting_and_preempted_requests_removes_them_from_waiting():
    s = make_sched(block_size=4, num_blocks=2, reserve_full_sequence=False)
    s.add_request(req("a", 4, max_tokens=5))
    s.add_request(req("p", 4, max_tokens=5))
    step(s)
    s.add_request(req("w", 4, max_tokens=5))
    so, _ = step(s)                                      # a opens a 2nd block: p preempted
    assert so.preempted_req_ids == {"p"}
    assert [r.request_id for r in s.waiting] == ["p", "w"]
    s.finish_requests(["p", "w"], RequestStatus.FINISHED_ABORTED)
    assert len(s.waiting) == 0 and set(s.requests) == {"a"}
    assert s.schedule().finished_req_ids == {"p", "w"}


def test_finish_requests_ignores_unknown_and_finished_ids():
    s = make_sched(block_size=16, num_blocks=16)
    s.add_request(req("done", 10, max_tokens=1))
    s.add_request(req("live", 10, max_tokens=5))
    step(s)
    s.schedule()
    s.finish_requests(["nope", "done"], RequestStatus.FINISHED_ABORTED)
    assert set(s.requests) == {"live"}
    assert s.requests["live"].status == RequestStatus.RUNNING
    assert s.schedule().finished_req_ids == set()


def test_late_outputs_for_an_aborted_request_are_dropped():
    s = make_sched(block_size=16, num_blocks=16)
    a, b = req("a", 10), req("b", 10)
    s.add_request(a)
    s.add_request(b)
    so = s.schedule()
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    outs = s.update_from_output(so, {"a": [5], "b": [6]})
    assert [o.request_id for o in outs] == ["b"]
    assert a.output_token_ids == []


# ---- add_request -------------------------------------------------------------------------------
def _rejected(s, r, match):
    n_waiting, n_requests = len(s.waiting), len(s.requests)
    with pytest.raises(ValueError, match=match):
        s.add_request(r)
    assert len(s.waiting) == n_waiting and len(s.requests) == n_requests


def test_add_request_rejects_a_duplicate_id_of_a_waiting_or_running_request():
    s = make_sched(block_size=16, num_blocks=16)
    s.add_request(req("a", 10))
    _rejected(s, req("a", 10), "'a'")
    step(s)
    _rejected(s, req("a", 10), "'a'")


def test_add_request_rejects_an_empty_prompt():
    _rejected(make_sched(), req("a", []), "empty")


@pytest.mark.parametrize("n", [64, 65])
def test_add_request_rejects_a_prompt_of_max_model_len_or_more(n):
    _rejected(make_sched(max_model_len=64), req("a", n), "max_model_len")


def test_add_request_accepts_a_prompt_of_max_model_len_minus_1():
    s = make_sched(max_model_len=64)
    s.add_request(req("a", 63))
    assert len(s.waiting) == 1


def test_add_request_rejects_a_request_that_could_never_fit_in_the_kv_cache():
    s = make_sched(block_size=16, num_blocks=4)
    # 60 + 6 - 1 = 65 tokens need 5 blocks > 4.
    _rejected(s, req("a", 60, max_tokens=6), "num_blocks")
    s.add_request(req("b", 60, max_tokens=5))            # 64 tokens: exactly 4 blocks


def test_the_never_fit_check_is_capped_at_max_model_len():
    s = make_sched(block_size=16, num_blocks=4, max_model_len=64)
    s.add_request(req("a", 60, max_tokens=1000))          # min(1059, 64) = 64 tokens: 4 blocks
    _rejected(make_sched(block_size=16, num_blocks=4, max_model_len=65),
              req("a", 60, max_tokens=1000), "num_blocks")


# ---- config validation -------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("block_size", 0), ("block_size", -16), ("block_size", 1.5),
    ("num_blocks", 0), ("max_num_batched_tokens", 0), ("max_num_seqs", 0),
    ("max_model_len", 0), ("long_prefill_token_threshold", -1),
    ("enable_prefix_caching", "yes"), ("enable_chunked_prefill", 1),
    ("reserve_full_sequence", None), ("policy", "lifo"),
    ("watermark", -0.1), ("watermark", 1.0), ("watermark", "0.1"),
])
def test_scheduler_config_rejects_invalid_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        make_sched(**{field: value})


def test_scheduler_config_checks_are_per_field():
    # A pool smaller than max_model_len, or a budget below max_num_seqs, is allowed.
    make_sched(block_size=16, num_blocks=4, max_model_len=8192)
    make_sched(max_num_batched_tokens=8, max_num_seqs=256)
    make_sched(policy="priority", watermark=0.5, long_prefill_token_threshold=0)


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("seed", "x"), ("max_tokens", 0), ("min_tokens", -1),
    ("stop", [1]), ("stop_token_ids", [-1]), ("ignore_eos", "no"),
])
def test_sampling_params_rejects_invalid_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_rejects_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)
    SamplingParams(max_tokens=3, min_tokens=3)


def test_sampling_params_defaults():
    sp = SamplingParams()
    assert (sp.temperature, sp.top_p, sp.top_k, sp.seed, sp.max_tokens, sp.min_tokens, sp.stop,
            sp.stop_token_ids, sp.ignore_eos) == (1.0, 1.0, 0, None, 16, 0, [], [], False)


# ---- stats -------------------------------------------------------------------------------------
def test_make_stats_fields():
    s = make_sched(block_size=16, num_blocks=8, max_num_seqs=1)
    prompt = list(range(100, 140))
    s.add_request(req("a", prompt, max_tokens=1))
    s.add_request(req("b", prompt, max_tokens=2))
    assert s.make_stats() == SchedulerStats(0, 2, 0.0, 0, 0, 0)
    step(s)                                               # a: 40 queried, no hit; finishes
    step(s)                                               # b: 40 queried, 32 hit
    st = s.make_stats()
    assert isinstance(st, SchedulerStats)
    assert (st.num_running_reqs, st.num_waiting_reqs) == (1, 0)
    assert st.kv_cache_usage == 3 / 8
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (80, 32)
    assert st.num_preemptions == 0


def test_request_public_attributes():
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=4), eos_token_id=2, arrival_time=1.5,
                priority=3)
    assert (r.request_id, r.status, r.prompt_token_ids, r.output_token_ids, r.all_token_ids) == (
        "r", RequestStatus.WAITING, [1, 2, 3], [], [1, 2, 3])
    assert (r.num_prompt_tokens, r.num_tokens, r.num_computed_tokens, r.num_cached_tokens) == (
        3, 3, 0, 0)
    assert (r.num_preemptions, r.priority, r.arrival_time, r.stop_reason) == (0, 3, 1.5, None)
    assert not r.is_finished()


# ---- sampling fields at the boundary (issue 12) ------------------------------------------------
HUGE = 10 ** 5000       # what Python's json may deliver; it has no str() (4300-digit limit)


@pytest.mark.parametrize("seed", [1 << 64, -(1 << 63) - 1, HUGE, -HUGE],
                         ids=["2**64", "-2**63-1", "huge", "-huge"])
def test_a_seed_beyond_64_bits_is_a_value_error_naming_seed(seed):
    with pytest.raises(ValueError, match="^seed") as ei:
        SamplingParams(seed=seed)
    assert len(str(ei.value)) < 300


@pytest.mark.parametrize("seed", [(1 << 64) - 1, -(1 << 63), -1, 0])
def test_seeds_at_both_ends_of_the_64_bit_range_are_accepted_and_seed_a_generator(seed):
    import torch
    sp = SamplingParams(seed=seed)
    torch.Generator().manual_seed(sp.seed)      # what the runner does with it


@pytest.mark.parametrize("t", [float("inf"), float("nan"), -float("inf"), HUGE],
                         ids=["inf", "nan", "-inf", "huge"])
def test_a_temperature_that_is_not_finite_is_a_value_error_naming_temperature(t):
    with pytest.raises(ValueError, match="^temperature"):
        SamplingParams(temperature=t)


def test_a_temperature_below_1e_5_is_greedy_as_in_vllm():
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=9e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy


_BAD_INTS = [
    ("temperature", HUGE), ("top_p", HUGE), ("top_p", -HUGE), ("top_k", -HUGE), ("seed", HUGE),
    ("max_tokens", -HUGE), ("min_tokens", -HUGE), ("stop_token_ids", [5, -HUGE]),
    ("stop_token_ids", [True]), ("stop_token_ids", [None]),
]


@pytest.mark.parametrize("field, value", _BAD_INTS, ids=[f"{f}-{i}" for i, (f, _) in
                                                          enumerate(_BAD_INTS)])
def test_a_huge_or_wrong_int_is_a_short_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}") as ei:
        SamplingParams(**{field: value})
    assert len(str(ei.value)) < 300


def test_min_tokens_above_a_huge_max_tokens_names_min_tokens_in_a_short_message():
    with pytest.raises(ValueError, match="^min_tokens") as ei:
        SamplingParams(max_tokens=HUGE, min_tokens=HUGE + 1)
    assert len(str(ei.value)) < 300
