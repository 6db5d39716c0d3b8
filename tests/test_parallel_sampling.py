"""Parallel sampling (n > 1): a parent fans out into n child requests that share the prompt's KV
blocks through the prefix cache; LLM, AsyncLLM and the server return n completions per prompt."""
import asyncio
import random

import openai
import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.engine.async_llm import AsyncLLM
from kvflow.engine.llm_engine import EngineArgs, LLMEngine
from kvflow.engine.parallel_sampling import child_request_id, child_sampling_params
from kvflow.sampling_params import SEED_MAX
from model_fixtures import make_tiny_checkpoint
from server_helpers import metric, metrics, running_server, wait_idle

ENGINE = dict(dtype="float32", num_threads=1, max_model_len=256)
PROMPTS = ["The cat sees the red house", "A dog likes"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """The tiny llama with room for a 1,000-token prompt."""
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny_llama_long"),
                                max_position_embeddings=1536)


@pytest.fixture(scope="module")
def llm(model):
    n = torch.get_num_threads()
    yield LLM(model, **ENGINE)
    torch.set_num_threads(n)


def _tokens(outs) -> list[tuple[int, ...]]:
    return [tuple(c.token_ids) for c in outs.outputs]


# ---- the prompt's KV is computed and stored once ------------------------------------------
def test_n8_over_a_1000_token_prompt_allocates_the_prompt_blocks_once(model):
    """8 children of a 1,000-token prompt (62 full blocks of 16 + 8 tokens) hold 62 shared
    blocks + one partial block each: 70 blocks, where 8 copies would need 504 (more than the
    pool's 128). The first step computes the prompt once plus each other child's last 8
    tokens, and the prefix cache reports 7 x 992 hit tokens."""
    eng = LLMEngine(EngineArgs(model=model, dtype="float32", num_threads=1, max_model_len=1100,
                               num_blocks=128, block_size=16))
    sched = eng.scheduler
    pool = sched.kv_cache_manager.block_pool
    scheduled, inner = [], sched.schedule

    def counting_schedule():
        so = inner()
        scheduled.append(so.total_num_scheduled_tokens)
        return so
    sched.schedule = counting_schedule
    prompt = [random.Random(0).randrange(3, 500) for _ in range(1000)]
    eng.add_request("p", prompt, SamplingParams(n=8, max_tokens=4, ignore_eos=True))
    peak, outs = 0, []
    while eng.has_unfinished_requests():
        outs += eng.step()
        peak = max(peak, pool.num_blocks - pool.num_free_blocks)
    full = 1000 // 16
    assert peak == full + 8
    assert scheduled[0] == 1000 + 7 * (1000 - full * 16)    # the prompt computed once
    assert sched.prefix_cache_hits == 7 * full * 16
    final = outs[-1]
    assert final.finished and final.request_id == "p" and len(final.outputs) == 8
    assert [c.index for c in final.outputs] == list(range(8))
    assert all(len(c.token_ids) == 4 for c in final.outputs)
    assert pool.num_free_blocks == pool.num_blocks


def test_children_hold_the_same_prompt_blocks(model):
    """After the first step every child's block table starts with the same 62 block ids, each
    referenced 8 times."""
    eng = LLMEngine(EngineArgs(model=model, dtype="float32", num_threads=1, max_model_len=1100,
                               num_blocks=128, block_size=16))
    prompt = [random.Random(1).randrange(3, 500) for _ in range(1000)]
    eng.add_request("p", prompt, SamplingParams(n=8, max_tokens=50, ignore_eos=True))
    eng.step()
    kvm = eng.scheduler.kv_cache_manager
    tables = [kvm.req_to_block_ids[child_request_id(i, "p")] for i in range(8)]
    assert len({tuple(t[:62]) for t in tables}) == 1
    assert len({t[62] for t in tables}) == 8        # each child's own partial block
    assert all(kvm._blocks[b].ref_cnt == 8 for b in tables[0][:62])
    eng.abort_request("p")
    assert kvm.block_pool.num_free_blocks == kvm.block_pool.num_blocks
    assert not eng.parent_requests.parents and not eng.states


# ---- what the n completions are ------------------------------------------------------------
def test_n_outputs_differ_under_sampling_and_are_equal_under_greedy(llm):
    sampled = llm.generate(PROMPTS[0], SamplingParams(n=4, temperature=1.0, seed=0,
                                                      max_tokens=16, ignore_eos=True),
                           use_tqdm=False)
    assert len(sampled) == 1 and len(set(_tokens(sampled[0]))) == 4
    greedy = SamplingParams(n=3, temperature=0, max_tokens=16, ignore_eos=True)
    (g,) = llm.generate(PROMPTS[0], greedy, use_tqdm=False)
    (one,) = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=16,
                                                     ignore_eos=True), use_tqdm=False)
    assert _tokens(g) == _tokens(one) * 3
    assert [c.text for c in g.outputs] == [one.outputs[0].text] * 3


def test_seeded_n_repeats_and_child_i_samples_with_seed_plus_i(llm):
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    a = llm.generate(PROMPTS, sp, use_tqdm=False)
    b = llm.generate(PROMPTS, sp, use_tqdm=False)
    assert [_tokens(o) for o in a] == [_tokens(o) for o in b]
    for i in range(3):      # as vLLM: child i is the n=1 request with seed + i
        (one,) = llm.generate(PROMPTS[1], SamplingParams(temperature=1.0, seed=7 + i,
                                                         max_tokens=12, ignore_eos=True),
                              use_tqdm=False)
        assert a[1].outputs[i].token_ids == one.outputs[0].token_ids


def test_only_the_first_child_scores_the_prompt_so_the_others_share_its_blocks(llm):
    """prompt_logprobs keep a request from reading the prefix cache (its logits are needed):
    the first child alone asks for them, and the parent's output carries them."""
    sched = llm.llm_engine.scheduler
    bs = sched.config.block_size
    prompt = [random.Random(2).randrange(3, 500) for _ in range(3 * bs + 5)]
    hits0 = sched.prefix_cache_hits
    (o,) = llm.generate([prompt], SamplingParams(n=3, max_tokens=2, prompt_logprobs=1),
                        use_tqdm=False)
    assert len(o.prompt_logprobs) == len(prompt) and o.prompt_logprobs[0] is None
    assert sched.prefix_cache_hits - hits0 == 2 * 3 * bs
    assert [child_sampling_params(SamplingParams(n=2, prompt_logprobs=1), i).prompt_logprobs
            for i in range(2)] == [1, None]


def test_child_seed_wraps_modulo_2_64_and_stays_valid():
    sp = child_sampling_params(SamplingParams(n=4, seed=SEED_MAX), 3)
    assert sp.n == 1 and sp.seed == SEED_MAX + 3 - (1 << 64)
    assert child_sampling_params(SamplingParams(n=2), 1).seed is None


def test_generate_and_chat_return_one_output_per_prompt_with_n_completions(llm):
    sps = [SamplingParams(n=2, max_tokens=3), SamplingParams(n=1, max_tokens=3)]
    outs = llm.generate(PROMPTS, sps, use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [2, 1]
    assert all(o.finished and o.prompt == p for o, p in zip(outs, PROMPTS))
    (c,) = llm.chat([{"role": "user", "content": "Hello!"}], SamplingParams(n=3, max_tokens=3),
                    use_tqdm=False)
    assert [x.index for x in c.outputs] == [0, 1, 2] and c.finished
    assert not llm.llm_engine.parent_requests.parents


def test_a_parent_id_in_use_is_refused(model):
    eng = LLMEngine(EngineArgs(model=model, **ENGINE))
    eng.add_request("x", "The cat", SamplingParams(n=2, max_tokens=2))
    for rid, n in (("x", 1), ("x", 3), ("0_x", 1)):
        with pytest.raises(ValueError, match="already in use"):
            eng.add_request(rid, "A dog", SamplingParams(n=n, max_tokens=2))
    assert eng.get_num_unfinished_requests() == 2


# ---- AsyncLLM: one stream per parent --------------------------------------------------------
@pytest.fixture(scope="module")
def async_llm(model):
    n = torch.get_num_threads()
    a = AsyncLLM.from_engine_args(EngineArgs(model=model, **ENGINE), multiprocess=False)
    yield a
    a.shutdown()
    torch.set_num_threads(n)


def _blocks(engine):
    s = engine.scheduler
    return (len(s.running), len(s.requests), s.kv_cache_manager.block_pool.num_free_blocks,
            engine.scheduler_config.num_blocks)


def test_a_parent_streams_all_n_completions_and_finishes_with_the_last_child(async_llm, llm):
    sp = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)

    async def main():
        return [o async for o in async_llm.generate(PROMPTS[0], sp, request_id="par")]
    outs = asyncio.run(main())
    assert all(o.request_id == "par" and len(o.outputs) == 3 for o in outs)
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    for i in range(3):
        lens = [len(o.outputs[i].token_ids) for o in outs]
        assert lens == sorted(lens) and lens[-1] == 10
    (exp,) = llm.generate(PROMPTS[0], sp, use_tqdm=False)
    assert _tokens(outs[-1]) == _tokens(exp)


def test_closing_a_parent_stream_frees_every_child_blocks(async_llm):
    sp = SamplingParams(n=4, temperature=1.0, max_tokens=200, ignore_eos=True)

    async def main():
        stream = await async_llm.add_request("closed", PROMPTS[0], sp)
        await stream.__anext__()
        busy = await async_llm.call_in_engine(_blocks)
        stream.close()
        return busy, await async_llm.call_in_engine(_blocks)
    (running, _, free0, total), (_, left, free1, _) = asyncio.run(main())
    assert running == 4 and free0 < total
    assert left == 0 and free1 == total
    assert not async_llm._parents.parents and not async_llm.output_processor.states


def test_aborting_a_parent_ends_every_completion_with_abort(async_llm):
    sp = SamplingParams(n=3, max_tokens=200, ignore_eos=True)

    async def main():
        stream = await async_llm.add_request("aborted", PROMPTS[1], sp)
        await stream.__anext__()
        await async_llm.abort("aborted")
        return [o async for o in stream], await async_llm.call_in_engine(_blocks)
    outs, (_, left, free, total) = asyncio.run(main())
    assert outs[-1].finished
    assert [c.finish_reason for c in outs[-1].outputs] == ["abort"] * 3
    assert left == 0 and free == total


# ---- the server, through the openai client --------------------------------------------------
@pytest.fixture(scope="module")
def server(model):
    with running_server(model, max_num_seqs=8) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(api_key="x", base_url=server.url + "/v1", max_retries=0, timeout=60)


def test_completions_n_returns_prompt_major_choices_and_counts_prompts_once(server, client):
    before = metrics(server.url)
    kw = dict(model="tiny", prompt=PROMPTS, n=3, max_tokens=5, temperature=1.0, seed=11,
              extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    assert [c.index for c in r.choices] == list(range(6))
    tok = server.llm.tokenizer
    assert r.usage.prompt_tokens == sum(len(tok.encode(p)) for p in PROMPTS)
    assert r.usage.completion_tokens == 6 * 5
    assert len({c.text for c in r.choices[:3]}) == 3
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    texts, finish = [""] * 6, [None] * 6
    for ch in chunks[:-1]:
        (c,) = ch.choices
        texts[c.index] += c.text
        finish[c.index] = finish[c.index] or c.finish_reason
    assert texts == [c.text for c in r.choices] and finish == ["length"] * 6
    assert chunks[-1].usage == r.usage
    after = metrics(server.url)        # children count as requests, as in vLLM
    name = "vllm:request_success_total"
    assert metric(after, name, finished_reason="length") == \
        metric(before, name, finished_reason="length") + 12
    for suffix, grew in (("_count", 4), ("_sum", 12)):     # and each parent once, with its n
        assert metric(after, "vllm:request_params_n" + suffix) == \
            metric(before, "vllm:request_params_n" + suffix) + grew


def test_n_with_logprobs_and_echo_gives_every_choice_its_own(server, client):
    kw = dict(model="tiny", prompt=PROMPTS[0], n=2, max_tokens=4, temperature=1.0, seed=2,
              logprobs=1, echo=True, extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    num_prompt = len(server.llm.tokenizer.encode(PROMPTS[0]))
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert c.text.startswith(PROMPTS[0])
        assert len(c.logprobs.tokens) == num_prompt + 4
        assert all(lp is not None for lp in c.logprobs.token_logprobs[-4:])
    texts = ["", ""]
    for ch in client.completions.create(**kw, stream=True):
        texts[ch.choices[0].index] += ch.choices[0].text
    assert texts == [c.text for c in r.choices]


def test_chat_n_returns_n_choices_streamed_and_not(server, client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Tell me a story."}], n=3,
              max_tokens=8, temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 24
    chunks = list(client.chat.completions.create(**kw, stream=True))
    roles = [ch.choices[0].index for ch in chunks if ch.choices[0].delta.role == "assistant"]
    assert roles == [0, 1, 2]
    texts = [""] * 3
    for ch in chunks:
        texts[ch.choices[0].index] += ch.choices[0].delta.content or ""
    assert texts == [c.message.content for c in r.choices]
    assert wait_idle(server.llm)["free_blocks"] == wait_idle(server.llm)["num_blocks"]


@pytest.mark.parametrize("body,param", [({"n": 9}, "n"), ({"n": 0}, "n"),
                                        ({"n": 2, "best_of": 3}, "best_of")])
def test_n_above_max_num_seqs_or_best_of_is_a_400_naming_it(client, body, param):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body=body)
    assert ei.value.body["param"] == param and param in ei.value.body["message"]
