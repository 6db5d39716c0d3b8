"""The reference documents' worked examples, driven through the real scheduler.

doc 000: 1 long + 7 short requests, continuous vs static batching.
doc 003: the A..E step of vLLM V1's scheduler (without speculative tokens), and its preemption.
doc 004: a 30,000-token prompt chunked in among running decodes.
"""
from helpers import make_sched, req, step, toks

from kvflow.core import RequestStatus

# ---------------------------------------------------------------------------------------------
# doc 000: "8 requests: 1 long (500 tokens) + 7 short (10 tokens each)"
# ---------------------------------------------------------------------------------------------
SEATS = 8


def _long_and_shorts(sched, n_extra_shorts: int) -> None:
    sched.add_request(req("long", 16, max_tokens=500, ignore_eos=True))
    for i in range(7 + n_extra_shorts):
        sched.add_request(req(f"short{i}", 16, max_tokens=10, ignore_eos=True))


def test_doc000_shorts_finish_at_step_10_and_waiting_requests_take_their_seats_next_step():
    s = make_sched(max_num_seqs=SEATS, num_blocks=256)
    _long_and_shorts(s, n_extra_shorts=14)

    for n in range(1, 11):
        so, outs = step(s)
        assert len(s.running) + len({o.request_id for o in outs if o.finished}) == SEATS
        if n == 1:
            assert so.scheduled_new_req_ids == ["long"] + [f"short{i}" for i in range(7)]
    # Step 10 sampled the 10th token of short0..short6: they finished and left.
    assert [r.request_id for r in s.running] == ["long"]
    assert all(f"short{i}" not in s.requests for i in range(7))

    # Step 11: the freed seats are refilled at once from the waiting queue.
    so, _ = step(s)
    assert so.scheduled_running_req_ids == ["long"]
    assert so.scheduled_new_req_ids == [f"short{i}" for i in range(7, 14)]
    assert len(s.running) == SEATS


def test_doc000_running_count_stays_at_max_num_seqs_while_work_is_waiting():
    s = make_sched(max_num_seqs=SEATS, num_blocks=256)
    _long_and_shorts(s, n_extra_shorts=35)
    while len(s.waiting):
        so = s.schedule()
        assert len(s.running) == SEATS
        s.update_from_output(so, {rid: [1] for rid in so.num_scheduled_tokens})


def _avg_running_over_long_life(continuous: bool) -> float:
    """Average requests in the batch per step while the long request lives (500 steps)."""
    s = make_sched(max_num_seqs=SEATS, num_blocks=512)
    queue = [req("long", 16, max_tokens=500, ignore_eos=True)]
    queue += [req(f"short{i}", 16, max_tokens=10, ignore_eos=True) for i in range(7 + 350)]
    batch_sizes = []
    while "long" in s.requests or queue:
        if queue and (continuous or not s.has_unfinished_requests()):
            # Continuous: everything queues at once. Static: the next 8 only once all are done.
            for r in queue[:None if continuous else SEATS]:
                s.add_request(r)
            queue = [] if continuous else queue[SEATS:]
        so, _ = step(s)
        batch_sizes.append(len(so.num_scheduled_tokens))
        if "long" not in s.requests:
            break
    assert len(batch_sizes) == 500
    return sum(batch_sizes) / len(batch_sizes)


def test_doc000_static_batching_leaves_seats_idle_continuous_batching_keeps_them_full():
    static = _avg_running_over_long_life(continuous=False)
    continuous = _avg_running_over_long_life(continuous=True)
    # Static: 8 in the batch for 10 steps, then the long request alone for 490 steps.
    assert static == (8 * 10 + 1 * 490) / 500            # ~14% of the seats
    # Continuous: the 350 waiting shorts keep all 8 seats busy for the long request's life.
    assert continuous == SEATS
    assert continuous > 5 * static


# ---------------------------------------------------------------------------------------------
# doc 003: the A..E example, without speculative tokens
# max_num_scheduled_tokens=2048, max_num_running_reqs=4, block_size=16
# ---------------------------------------------------------------------------------------------
def _doc003_state():
    """Drive the scheduler to running=[A (decode), B (decode), C (300/500 prefilled)],
    waiting=[D (1000 tokens, first 256 in the prefix cache), E (500)]."""
    s = make_sched(max_num_batched_tokens=2048, max_num_seqs=4, block_size=16, num_blocks=200)
    s.add_request(req("A", 100, max_tokens=200, ignore_eos=True))
    for _ in range(50):                    # A alone: prefill, then 49 decodes
        step(s)
    d_prompt = toks(1000)
    s.add_request(req("B", 200, max_tokens=50))
    # W shares D's first 256 tokens and finishes after its prefill (max_tokens=1): its blocks
    # go back to the free queue still cached. Its size makes C's first chunk exactly 300.
    s.add_request(req("W", d_prompt[:256] + toks(2048 - 1 - 200 - 300 - 256), max_tokens=1))
    s.add_request(req("C", 500, max_tokens=50))
    s.add_request(req("D", d_prompt, max_tokens=50))
    s.add_request(req("E", 500, max_tokens=50))
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"A": 1, "B": 200, "W": 1547, "C": 300}
    assert "W" not in s.requests
    A, B, C = s.running
    assert [r.request_id for r in s.running] == ["A", "B", "C"]
    assert [r.request_id for r in s.waiting] == ["D", "E"]
    assert (A.num_computed_tokens, B.num_computed_tokens, C.num_computed_tokens) == (150, 200, 300)
    assert A.num_tokens == 151 and B.num_tokens == 201 and C.num_tokens == 500
    return s


def test_doc003_one_step_schedules_running_first_then_admits_D_with_its_prefix_hit():
    s = _doc003_state()
    so = s.schedule()
    assert so.num_scheduled_tokens == {"A": 1, "B": 1, "C": 200, "D": 744}
    assert so.total_num_scheduled_tokens == 946
    assert so.scheduled_running_req_ids == ["A", "B", "C"]
    assert so.scheduled_new_req_ids == ["D"]
    assert so.preempted_req_ids == set()
    assert so.finished_req_ids == {"W"}        # W finished after the previous schedule()
    D = s.requests["D"]
    assert D.num_cached_tokens == 256 and D.num_computed_tokens == 1000
    # E stays waiting: len(running) == max_num_running_reqs.
    assert [r.request_id for r in s.running] == ["A", "B", "C", "D"]
    assert [r.request_id for r in s.waiting] == ["E"]
    assert s.requests["E"].status == RequestStatus.WAITING


def test_doc003_preemption_variant_tail_C_goes_back_to_the_front_of_waiting():
    # Same shapes, but a pool with no room for C's last 200 tokens: the first chunk (300, set
    # by long_prefill_token_threshold) takes the last free blocks.
    s = make_sched(max_num_batched_tokens=2048, max_num_seqs=4, block_size=16,
                   num_blocks=7 + 13 + 19, long_prefill_token_threshold=300,
                   reserve_full_sequence=False)
    for rid, n in (("A", 100), ("B", 200), ("C", 500)):
        s.add_request(req(rid, n, max_tokens=16))
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"A": 100, "B": 200, "C": 300}
    assert s.kv_cache_manager.num_free_blocks == 0
    s.add_request(req("D", 100, max_tokens=16))      # D, E sized to fit this small pool
    s.add_request(req("E", 50, max_tokens=16))

    so = s.schedule()
    # allocate_slots(C, 200) -> None: FCFS preempts running.pop(), which is C itself.
    assert so.preempted_req_ids == {"C"}
    assert so.num_scheduled_tokens == {"A": 1, "B": 1}
    C = s.requests["C"]
    assert (C.status, C.num_computed_tokens, C.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert [r.request_id for r in s.waiting] == ["C", "D", "E"]
    # Nothing is admitted in a step that preempted.
    assert so.scheduled_new_req_ids == [] and s.requests["D"].status == RequestStatus.WAITING


# ---------------------------------------------------------------------------------------------
# doc 004: a 30,000-token prefill riding with decodes
# ---------------------------------------------------------------------------------------------
LONG = 30_000


def _decodes_then_long_prompt(**cfg):
    s = make_sched(block_size=16, num_blocks=4096, max_model_len=32_768, **cfg)
    for i in range(4):
        s.add_request(req(f"d{i}", 16, max_tokens=200, ignore_eos=True))
    step(s)                                    # the four are decoding now
    s.add_request(req("long", LONG, max_tokens=4))
    return s


def _chunks_of_long(s):
    chunks = []
    while s.requests["long"].num_output_tokens == 0:
        so, _ = step(s)
        # Every decode still gets its one token every step.
        assert all(so.num_scheduled_tokens[f"d{i}"] == 1 for i in range(4))
        chunks.append(so.num_scheduled_tokens["long"])
    return chunks


def test_doc004_chunked_prefill_long_prompt_gets_budget_minus_decodes_each_step():
    s = _decodes_then_long_prompt(max_num_batched_tokens=2048)
    chunks = _chunks_of_long(s)
    assert chunks == [2044] * 14 + [LONG - 14 * 2044]
    assert sum(chunks) == LONG


def test_doc004_long_prefill_token_threshold_caps_each_chunk():
    s = _decodes_then_long_prompt(max_num_batched_tokens=2048, long_prefill_token_threshold=512)
    chunks = _chunks_of_long(s)
    assert chunks == [512] * (LONG // 512) + [LONG % 512]


def test_doc004_threshold_above_the_remaining_budget_the_budget_wins():
    s = _decodes_then_long_prompt(max_num_batched_tokens=300, long_prefill_token_threshold=512)
    chunks = _chunks_of_long(s)
    assert chunks == [296] * (LONG // 296) + [LONG % 296]     # min(512, 300 - 4 decodes)


def test_doc004_without_chunked_prefill_the_prompt_goes_in_one_step():
    s = _decodes_then_long_prompt(max_num_batched_tokens=32_768, enable_chunked_prefill=False)
    so, outs = step(s)
    assert so.num_scheduled_tokens == {"d0": 1, "d1": 1, "d2": 1, "d3": 1, "long": LONG}
    assert "long" in {o.request_id for o in outs}             # it sampled its first token


def test_doc004_without_chunked_prefill_a_prompt_over_the_remaining_budget_waits_whole():
    # The same budget minus the decodes' 4 tokens is 3 short of the prompt: no slicing, it waits.
    s = _decodes_then_long_prompt(max_num_batched_tokens=LONG + 1, enable_chunked_prefill=False)
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"d0": 1, "d1": 1, "d2": 1, "d3": 1}
    assert s.requests["long"].status == RequestStatus.WAITING
