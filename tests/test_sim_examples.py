"""The reference documents' examples, replayed by the simulator on Llama-3-8B / H100.

doc 000: static vs continuous batching with 1 long (500 tokens) + 7 short (10 tokens) requests.
doc 004: a 30,000-token prefill arriving among running decodes, with and without chunking.
"""
import numpy as np
import pytest

from kvflow.sim import CostModel, get_gpu, get_model, scheduler_config, simulate, summarize
from kvflow.sim.workload import long_and_shorts, long_prefill_among_decodes

SEATS = 8
H100_LLAMA3 = CostModel(get_model("Llama-3-8B"), get_gpu("h100"))


def _replay(wl, policy):
    cfg = scheduler_config(policy, max_num_seqs=SEATS, num_blocks=512)
    return simulate(wl, H100_LLAMA3, cfg, policy)


# ---------------------------------------------------------------------------------------------
# doc 000: "Static batching ... ~23% average. Continuous batching ... ~95% average."
# ---------------------------------------------------------------------------------------------
def _seat_utilisation_while_long_lives(policy) -> float:
    # The long request and 7 shorts, then 343 more shorts queued: enough to refill the 7 seats
    # every 10 steps for the long request's whole life.
    r = _replay(long_and_shorts(num_groups=1, extra_shorts=343), policy)
    long_alive = r.steps["t"] < r.finish[0]
    assert long_alive.sum() == 500          # one step per token of the long request
    return float(r.steps["reqs"][long_alive].mean() / SEATS)


def test_doc000_static_batching_leaves_seats_idle_continuous_keeps_them_busy():
    static = _seat_utilisation_while_long_lives("static")
    continuous = _seat_utilisation_while_long_lives("vllm")
    # Static: 8 seats busy for 10 steps, then the long request alone for 490.
    assert static == pytest.approx((8 * 10 + 1 * 490) / (8 * 500))       # ~14%
    assert continuous == 1.0                # freed seats refilled at the very next step
    assert continuous > 5 * static


def test_doc000_continuous_batching_serves_5_to_10x_more_requests_per_second():
    # Eight groups of (1 long + 7 short), all queued at t=0: static batching spends 500 steps on
    # every batch because each holds one long request.
    wl = long_and_shorts(num_groups=8)
    static, continuous = summarize(_replay(wl, "static")), summarize(_replay(wl, "vllm"))
    assert static["num_steps"] == 8 * 500
    assert continuous["completed"] == static["completed"] == 64
    ratio = continuous["request_throughput"] / static["request_throughput"]
    assert 5 <= ratio <= 10
    # Short requests no longer wait behind long ones.
    assert continuous["median_e2el_ms"] < static["median_e2el_ms"] / 5


# ---------------------------------------------------------------------------------------------
# doc 004: "If one request shows up with a 30,000-token prompt ... every other request in the
# batch gets zero decode tokens that step. Their inter-token latency spikes."
# ---------------------------------------------------------------------------------------------
LLAMA31 = CostModel(get_model("Llama-3.1-8B"), get_gpu("h100"))
NUM_DECODES = 8


def _decode_itls_and_long_ttft(**cfg):
    wl = long_prefill_among_decodes(num_decodes=NUM_DECODES, long_prompt=30_000)
    config = scheduler_config("vllm", max_model_len=32_768, num_blocks=8192, **cfg)
    r = simulate(wl, LLAMA31, config)
    assert (r.num_output == wl.output_lens).all()
    # The decodes' token times: every step they all decode, so their ITLs are the step gaps
    # from their first token to their last.
    end = np.nanmax(r.finish[:NUM_DECODES])
    t_end = r.steps["t"] + r.steps["dt"]
    decode_steps = (t_end > np.nanmax(r.first_token[:NUM_DECODES])) & (t_end <= end)
    long_ttft = r.first_token[-1] - r.arrival[-1]
    return r.steps["dt"][decode_steps], long_ttft


def _worst_chunk_step(chunk):
    """The modelled time of the last chunk of the 30,000-token prompt plus the 8 decodes."""
    c = 30_000
    pairs = chunk * (c - chunk) + chunk * (chunk + 1) // 2
    ctx = NUM_DECODES * (512 + 400)
    return LLAMA31.time_from_totals(NUM_DECODES + 1, chunk + NUM_DECODES, NUM_DECODES, ctx,
                                    pairs, c + chunk)


def test_doc004_without_chunking_the_30k_prefill_stalls_every_decode_for_one_long_step():
    itl, _ = _decode_itls_and_long_ttft(max_num_batched_tokens=32_768,
                                        enable_chunked_prefill=False)
    stall = itl.max()
    assert stall >= LLAMA31.prefill_step_time(30_000)           # > 1 s on an H100
    assert stall > 1.0


def test_doc004_chunked_prefill_bounds_the_decodes_itl_by_one_budget_sized_step():
    itl_2048, ttft_2048 = _decode_itls_and_long_ttft(max_num_batched_tokens=2048)
    itl_512, ttft_512 = _decode_itls_and_long_ttft(max_num_batched_tokens=2048,
                                                   long_prefill_token_threshold=512)
    _, ttft_unchunked = _decode_itls_and_long_ttft(max_num_batched_tokens=32_768,
                                                   enable_chunked_prefill=False)
    assert itl_2048.max() <= _worst_chunk_step(2048 - NUM_DECODES) * (1 + 1e-9)
    assert itl_512.max() <= _worst_chunk_step(512) * (1 + 1e-9)
    assert itl_2048.max() < 0.1 < 1.0 < LLAMA31.prefill_step_time(30_000)
    # The frontier: a smaller chunk buys smoother ITL and pays with the long prompt's TTFT.
    assert itl_512.max() < itl_2048.max()
    assert ttft_unchunked < ttft_2048 < ttft_512
