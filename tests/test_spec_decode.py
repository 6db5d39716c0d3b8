"""Speculative decoding (n-gram prompt lookup): the config, the proposer, the scheduler's budget
and rollback, the sampler's verification, and the engine's output against no speculation."""
from __future__ import annotations

import pytest
import torch

from helpers import make_sched, req
from kvflow import LLM, SamplingParams
from kvflow.core.config import SpeculativeConfig
from kvflow.core.request import Request
from kvflow.core.spec_decode import NgramProposer
from kvflow.engine.arg_utils import EngineArgs
from kvflow.model.sample.sampler import Sampler

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}


# ---- config ------------------------------------------------------------------------------
def test_speculative_config_takes_vllms_dict_and_names_bad_keys():
    c = SpeculativeConfig.from_dict(NGRAM)
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (4, 2, 4)
    with pytest.raises(ValueError, match="draft_model"):
        SpeculativeConfig.from_dict({**NGRAM, "draft_model": "x"})
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig.from_dict({"method": "eagle"})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig.from_dict({"prompt_lookup_min": 5, "prompt_lookup_max": 3})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineArgs(speculative_config={"num_speculative_tokens": 0})


def test_drafts_shrink_as_the_batch_grows_down_to_none():
    c = SpeculativeConfig(num_speculative_tokens=4, max_batch_tokens=16)
    assert [c.num_drafts_for(n) for n in (1, 2, 3, 4, 5, 8, 9, 32)] == [4, 4, 4, 3, 2, 1, 0, 0]
    default = SpeculativeConfig()
    assert [default.num_drafts_for(n) for n in (1, 2, 3, 4, 6, 7, 32)] == [4, 4, 3, 2, 1, 0, 0]
    assert SpeculativeConfig(disable_by_batch_size=3).num_drafts_for(3) == 0


# ---- proposer ----------------------------------------------------------------------------
def decoding(prompt: list[int], out: list[int], max_tokens: int = 100) -> Request:
    r = Request("r", prompt, SamplingParams(max_tokens=max_tokens))
    for t in out:
        r.append_output_token_ids(t)
    r.num_computed_tokens = r.num_tokens - 1
    return r


def test_proposer_copies_what_followed_the_longest_earlier_match():
    p = NgramProposer(SpeculativeConfig(num_speculative_tokens=3), max_model_len=1000)
    # suffix [7, 8, 9] occurred before, followed by 1 2 3; [8, 9] alone also followed by 5
    r = decoding([7, 8, 9, 1, 2, 3, 4, 8, 9, 5, 6, 0], [7, 8, 9])
    assert p.propose([r], 1) == {"r": [1, 2, 3]}


def test_proposer_prefers_the_latest_match_unless_it_is_too_short():
    p = NgramProposer(SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=2),
                      max_model_len=1000)
    r = decoding([1, 2, 10, 11, 1, 2, 20, 21, 0], [1, 2])
    assert p.lookup(r, 2) == [20, 21]           # the latest occurrence
    r = decoding([1, 2, 10, 11], [0, 1, 2, 1, 2])
    assert p.lookup(r, 2) == [1, 2]
    assert p.lookup(r, 3) == [10, 11, 0]        # the latest has only 2 tokens after it
    assert p.lookup(decoding([5, 6, 7], [8]), 2) == []      # no earlier match


def test_proposer_index_grows_with_the_sequence():
    p = NgramProposer(SpeculativeConfig(num_speculative_tokens=2), max_model_len=1000)
    r = decoding([1, 2, 3, 4], [9])
    assert p.lookup(r, 2) == []
    for t in (1, 2):
        r.append_output_token_ids(t)
    assert p.lookup(r, 2) == [3, 4]


def test_proposer_drafts_only_for_decoding_requests_within_room():
    p = NgramProposer(SpeculativeConfig(num_speculative_tokens=4), max_model_len=1000)
    fresh = Request("f", [1, 2, 3, 1, 2], SamplingParams())        # nothing sampled yet
    resumed = decoding([1, 2, 3, 4, 1, 2], [3])
    resumed.request_id = "x"
    resumed.num_computed_tokens = 2                                 # re-running its prefill
    near_end = decoding([1, 2, 3, 4, 5, 1, 2], [3], max_tokens=3)   # 2 more tokens allowed
    near_end.request_id = "n"
    assert p.propose([fresh, resumed, near_end], 3) == {"n": [4]}   # one draft + one bonus
    assert p.propose([near_end], 100) == {}                         # the batch rule: none


# ---- scheduler ---------------------------------------------------------------------------
def start_decoding(s, r):
    s.add_request(r)
    so = s.schedule()
    s.update_from_output(so, {r.request_id: [1]})


def test_drafts_count_in_the_budget_and_are_cut_to_fit():
    s = make_sched(block_size=4, num_blocks=64, max_num_batched_tokens=4)
    a = req("a", 3)
    start_decoding(s, a)
    s.update_draft_token_ids({"a": [5, 6, 7, 8, 9]})
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 4}
    assert so.scheduled_spec_decode_tokens == {"a": [5, 6, 7]}
    assert a.spec_token_ids == []       # proposed anew after every step


def test_rejected_drafts_roll_back_and_never_enter_the_prefix_cache():
    s = make_sched(block_size=4, num_blocks=64)
    a = req("a", 3)
    start_decoding(s, a)                # 4 tokens, 3 computed
    s.update_draft_token_ids({"a": [5, 6, 7, 8]})
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 5} and a.num_computed_tokens == 8
    # one draft accepted, then the model's own token
    outs = s.update_from_output(so, {"a": [5, 2]})
    assert outs[0].new_token_ids == [5, 2]
    assert a.num_tokens == 6 and a.num_computed_tokens == 5
    kvm = s.kv_cache_manager
    hashed = [kvm.block_hash(b) for b in kvm.get_block_ids("a")]
    assert hashed[0] is not None and hashed[1] is None     # block 1 holds drafts: not cached
    st = s.make_stats().spec_decoding
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (1, 4, 1)
    assert st.num_accepted_tokens_per_pos == [1, 0, 0, 0]


def test_a_stop_token_inside_the_accepted_run_truncates_there():
    s = make_sched(block_size=4, num_blocks=64)
    a = req("a", 3, stop_token_ids=[6])
    start_decoding(s, a)
    s.update_draft_token_ids({"a": [5, 6, 7]})
    so = s.schedule()
    outs = s.update_from_output(so, {"a": [5, 6, 7, 3]})
    assert outs[0].new_token_ids == [5, 6] and outs[0].finish_reason == "stop"
    assert s.kv_cache_manager.num_free_blocks == 64


def test_max_tokens_inside_the_accepted_run_truncates_there():
    s = make_sched(block_size=4, num_blocks=64)
    a = req("a", 3, max_tokens=3)
    start_decoding(s, a)
    s.update_draft_token_ids({"a": [5, 6, 7]})
    outs = s.update_from_output(s.schedule(), {"a": [5, 6, 7, 3]})
    assert outs[0].new_token_ids == [5, 6] and outs[0].finish_reason == "length"


def test_drafts_stop_short_of_max_model_len():
    s = make_sched(block_size=4, num_blocks=64, max_model_len=8)
    a = req("a", 5, max_tokens=None)
    start_decoding(s, a)                # 6 tokens, 5 computed; at most position 6 may run
    s.update_draft_token_ids({"a": [1, 2, 3]})
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 2}
    assert so.scheduled_spec_decode_tokens == {"a": [1]}


def test_preempting_a_request_with_drafts_drops_them_and_leaks_nothing():
    s = make_sched(block_size=2, num_blocks=6, max_num_batched_tokens=64)
    a, b = req("a", 4, max_tokens=6), req("b", 4, max_tokens=6)
    s.add_request(a)
    s.add_request(b)
    so = s.schedule()
    s.update_from_output(so, {"a": [1], "b": [1]})
    s.update_draft_token_ids({"a": [1, 2, 3], "b": [1, 2, 3]})
    so = s.schedule()                   # 3 blocks each would be needed: b is preempted
    assert so.preempted_req_ids == {"b"}
    assert b.spec_token_ids == [] and "b" not in so.scheduled_spec_decode_tokens
    s.finish_requests(["a", "b"], a.status.FINISHED_ABORTED)
    assert s.kv_cache_manager.num_free_blocks == 6


# ---- sampler -----------------------------------------------------------------------------
def test_greedy_verification_accepts_the_argmax_prefix():
    logits = torch.full((4, 8), -5.0)
    for row, tok in enumerate([3, 4, 1, 6]):
        logits[row, tok] = 5.0
    s = Sampler()
    g = SamplingParams(temperature=0)
    assert s.verify(logits, [g], [None], [[3, 4, 2]]) == [[3, 4, 1]]
    assert s.verify(logits, [g], [None], [[3, 4, 1]]) == [[3, 4, 1, 6]]
    assert s.verify(logits[:2], [g, g], [None, None], [[], []]) == [[3], [4]]


def test_rejection_sampling_keeps_the_target_distribution():
    """A draft of token 0 verified against p: the emitted first token is distributed as p,
    whatever the draft (accept with p(d), else draw from p without d)."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = p.log().repeat(2, 1)
    s = Sampler(seed=3)
    sp = SamplingParams(temperature=1.0)
    n = 20000
    for draft in (0, 3):
        counts = torch.zeros(4)
        for toks in s.verify(logits.repeat(n, 1), [sp] * n, [None] * n, [[draft]] * n):
            counts[toks[0]] += 1
        freq = counts / n
        assert torch.allclose(freq, p, atol=0.015), (draft, freq)


def test_seeded_verification_repeats():
    logits = torch.randn(3, 50)
    sp = SamplingParams(temperature=0.8, seed=7)
    runs = [Sampler(seed=i).verify(logits, [sp], [torch.Generator().manual_seed(7)], [[1, 2]])
            for i in range(2)]
    assert runs[0] == runs[1]


# ---- engine ------------------------------------------------------------------------------
class OracleProposer:
    """Drafts from the output a run without speculation produced, corrupted at a random
    position in every other proposal: random tiny models never repeat themselves, so n-gram
    drafts would all be rejected and the accepting paths would go untested."""

    def __init__(self, expected: dict[tuple, list[int]], k: int = 4) -> None:
        self.expected, self.k, self.calls = expected, k, 0

    def propose(self, requests, num_running):
        out = {}
        for r in requests:
            if not r.output_token_ids or r.num_computed_tokens != r.num_tokens - 1:
                continue
            self.calls += 1
            n = len(r.output_token_ids)
            d = list(self.expected[tuple(r.prompt_token_ids)][n:n + self.k])
            if d and self.calls % 2:
                d[self.calls % len(d)] += 1
            if d:
                out[r.request_id] = d
        return out


def prompts_for_tests() -> list[list[int]]:
    base = list(range(20, 44))
    return [base * 3, (base[:10] + [7, 8]) * 4, list(range(50, 80)),
            base[:16] * 2 + list(range(100, 120)), base * 2 + [5, 6]]    # last: a prefix hit


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen3"])
@pytest.mark.parametrize("engine", [
    dict(),                                                     # plain
    dict(max_num_batched_tokens=7, block_size=4),               # chunked prefill, drafts cut
    dict(num_blocks=30, block_size=4, max_num_seqs=4),          # preemption
])
def test_greedy_output_with_speculation_equals_without(arch, engine, request):
    path = request.getfixturevalue(arch)
    prompts = prompts_for_tests()
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(dtype="float32", max_model_len=128, **engine)
    plain = [o.outputs[0].token_ids for o in LLM(path, **kw).generate(
        [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]
    llm = LLM(path, speculative_config=NGRAM, **kw)
    core = llm.llm_engine.engine_core
    core.proposer = OracleProposer({tuple(p): o for p, o in zip(prompts, plain)})
    spec = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == plain
    stats = core.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert core.kv_state()["free_blocks"] == core.kv_state()["num_blocks"]
    if "num_blocks" in engine:
        assert core.scheduler.num_preemptions > 0


def test_seeded_sampling_with_speculation_repeats(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", speculative_config={**NGRAM, "prompt_lookup_min": 1})
    sp = SamplingParams(temperature=0.7, seed=11, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in prompts_for_tests()]
    a = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert a == b and all(len(t) == 24 for t in a)
    assert llm.llm_engine.engine_core.scheduler.spec_stats.num_drafts > 0


# ---- server ------------------------------------------------------------------------------
def test_serve_takes_speculative_config_as_json():
    from kvflow.cli import build_parser
    a = build_parser().parse_args(["serve", "--speculative-config", '{"method": "ngram"}'])
    assert EngineArgs.from_cli_args(a).speculative_config_obj().num_speculative_tokens == 4
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", "{ngram"])


def test_served_streams_with_speculation_and_vllms_spec_metrics(tiny_llama):
    import openai
    from server_helpers import metric, metrics, running_server
    spec = {**NGRAM, "prompt_lookup_min": 1}
    with running_server(tiny_llama, multiprocess=True, speculative_config=spec) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x")
        prompt = prompts_for_tests()[0]
        plain = client.completions.create(model=s.name, prompt=prompt, max_tokens=32,
                                          temperature=0).choices[0].text
        stream = client.completions.create(model=s.name, prompt=prompt, max_tokens=32,
                                           temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream) == plain
        m = metrics(s.url)
    drafts = metric(m, "vllm:spec_decode_num_drafts_total")
    draft_tokens = metric(m, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric(m, "vllm:spec_decode_num_accepted_tokens_total")
    per_pos = sum(v for (name, _), v in m.items()
                  if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total")
    assert drafts > 0 and draft_tokens >= drafts and accepted <= draft_tokens
    assert per_pos == accepted
