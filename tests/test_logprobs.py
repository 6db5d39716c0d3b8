"""Logprobs of sampled and prompt tokens: the model's own log-softmax (HF transformers is the
reference), ranked top-k alternatives, unchanged by temperature, chunking, prefix caching,
speculation and preemption; and the OpenAI wire formats through the `openai` client."""
import math

import openai
import pytest
import torch

from kvflow import LLM, SamplingParams
from model_fixtures import hf_logits
from server_helpers import running_server
from test_spec_decode import OracleProposer

PROMPT = [5, 100, 200, 300, 400, 500, 7, 42, 99, 311, 17, 250, 260, 270, 280, 290, 300, 10]
TOL = 2e-4      # float32, different kernels and summation orders


@pytest.fixture(scope="module")
def llm(tiny_llama):
    n = torch.get_num_threads()
    yield LLM(tiny_llama, dtype="float32", max_model_len=128, num_blocks=64, num_threads=1)
    torch.set_num_threads(n)


def _ref(path, tokens: list[int]) -> torch.Tensor:
    """HF's log-softmax over one forward of `tokens`: row i scores token i + 1."""
    return hf_logits(path, tokens).log_softmax(dim=-1)


def _run(llm, sp, prompt=PROMPT):
    return llm.generate([prompt], sp, use_tqdm=False)[0]


def test_sample_and_prompt_logprobs_equal_hf_log_softmax(llm, tiny_llama):
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3,
                        prompt_logprobs=2)
    out = _run(llm, sp)
    c = out.outputs[0]
    full = PROMPT + c.token_ids
    ref = _ref(tiny_llama, full)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    for i, d in enumerate(out.prompt_logprobs[1:], start=1):
        assert abs(d[PROMPT[i]].logprob - ref[i - 1, PROMPT[i]].item()) < TOL
    assert len(c.logprobs) == len(c.token_ids)
    for j, (t, d) in enumerate(zip(c.token_ids, c.logprobs)):
        row = ref[len(PROMPT) + j - 1]
        assert abs(d[t].logprob - row[t].item()) < TOL
        assert d[t].rank == 1                           # greedy: the argmax
        top = row.topk(3)
        assert [k for k in d] [:1] == [t] and len(d) == 3   # the chosen one is also the top-1
        for tok, lp in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(d[tok].logprob - lp) < TOL
    assert math.isclose(c.cumulative_logprob, sum(d[t].logprob for t, d in
                                                  zip(c.token_ids, c.logprobs)), rel_tol=1e-6)


def test_logprobs_are_the_models_not_the_temperatures(llm, tiny_llama):
    """vLLM's default: raw logprobs, before temperature, penalties or top-k."""
    sp = SamplingParams(temperature=3.0, top_k=5, seed=7, max_tokens=6, ignore_eos=True,
                        logprobs=0, repetition_penalty=1.3)
    c = _run(llm, sp).outputs[0]
    ref = _ref(tiny_llama, PROMPT + c.token_ids)
    for j, (t, d) in enumerate(zip(c.token_ids, c.logprobs)):
        row = ref[len(PROMPT) + j - 1]
        assert list(d) == [t]                           # logprobs=0: the chosen token only
        assert abs(d[t].logprob - row[t].item()) < TOL
        assert d[t].rank == int((row > row[t]).sum()) + 1


def test_prompt_logprobs_are_whole_across_chunks_and_a_cached_prefix(tiny_llama):
    """A prompt in 4-token chunks, whose prefix another request just cached, still gets every
    prompt token scored (such a request computes its prompt itself)."""
    eng = LLM(tiny_llama, dtype="float32", max_model_len=128, num_blocks=64, num_threads=1,
              max_num_batched_tokens=4, block_size=4)
    _run(eng, SamplingParams(temperature=0, max_tokens=1))          # caches PROMPT's blocks
    out = _run(eng, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    ref = _ref(tiny_llama, PROMPT)
    got = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], PROMPT[1:])]
    assert got == pytest.approx([ref[i - 1, PROMPT[i]].item() for i in range(1, len(PROMPT))],
                                abs=TOL)


def test_logprobs_with_speculation_equal_logprobs_without(tiny_llama, llm):
    """Accepted drafts report the logprobs of the rows that verified them."""
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    a = _run(llm, sp).outputs[0]
    spec = LLM(tiny_llama, dtype="float32", max_model_len=128, num_blocks=64, num_threads=1,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    core = spec.llm_engine.engine_core
    core.proposer = OracleProposer({tuple(PROMPT): a.token_ids})
    b = _run(spec, sp).outputs[0]
    assert a.token_ids == b.token_ids
    assert core.scheduler.spec_stats.num_accepted_tokens > 0
    for da, db in zip(a.logprobs, b.logprobs, strict=True):
        assert list(da) == list(db)
        assert [x.logprob for x in da.values()] == pytest.approx(
            [x.logprob for x in db.values()], abs=TOL)


def test_prompt_logprobs_survive_preemption(tiny_llama):
    """Preempted mid-prompt, a request recomputes and still reports each prompt token once."""
    eng = LLM(tiny_llama, dtype="float32", max_model_len=128, num_blocks=12, block_size=4,
              max_num_batched_tokens=8, num_threads=1)
    sps = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=1)] * 3
    outs = eng.generate([PROMPT, PROMPT[::-1], PROMPT[3:]], sps, use_tqdm=False)
    assert eng.llm_engine.scheduler.num_preemptions > 0
    for o in outs:
        p = o.prompt_token_ids
        ref = _ref(tiny_llama, p)
        assert len(o.prompt_logprobs) == len(p)
        got = [d[t].logprob for d, t in zip(o.prompt_logprobs[1:], p[1:])]
        assert got == pytest.approx([ref[i - 1, p[i]].item() for i in range(1, len(p))], abs=TOL)


# ---- the OpenAI wire formats ------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(tiny_llama):
    with running_server(tiny_llama) as s:
        yield openai.OpenAI(api_key="x", base_url=s.url + "/v1", max_retries=0, timeout=60)


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_reads_it(client, llm):
    """lm-eval's loglikelihood request: echo, logprobs=1, max_tokens=1, temperature 0."""
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, logprobs=1,
                                  echo=True, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(PROMPT) + 1 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None
    off = _run(llm, SamplingParams(temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1))
    want = [d[t].logprob for d, t in zip(off.prompt_logprobs[1:], PROMPT[1:])]
    want.append(off.outputs[0].logprobs[0][off.outputs[0].token_ids[0]].logprob)
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=TOL)
    # Greedy: the chosen (generated) token is the most likely of its top_logprobs.
    assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())
    assert r.choices[0].text.startswith(llm.get_tokenizer().decode(PROMPT))


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_stream_as_they_do_not(client, stream):
    kw = dict(model="tiny", prompt="The cat", max_tokens=8, logprobs=2, temperature=0)
    whole = client.completions.create(**kw).choices[0].logprobs
    if not stream:
        assert len(whole.tokens) == len(whole.token_logprobs) == len(whole.top_logprobs) == 8
        assert all(len(t) <= 3 for t in whole.top_logprobs)
        return
    toks, lps = [], []
    for ch in client.completions.create(**kw, stream=True):
        if ch.choices and ch.choices[0].logprobs:
            toks += ch.choices[0].logprobs.tokens
            lps += ch.choices[0].logprobs.token_logprobs
    assert toks == whole.tokens and lps == pytest.approx(whole.token_logprobs)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_and_top_logprobs(client, stream):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
              temperature=0, logprobs=True, top_logprobs=3)
    if not stream:
        r = client.chat.completions.create(**kw)
        content = r.choices[0].logprobs.content
        assert len(content) == r.usage.completion_tokens
        for t in content:
            assert len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == t.logprob
            assert t.bytes == list(t.token.encode())
        return
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    got = [t for ch in client.chat.completions.create(**kw, stream=True)
           if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [t.token for t in got] == [t.token for t in whole]
    assert [t.logprob for t in got] == pytest.approx([t.logprob for t in whole])


def test_prompt_logprobs_extra_in_the_response(client):
    r = client.completions.create(model="tiny", prompt=PROMPT[:5], max_tokens=1,
                                  extra_body={"prompt_logprobs": 1})
    pl = r.model_extra["choices"][0]["prompt_logprobs"] if r.model_extra.get("choices") else \
        r.choices[0].model_extra["prompt_logprobs"]
    assert pl[0] is None and len(pl) == 5
    assert all(str(t) in d for t, d in zip(PROMPT[1:5], pl[1:]))
