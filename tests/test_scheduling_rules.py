"""schedule(): the token budget, admission, preemption, the policies, and SchedulerOutput."""
import random

from helpers import blocks_for, make_sched, req, step, toks

from kvflow.core import RequestStatus


def ids(reqs):
    return [r.request_id for r in reqs]


# ---- running first, budget clamping ----------------------------------------------------------
def test_running_requests_are_scheduled_first_in_order_then_waiting_ones():
    s = make_sched(block_size=16, num_blocks=64)
    for rid in "abc":
        s.add_request(req(rid, 20))
    step(s)
    s.add_request(req("d", 20))
    so = s.schedule()
    assert list(so.num_scheduled_tokens) == ["a", "b", "c", "d"]
    assert so.scheduled_running_req_ids == ["a", "b", "c"]
    assert so.scheduled_new_req_ids == ["d"]
    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1, "d": 20}


def test_long_prefill_token_threshold_clamps_every_chunk():
    s = make_sched(block_size=16, num_blocks=64, long_prefill_token_threshold=30)
    s.add_request(req("a", 100))
    s.add_request(req("b", 5, max_tokens=50))       # another request: "a" is not alone
    chunks = [step(s)[0].num_scheduled_tokens["a"] for _ in range(4)]
    assert chunks == [30, 30, 30, 10]
    assert s.requests["a"].num_output_tokens == 1      # only the last chunk sampled


def test_long_prefill_token_threshold_does_not_cap_a_request_alone():
    # Alone (nothing else running or waiting), chunking only adds steps (as vLLM 0.33).
    s = make_sched(block_size=16, num_blocks=64, long_prefill_token_threshold=30)
    s.add_request(req("a", 100))
    assert step(s)[0].num_scheduled_tokens == {"a": 100}


def test_long_prefill_token_threshold_caps_a_running_prefill_again_once_another_arrives():
    s = make_sched(block_size=16, num_blocks=64, long_prefill_token_threshold=30,
                   max_num_batched_tokens=40)
    s.add_request(req("a", 100))
    assert step(s)[0].num_scheduled_tokens == {"a": 40}     # alone: only the budget caps it
    s.add_request(req("b", 5))
    assert step(s)[0].num_scheduled_tokens == {"a": 30, "b": 5}


def test_budget_clamps_a_prefill_and_the_rest_waits_for_the_next_step():
    s = make_sched(block_size=16, num_blocks=64, max_num_batched_tokens=40)
    s.add_request(req("a", 100))
    chunks = [step(s)[0].num_scheduled_tokens["a"] for _ in range(3)]
    assert chunks == [40, 40, 20]


def test_a_running_prefill_that_eats_the_budget_leaves_nothing_for_waiting_requests():
    s = make_sched(block_size=16, num_blocks=64, max_num_batched_tokens=40)
    s.add_request(req("a", 100))
    step(s)
    s.add_request(req("b", 5))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 40}
    assert s.requests["b"].status == RequestStatus.WAITING


def test_a_prompt_of_max_model_len_minus_1_runs_whole_and_stops_at_max_model_len():
    s = make_sched(block_size=16, num_blocks=64, max_model_len=64)
    s.add_request(req("a", 63, max_tokens=10))
    so, outs = step(s)
    assert so.num_scheduled_tokens == {"a": 63}          # min(63, max_model_len - 1 - 0)
    assert outs[0].finished and outs[0].finish_reason == "length"


# ---- admission ---------------------------------------------------------------------------------
def test_admission_stops_when_the_budget_reaches_0():
    s = make_sched(block_size=16, num_blocks=64, max_num_batched_tokens=100)
    for rid, n in (("a", 50), ("b", 50), ("c", 10)):
        s.add_request(req(rid, n))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 50, "b": 50}
    assert ids(s.waiting) == ["c"]


def test_admission_chunks_the_last_admitted_prompt_to_the_remaining_budget():
    s = make_sched(block_size=16, num_blocks=64, max_num_batched_tokens=100)
    for rid, n in (("a", 60), ("b", 60), ("c", 10)):
        s.add_request(req(rid, n))
    so, outs = step(s)
    assert so.num_scheduled_tokens == {"a": 60, "b": 40}
    assert [o.request_id for o in outs] == ["a"]         # b's chunk did not reach its end


def test_admission_stops_at_max_num_seqs():
    s = make_sched(block_size=16, num_blocks=64, max_num_seqs=2)
    for rid in "abc":
        s.add_request(req(rid, 10))
    so = s.schedule()
    assert so.scheduled_new_req_ids == ["a", "b"]
    assert ids(s.waiting) == ["c"]


def test_admission_stops_at_the_first_request_that_does_not_fit_no_skipping():
    s = make_sched(block_size=16, num_blocks=10)
    s.add_request(req("r", 90, max_tokens=3))            # 6 blocks
    step(s)
    s.add_request(req("big", 70, max_tokens=1))          # 5 blocks > 4 free
    s.add_request(req("small", 10, max_tokens=1))        # 1 block would fit
    so = s.schedule()
    assert so.num_scheduled_tokens == {"r": 1}
    assert ids(s.waiting) == ["big", "small"]


def test_without_chunked_prefill_uncached_tokens_over_the_remaining_budget_stop_admission():
    s = make_sched(block_size=16, num_blocks=64, max_num_batched_tokens=100,
                   enable_chunked_prefill=False)
    s.add_request(req("r", 10))
    step(s)
    for rid, n in (("a", 60), ("b", 50), ("c", 10)):
        s.add_request(req(rid, n))
    so = s.schedule()
    # r: 1, a: 60 -> 39 left; b's 50 does not fit whole, so b and c (behind it) wait.
    assert so.num_scheduled_tokens == {"r": 1, "a": 60}
    assert ids(s.waiting) == ["b", "c"]


def test_without_chunked_prefill_only_uncached_tokens_count_against_the_budget():
    s = make_sched(block_size=16, num_blocks=64, max_num_batched_tokens=100,
                   enable_chunked_prefill=False)
    shared = toks(48)
    s.add_request(req("x", shared + toks(2), max_tokens=1))
    step(s)                                              # x done: 48 tokens cached
    s.add_request(req("r", 10))
    step(s)
    s.add_request(req("a", 60))
    s.add_request(req("b", shared + toks(2)))            # 50 tokens, 48 of them cached
    so = s.schedule()
    assert so.num_scheduled_tokens == {"r": 1, "a": 60, "b": 2}
    assert s.requests["b"].num_cached_tokens == 48


def test_nothing_is_admitted_in_a_step_that_preempted():
    s = make_sched(block_size=4, num_blocks=4, reserve_full_sequence=False)
    s.add_request(req("a", 4, max_tokens=5))
    s.add_request(req("b", 3, max_tokens=5))
    s.add_request(req("c", 8, max_tokens=5))
    step(s)                                              # a [0], b [1], c [2, 3]; pool full
    s.add_request(req("d", 2, max_tokens=1))
    so = s.schedule()                                    # a needs a 2nd block: c (tail) goes
    assert so.preempted_req_ids == {"c"}
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}
    # One of c's blocks is still free and d needs just one, but nothing is admitted.
    assert s.kv_cache_manager.num_free_blocks == 1
    assert so.scheduled_new_req_ids == [] and so.scheduled_resumed_req_ids == []
    assert ids(s.waiting) == ["c", "d"]


# ---- preemption --------------------------------------------------------------------------------
def test_fcfs_preemption_takes_the_tail_and_puts_it_at_the_front_of_waiting():
    s = make_sched(block_size=4, num_blocks=4, reserve_full_sequence=False)
    s.add_request(req("a", 4, max_tokens=5))
    s.add_request(req("b", 7, max_tokens=5))
    s.add_request(req("c", 4, max_tokens=5))
    step(s)
    s.add_request(req("d", 4, max_tokens=5))
    so = s.schedule()
    assert so.preempted_req_ids == {"c"}
    assert so.block_ids["a"] == [0, 3]                   # c's freed block went to a
    assert ids(s.running) == ["a", "b"]
    assert ids(s.waiting) == ["c", "d"]


def test_preempting_itself_stops_the_running_loop():
    # b's second chunk needs 2 blocks: preempting c (1 block) is not enough, b is the tail now.
    s = make_sched(block_size=4, num_blocks=4, long_prefill_token_threshold=8,
                   reserve_full_sequence=False)
    s.add_request(req("a", 3, max_tokens=5))
    s.add_request(req("b", 16, max_tokens=1))
    s.add_request(req("c", 3, max_tokens=5))
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 3, "b": 8, "c": 3}
    s.add_request(req("d", 3, max_tokens=5))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.preempted_req_ids == {"b", "c"}
    assert ids(s.running) == ["a"]
    assert ids(s.waiting) == ["b", "c", "d"]            # FCFS order kept at the front
    assert s.kv_cache_manager.num_free_blocks == 3      # yet d is not admitted this step


def test_preemption_resets_progress_keeps_outputs_and_resumes_by_re_prefilling_everything():
    s = make_sched(block_size=4, num_blocks=4, reserve_full_sequence=False,
                   enable_prefix_caching=False)
    s.add_request(req("a", 7, max_tokens=4, ignore_eos=True))
    s.add_request(req("y", 7, max_tokens=8, ignore_eos=True))
    step(s, lambda rid: [5])
    step(s, lambda rid: [6])
    y = s.requests["y"]
    so = s.schedule()                                     # a needs a 3rd block: y goes
    assert so.preempted_req_ids == {"y"}
    assert y.status == RequestStatus.PREEMPTED
    assert y.num_computed_tokens == 0
    assert y.num_preemptions == 1 and s.make_stats().num_preemptions == 1
    assert y.output_token_ids == [5, 6]
    assert s.kv_cache_manager.get_block_ids("y") == []
    s.update_from_output(so, {"a": [7]})
    while True:
        so, outs = step(s, lambda rid: [8])
        if "y" in so.num_scheduled_tokens:
            break
    assert so.scheduled_resumed_req_ids == ["y"] and so.scheduled_new_req_ids == []
    assert so.num_scheduled_tokens["y"] == 9              # prompt 7 + 2 outputs, recomputed
    assert y.status == RequestStatus.RUNNING
    assert y.output_token_ids == [5, 6, 8]                # kept, and it sampled once more
    assert [o.new_token_ids for o in outs if o.request_id == "y"] == [[8]]


def test_priority_waiting_queue_is_ordered_by_priority_then_arrival_time():
    s = make_sched(block_size=16, num_blocks=64, policy="priority", max_num_seqs=2)
    for rid, prio, t in (("late_urgent", 0, 5.0), ("lazy", 3, 1.0), ("early_urgent", 0, 2.0),
                         ("mid", 1, 0.5)):
        s.add_request(req(rid, 10, priority=prio, arrival=t))
    assert ids(s.waiting) == ["early_urgent", "late_urgent", "mid", "lazy"]
    so = s.schedule()
    assert so.scheduled_new_req_ids == ["early_urgent", "late_urgent"]
    assert ids(s.waiting) == ["mid", "lazy"]


def test_fcfs_waiting_queue_is_arrival_order_whatever_the_priority():
    s = make_sched(block_size=16, num_blocks=64)
    for rid, prio in (("a", 5), ("b", 0), ("c", 9)):
        s.add_request(req(rid, 10, priority=prio))
    assert ids(s.waiting) == ["a", "b", "c"]


def _priority_state_v_x_z():
    """running = [V (priority 9, decoding), X (priority 0, decoding, about to need a block),
    Z (priority 0, mid-prefill)], no free block."""
    s = make_sched(block_size=4, num_blocks=12, max_num_batched_tokens=8, policy="priority",
                   reserve_full_sequence=False)
    s.add_request(req("V", 4, max_tokens=10, priority=9, arrival=1.0))
    step(s)
    s.add_request(req("X", 4, max_tokens=10, priority=0, arrival=2.0))
    s.add_request(req("Z", 40, max_tokens=2, priority=0, arrival=3.0))
    for _ in range(5):
        step(s)
    assert ids(s.running) == ["V", "X", "Z"]
    assert s.kv_cache_manager.num_free_blocks == 0
    assert s.requests["X"].num_tokens == 9            # its next token opens a 3rd block
    return s


def test_priority_victim_is_max_priority_arrival_even_if_already_scheduled_this_step():
    s = _priority_state_v_x_z()
    so = s.schedule()
    # V got its decode token first, then X's block could not be allocated: the victim is V
    # (largest (priority, arrival_time)), unscheduled and its token refunded: Z gets 7, not 6.
    assert so.preempted_req_ids == {"V"}
    assert so.num_scheduled_tokens == {"X": 1, "Z": 7}
    assert so.total_num_scheduled_tokens == 8
    assert "V" not in so.block_ids
    assert so.scheduled_running_req_ids == ["X", "Z"]
    V = s.requests["V"]
    assert (V.status, V.num_computed_tokens) == (RequestStatus.PREEMPTED, 0)
    assert ids(s.waiting) == ["V"]


def test_priority_victim_unscheduled_in_the_step_leaves_no_cached_block_it_never_computed():
    s = make_sched(block_size=4, num_blocks=11, max_num_batched_tokens=16,
                   long_prefill_token_threshold=6, policy="priority",
                   reserve_full_sequence=False)
    v_prompt = toks(21)
    # D keeps V from being alone, so the threshold chunks V's prompt from the first step.
    s.add_request(req("D", 1, max_tokens=1, priority=9, arrival=0.5))
    s.add_request(req("V", v_prompt, max_tokens=10, priority=9, arrival=1.0))
    step(s)
    s.add_request(req("X", 1, max_tokens=10, priority=0, arrival=2.0))
    s.add_request(req("Z", 40, max_tokens=2, priority=0, arrival=3.0))
    step(s)
    step(s)
    kvm = s.kv_cache_manager
    assert kvm.get_block_ids("V") == [1, 2, 0, 6, 7] and s.requests["V"].num_computed_tokens == 18
    so = s.schedule()
    # V's last 3 tokens (filling block 7) were scheduled, then Z's chunk found no block and
    # V was the victim: block 7 must not stay cached with V's tokens, its KV is never written
    # (Z reuses it at once, for its own tokens).
    assert so.preempted_req_ids == {"V"} and so.num_scheduled_tokens == {"X": 1, "Z": 6}
    assert 7 in kvm.get_block_ids("Z")
    assert kvm.block_hash(6) is not None                  # computed in an earlier step
    s.add_request(req("P", v_prompt, max_tokens=1, priority=0, arrival=4.0))
    hits, n = kvm.get_computed_blocks(s.requests["P"])
    assert n == 16


def test_priority_preempting_itself_stops_the_running_loop_even_for_requests_that_fit():
    s = make_sched(block_size=4, num_blocks=3, policy="priority", reserve_full_sequence=False)
    s.add_request(req("A", 7, max_tokens=5, priority=5, arrival=1.0))
    step(s)                                              # A: 2 blocks, 8 tokens
    s.add_request(req("B", 1, max_tokens=5, priority=0, arrival=2.0))
    step(s)                                              # B: the last block
    so = s.schedule()                                    # A needs a 3rd block, A is the victim
    assert so.preempted_req_ids == {"A"}
    assert so.num_scheduled_tokens == {}                 # B needed nothing new, still skipped
    assert ids(s.running) == ["B"]


def test_fcfs_same_state_preempts_the_tail_instead():
    s = make_sched(block_size=4, num_blocks=3, reserve_full_sequence=False)
    s.add_request(req("A", 7, max_tokens=5, priority=5))
    step(s)
    s.add_request(req("B", 1, max_tokens=5, priority=0))
    step(s)
    so = s.schedule()
    assert so.preempted_req_ids == {"B"}
    assert so.num_scheduled_tokens == {"A": 1}


# ---- watermark and full-sequence admission ---------------------------------------------------
def test_watermark_does_not_apply_to_an_empty_engine():
    s = make_sched(block_size=16, num_blocks=10, watermark=0.5)     # 5 blocks kept back
    s.add_request(req("big", 128, max_tokens=20))                 # 8 blocks: eats into it
    so, _ = step(s)
    assert so.scheduled_new_req_ids == ["big"]
    assert s.kv_cache_manager.num_free_blocks == 2
    # Running requests may dip into the watermark: the 9th block for the first decode.
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"big": 1}
    assert len(so.block_ids["big"]) == 9


def test_watermark_applies_to_admissions_while_something_runs():
    s = make_sched(block_size=16, num_blocks=10, watermark=0.5)
    s.add_request(req("r", 10, max_tokens=5))                      # 1 block; 9 free
    step(s)
    s.add_request(req("y80", 80, max_tokens=1))                     # 5 + 5 > 9
    so = s.schedule()
    assert "y80" not in so.num_scheduled_tokens


def test_watermark_admits_up_to_the_reserve():
    s = make_sched(block_size=16, num_blocks=10, watermark=0.5)
    s.add_request(req("r", 10, max_tokens=5))
    step(s)
    s.add_request(req("y64", 64, max_tokens=1))                     # 4 + 5 <= 9
    so = s.schedule()
    assert so.num_scheduled_tokens["y64"] == 64


def test_watermark_counts_a_request_admitted_earlier_in_the_same_step():
    s = make_sched(block_size=16, num_blocks=10, watermark=0.5)
    s.add_request(req("p", 16, max_tokens=5))                       # admitted freely
    s.add_request(req("y80", 80, max_tokens=1))                     # now p runs: 5 + 5 > 9
    so = s.schedule()
    assert so.scheduled_new_req_ids == ["p"]
    assert ids(s.waiting) == ["y80"]


def _reserve_case(reserve_full_sequence):
    s = make_sched(block_size=16, num_blocks=10, max_num_batched_tokens=64,
                   reserve_full_sequence=reserve_full_sequence)
    s.add_request(req("r", 60, max_tokens=3))                        # 4 blocks, 6 free
    step(s)
    s.add_request(req("y", 100, max_tokens=1))                      # 7 blocks in all
    return s, s.schedule()


def test_reserve_full_sequence_needs_blocks_for_the_whole_sequence_at_admission():
    s, so = _reserve_case(True)
    assert so.num_scheduled_tokens == {"r": 1}
    assert ids(s.waiting) == ["y"]


def test_without_reserve_full_sequence_a_first_chunk_that_fits_is_admitted():
    s, so = _reserve_case(False)
    assert so.num_scheduled_tokens == {"r": 1, "y": 63}
    assert len(so.block_ids["y"]) == 4


# ---- SchedulerOutput ---------------------------------------------------------------------------
def test_scheduler_output_lists_sets_and_full_block_tables():
    s = make_sched(block_size=4, num_blocks=4, reserve_full_sequence=False)
    s.add_request(req("a", 7, max_tokens=4))
    s.add_request(req("y", 7, max_tokens=8))
    s.add_request(req("z", 1, max_tokens=1))
    so, _ = step(s)
    assert so.scheduled_new_req_ids == ["a", "y"]        # z: no block left
    assert so.scheduled_running_req_ids == [] and so.scheduled_resumed_req_ids == []
    assert so.block_ids == {"a": [0, 1], "y": [2, 3]}
    s.finish_requests("z", RequestStatus.FINISHED_ABORTED)          # aborted while waiting
    so, _ = step(s)
    assert so.finished_req_ids == {"z"}
    so, _ = step(s)                                       # a opens a 3rd block: y preempted
    assert so.finished_req_ids == set()
    assert so.preempted_req_ids == {"y"}
    assert so.scheduled_running_req_ids == ["a"]
    assert so.block_ids == {"a": [0, 1, 3]}               # the whole table, not just the new one
    so, _ = step(s)                                       # a's 4th and last token: finishes
    assert "a" not in s.requests
    so, _ = step(s)
    assert so.finished_req_ids == {"a"}
    assert so.scheduled_resumed_req_ids == ["y"] and so.scheduled_new_req_ids == []
    assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())


def test_block_table_covers_exactly_the_computed_tokens_after_every_step():
    rng = random.Random(2)
    bs = 4
    s = make_sched(block_size=bs, num_blocks=24, max_num_batched_tokens=24, max_num_seqs=6,
                   long_prefill_token_threshold=10, reserve_full_sequence=False)
    kvm = s.kv_cache_manager
    shared = toks(12)
    n_added = 0
    for _ in range(300):
        if n_added < 40 and rng.random() < 0.4:
            prompt = (shared[:rng.randint(0, 12)] + toks(rng.randint(1, 20)))
            s.add_request(req(f"r{n_added}", prompt, max_tokens=rng.randint(1, 12)))
            n_added += 1
        so = s.schedule()
        for rid in so.num_scheduled_tokens:
            r = s.requests[rid]
            assert r.num_computed_tokens <= r.num_tokens
            assert len(so.block_ids[rid]) == blocks_for(r.num_computed_tokens, bs)
            assert kvm.get_block_ids(rid) == so.block_ids[rid]
        s.update_from_output(so, {rid: [rng.randint(0, 50)] for rid in so.num_scheduled_tokens})
        for r in s.running:
            assert len(kvm.get_block_ids(r.request_id)) == blocks_for(r.num_computed_tokens, bs)
    assert s.make_stats().num_preemptions > 0


def test_a_request_with_nothing_to_compute_is_not_scheduled_with_0_tokens():
    # The executor returned no token for a request that sampled: nothing is left to compute,
    # and vLLM skips such a request rather than scheduling it for 0 tokens.
    s = make_sched(block_size=4, num_blocks=8)
    s.add_request(req("a", [1, 2, 3]))
    s.update_from_output(s.schedule(), {})
    s.add_request(req("b", 2))
    so = s.schedule()
    assert "a" not in so.num_scheduled_tokens
    assert so.num_scheduled_tokens == {"b": 2}
