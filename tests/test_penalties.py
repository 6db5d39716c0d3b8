"""Penalties, logit_bias, allowed_token_ids, bad_words and min_p: the batched sampler against a
one-request-at-a-time reference, and through the engine (greedy against HF logits penalised by
hand, batches, preemption, speculation, the server)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow import LLM, SamplingParams
from kvflow.model.sample.logits_processors import TokenCounts, bad_word_bans, static_bias
from model_fixtures import hf_logits
from server_helpers import running_server

PROMPT = [5, 100, 200, 300, 400, 500, 7, 42, 99, 311]
V = 64


def reference_penalties(logits: torch.Tensor, prompt: list[int], out: list[int],
                        sp: SamplingParams) -> torch.Tensor:
    """vLLM's rules, token by token, for one row."""
    x = logits.clone()
    for t in set(prompt) | set(out):
        x[t] = x[t] / sp.repetition_penalty if x[t] > 0 else x[t] * sp.repetition_penalty
    for t in set(out):
        x[t] -= sp.frequency_penalty * out.count(t) + sp.presence_penalty
    return x


rows = st.tuples(st.lists(st.integers(0, V - 1), max_size=12),     # prompt
                 st.lists(st.integers(0, V - 1), max_size=12),     # output so far
                 st.floats(0.5, 2.0), st.floats(-2, 2), st.floats(-2, 2))


@settings(max_examples=40, deadline=None)
@given(st.lists(rows, min_size=1, max_size=5), st.lists(st.integers(0, V - 1), max_size=5))
def test_batched_penalties_equal_the_per_token_rules(batch, sampled):
    counts = TokenCounts(V, torch.device("cpu"))
    slots, params = [], []
    for prompt, out, rep, freq, pres in batch:
        slots.append(counts.add(prompt, out))
        params.append(SamplingParams(repetition_penalty=rep, frequency_penalty=freq,
                                     presence_penalty=pres))
    # A step's sampled tokens are counted too (one per row, as the runner records them).
    step = sampled[:len(batch)]
    counts.record(slots[:len(step)], step)
    outs = [out + step[i:i + 1] for i, (_, out, *_) in enumerate(batch)]
    logits = torch.randn(len(batch), V) * 3
    got = logits.clone()
    counts.apply(got, list(range(len(batch))), slots, params)
    for i, (prompt, *_ ) in enumerate(batch):
        want = reference_penalties(logits[i], prompt, outs[i], params[i])
        assert torch.allclose(got[i], want, atol=1e-5)


def test_released_slots_are_reused_clean():
    counts = TokenCounts(V, torch.device("cpu"))
    a = counts.add([1, 2], [3, 3])
    counts.release(a)
    b = counts.add([], [])
    assert b == a and counts.counts[b].sum() == 0 and not counts.prompt[b].any()


def test_static_bias_and_bad_word_rules():
    sp = SamplingParams(allowed_token_ids=[1, 2, 3], logit_bias={2: 5.0, 9: 1.0},
                        bad_words_token_ids=[[3], [4, 5]])
    b = static_bias(sp, 10)
    assert b[1] == 0 and b[2] == 5.0 and b[3] == float("-inf") and b[0] == float("-inf")
    assert b[9] == float("-inf")        # outside the allowed ids, whatever its bias
    assert static_bias(SamplingParams(), 10) is None
    assert bad_word_bans(sp, [7, 4]) == [5] and bad_word_bans(sp, [4, 7]) == []


# ---- through the engine -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_llama):
    n = torch.get_num_threads()
    yield LLM(tiny_llama, dtype="float32", max_model_len=128, num_blocks=64, num_threads=1)
    torch.set_num_threads(n)


def _gen(llm, sp, prompts=(PROMPT,)):
    return [o.outputs[0].token_ids for o in llm.generate(list(prompts), sp, use_tqdm=False)]


PENALISED = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8,
                           frequency_penalty=1.5, presence_penalty=0.7)


def test_greedy_with_penalties_is_the_argmax_of_hf_logits_penalised_by_hand(llm, tiny_llama):
    out = _gen(llm, PENALISED)[0]
    ref = hf_logits(tiny_llama, PROMPT + out)
    for j, t in enumerate(out):
        row = reference_penalties(ref[len(PROMPT) + j - 1], PROMPT, out[:j], PENALISED)
        assert int(row.argmax()) == t
    assert out != _gen(llm, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]


def test_penalised_requests_leave_their_batch_neighbours_alone(llm):
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = _gen(llm, plain, [PROMPT[::-1]])[0]
    mixed = llm.generate([PROMPT, PROMPT[::-1]], [PENALISED, plain], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    assert mixed[0].outputs[0].token_ids == _gen(llm, PENALISED)[0]
    assert llm.llm_engine.engine_core.runner.token_counts.free   # slots came back


def test_penalties_survive_preemption(tiny_llama, llm):
    """A preempted request's counts are rebuilt from its tokens when it resumes."""
    want = [_gen(llm, PENALISED, [p])[0] for p in (PROMPT, PROMPT[::-1], PROMPT[2:])]
    small = LLM(tiny_llama, dtype="float32", max_model_len=128, num_blocks=10, block_size=4,
                max_num_batched_tokens=8, num_threads=1)
    got = _gen(small, PENALISED, [PROMPT, PROMPT[::-1], PROMPT[2:]])
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert got == want


def test_logit_bias_forces_and_bans_tokens(llm):
    forced = _gen(llm, SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True,
                                      logit_bias={"77": 100}))[0]
    assert forced == [77] * 6
    greedy = _gen(llm, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    banned = _gen(llm, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                      logit_bias={greedy[0]: -100}))[0]
    assert banned[0] != greedy[0]


@pytest.mark.parametrize("seed", range(4))
def test_sampled_tokens_stay_in_allowed_token_ids(llm, seed):
    allowed = [3, 17, 40, 41, 300]
    out = _gen(llm, SamplingParams(temperature=1.5, seed=seed, max_tokens=16, ignore_eos=True,
                                   allowed_token_ids=allowed))[0]
    assert set(out) <= set(allowed)


def test_bad_words_never_appear(llm):
    tok = llm.get_tokenizer()
    greedy = _gen(llm, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    word = tok.decode(greedy[:2]).strip()            # a word the model wants to say
    ids = [tok.encode(w, add_special_tokens=False) for w in (word, " " + word)]
    for seed in range(3):
        sp = SamplingParams(temperature=0.9, seed=seed, max_tokens=24, ignore_eos=True,
                            bad_words=[word])
        out = _gen(llm, sp)[0]
        for w in ids:
            assert not any(out[i:i + len(w)] == w for i in range(len(out)))


def test_min_p_one_keeps_only_the_most_likely_token(llm):
    greedy = _gen(llm, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    for seed in range(3):
        sp = SamplingParams(temperature=1.0, seed=seed, max_tokens=10, ignore_eos=True, min_p=1.0)
        assert _gen(llm, sp)[0] == greedy


def test_requests_with_penalties_get_no_drafts(tiny_llama, llm):
    spec = LLM(tiny_llama, dtype="float32", max_model_len=128, num_blocks=64, num_threads=1,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                   "prompt_lookup_min": 1})
    assert _gen(spec, PENALISED) == _gen(llm, PENALISED)
    assert spec.llm_engine.engine_core.scheduler.spec_stats.num_drafts == 0


def test_server_takes_penalties_and_bias(tiny_llama, llm):
    import openai
    with running_server(tiny_llama) as s:
        c = openai.OpenAI(api_key="x", base_url=s.url + "/v1", max_retries=0, timeout=60)
        r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                 frequency_penalty=1.5, presence_penalty=0.7,
                                 extra_body={"repetition_penalty": 1.8, "ignore_eos": True})
        assert r.choices[0].text == llm.get_tokenizer().decode(_gen(llm, PENALISED)[0])
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                      max_tokens=4, logit_bias={"77": 100},
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].message.content == llm.get_tokenizer().decode([77] * 4)
