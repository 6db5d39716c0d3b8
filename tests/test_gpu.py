"""The CUDA path on a real GPU: the compiled Triton kernels, CUDA graphs, the KV cache sized from
gpu_memory_utilization, and the engine's output against HF transformers.

Skipped (and reported as skipped) where torch sees no GPU, as on CI. The interpreter tests in
test_triton_kernels.py cover the kernels' code on CPU; these cover what only a GPU can run.
"""
from __future__ import annotations

import gc
import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from attention_ref import make_cache, ref_attention, shuffled_tables  # noqa: E402
from kvflow import LLM, SamplingParams  # noqa: E402
from model_fixtures import hf_greedy  # noqa: E402

CUDA = "cuda"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
NUM_BLOCKS = 512     # a fixed cache: one test's engine left alive cannot starve the next one


@pytest.fixture(autouse=True)
def _free_gpu_memory():
    yield
    gc.collect()
    torch.cuda.empty_cache()


def ops():
    from kvflow.model.attention import triton_attention
    assert not triton_attention.INTERPRETED, "TRITON_INTERPRET is set: these tests need the GPU"
    return triton_attention


# ---- the compiled kernels --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_store_kvcache_writes_by_slot_and_skips_minus_one(dtype):
    nb, bs, kvh, d = 6, 8, 2, 128
    k_cache = torch.full((nb, bs, kvh, d), 7.0, dtype=dtype, device=CUDA)
    v_cache = k_cache.clone()
    kv = torch.randn(6, 2, kvh, d, device=CUDA).to(dtype)
    slots = torch.tensor([5, -1, 47, 0, 17, 30], device=CUDA)
    ops().store_kvcache(kv[:, 0], kv[:, 1], k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, kvh, d), v_cache.view(-1, kvh, d)
    written = [s for s in slots.tolist() if s >= 0]
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat_k[s], kv[i, 0]) and torch.equal(flat_v[s], kv[i, 1])
    untouched = torch.ones(nb * bs, dtype=torch.bool, device=CUDA)
    untouched[written] = False
    assert (flat_k[untouched] == 7).all() and (flat_v[untouched] == 7).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,kvh,bs,d", [(4, 2, 16, 16), (16, 8, 16, 128), (6, 2, 32, 64)])
def test_compiled_prefill_matches_reference(h, kvh, bs, d, dtype):
    q_lens, seq_lens = [5, 3, 70, 1, 300], [5, 100, 70, 9, 300]
    width = -(-max(seq_lens) // bs)
    nb = len(q_lens) * width + 3
    k_cache, v_cache = make_cache(nb, bs, kvh, dtype, device=CUDA, d=d)
    table = shuffled_tables(len(q_lens), width, nb).to(CUDA)
    q = torch.randn(sum(q_lens), h, d).to(dtype).to(CUDA)
    qsl = torch.tensor([0, 5, 8, 78, 79, 379], dtype=torch.int32, device=CUDA)
    out = ops().paged_prefill_attention(q, k_cache, v_cache, qsl,
                                        torch.tensor(seq_lens, device=CUDA).int(), table,
                                        d ** -0.5, max(q_lens))
    ref = ref_attention(q, k_cache, v_cache, table, q_lens, seq_lens, d ** -0.5)
    assert out.dtype == dtype and out.is_cuda
    torch.testing.assert_close(out.float().cpu(), ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,kvh,bs,d", [(4, 2, 16, 16), (16, 8, 16, 128), (8, 8, 4, 64)])
@pytest.mark.parametrize("num_splits", [1, 3, None, 16])
def test_compiled_decode_matches_reference(h, kvh, bs, d, dtype, num_splits):
    seq_lens = [1, bs, 300, 2000]
    width = -(-max(seq_lens) // bs)
    nb = len(seq_lens) * width
    k_cache, v_cache = make_cache(nb, bs, kvh, dtype, device=CUDA, d=d)
    table = shuffled_tables(len(seq_lens), width, nb).to(CUDA)
    q = torch.randn(len(seq_lens), h, d).to(dtype).to(CUDA)
    out = ops().paged_decode_attention(q, k_cache, v_cache,
                                       torch.tensor(seq_lens, device=CUDA).int(), table,
                                       d ** -0.5, max_seq_len=max(seq_lens), num_splits=num_splits)
    ref = ref_attention(q, k_cache, v_cache, table, [1] * len(seq_lens), seq_lens, d ** -0.5)
    torch.testing.assert_close(out.float().cpu(), ref, **TOL[dtype])


# ---- the engine on the GPU -------------------------------------------------------------------
def _prompts(n=(1, 9, 17, 40, 3, 64)):
    rng = random.Random(0)
    return [[rng.randrange(3, 500) for _ in range(k)] for k in n]


def _generate(llm, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], outs


def _no_leak(llm):
    pool = llm.llm_engine.scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == llm.llm_engine.scheduler_config.num_blocks


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen3"])
def test_engine_on_cuda_matches_hf_greedy_in_float32(arch, enforce_eager, request):
    ckpt = request.getfixturevalue(arch)
    prompts = _prompts()
    llm = LLM(ckpt, device="cuda", dtype="float32", block_size=4, max_num_batched_tokens=16,
              max_num_seqs=8, enforce_eager=enforce_eager, num_blocks=NUM_BLOCKS)
    eng = llm.llm_engine
    assert (eng.device, eng.attention_backend) == ("cuda", "triton")
    assert (eng.runner.graphs is None) == enforce_eager
    got, _ = _generate(llm, prompts)
    assert got == hf_greedy(ckpt, prompts, MAX_NEW)
    _no_leak(llm)


def test_cuda_graph_replays_pad_the_batch_and_match_eager(tiny_llama):
    prompts = _prompts((5, 6, 7))     # three decodes replay the 4-row graph with a padded row
    runs = {}
    for eager in (False, True):
        llm = LLM(tiny_llama, device="cuda", dtype="float32", block_size=4, max_num_seqs=5,
                  enforce_eager=eager, num_blocks=NUM_BLOCKS)
        runs[eager], _ = _generate(llm, prompts)
        if not eager:
            assert sorted(llm.llm_engine.runner.graphs.graphs) == [1, 2, 4, 5]
    assert runs[False] == runs[True] == hf_greedy(tiny_llama, prompts, MAX_NEW)


def test_prefix_cache_hit_on_cuda_matches_hf(tiny_qwen3):
    rng = random.Random(1)
    shared = [rng.randrange(3, 500) for _ in range(21)]
    prompts = [shared + [7, 8, 9], shared + [rng.randrange(3, 500) for _ in range(5)]]
    llm = LLM(tiny_qwen3, device="cuda", dtype="float32", block_size=8,
              num_blocks=NUM_BLOCKS)
    _generate(llm, prompts[:1])
    got, outs = _generate(llm, prompts)
    assert [o.num_cached_tokens for o in outs] == [16, 16]
    assert got == hf_greedy(tiny_qwen3, prompts, MAX_NEW)
    _no_leak(llm)


def test_kv_cache_grows_with_gpu_memory_utilization_and_stays_under_it(tiny_llama):
    blocks = {}
    total = torch.cuda.get_device_properties(0).total_memory
    for u in (0.2, 0.4):
        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM(tiny_llama, device="cuda", block_size=16, gpu_memory_utilization=u)
        blocks[u] = llm.llm_engine.scheduler_config.num_blocks
        free, _ = torch.cuda.mem_get_info()
        assert total - free <= u * total * 1.02, (u, total - free)
        del llm
        torch.cuda.empty_cache()
    assert blocks[0.4] > 1.5 * blocks[0.2] > 0


def test_bf16_is_the_default_on_cuda_and_follows_float32(tiny_qwen3):
    prompts = _prompts()
    llm = LLM(tiny_qwen3, device="cuda", block_size=16, num_blocks=NUM_BLOCKS)
    assert llm.llm_engine.dtype == torch.bfloat16
    got, _ = _generate(llm, prompts)
    ref = hf_greedy(tiny_qwen3, prompts, MAX_NEW)
    # bf16 rounding may flip a near-tie late in a continuation; the first tokens must agree.
    assert [g[:2] for g in got] == [r[:2] for r in ref]


def test_seeded_sampling_on_cuda_repeats_and_does_not_depend_on_the_batch(tiny_llama):
    llm = LLM(tiny_llama, device="cuda", dtype="float32", num_blocks=NUM_BLOCKS)
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    prompt = _prompts((10,))
    alone, _ = _generate(llm, prompt, p)
    batched, _ = _generate(llm, prompt + _prompts((30, 4, 17)),
                           [p] + [SamplingParams(temperature=1.0, max_tokens=12)] * 3)
    other, _ = _generate(llm, prompt, SamplingParams(temperature=1.0, seed=99, max_tokens=12,
                                                     ignore_eos=True))
    assert alone[0] == batched[0] and alone[0] != other[0]


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_speculative_greedy_on_cuda_equals_without(tiny_llama, enforce_eager):
    """Drafts verified as decode rows (replayed from the decode graphs when they fit)."""
    from test_spec_decode import NGRAM, OracleProposer, prompts_for_tests
    prompts = prompts_for_tests()
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(device="cuda", dtype="float32", block_size=4, max_num_seqs=8,
              enforce_eager=enforce_eager, num_blocks=NUM_BLOCKS)
    plain = [o.outputs[0].token_ids for o in LLM(tiny_llama, **kw).generate(
        [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]
    llm = LLM(tiny_llama, speculative_config=NGRAM, **kw)
    core = llm.llm_engine.engine_core
    core.proposer = OracleProposer({tuple(p): o for p, o in zip(prompts, plain)})
    spec = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]
    assert spec == plain
    assert core.scheduler.spec_stats.num_accepted_tokens > 0
    _no_leak(llm)


def test_seeded_speculative_sampling_on_cuda_repeats(tiny_llama):
    from test_spec_decode import NGRAM, prompts_for_tests
    llm = LLM(tiny_llama, device="cuda", dtype="float32", num_blocks=NUM_BLOCKS,
              speculative_config={**NGRAM, "prompt_lookup_min": 1})
    sp = SamplingParams(temperature=0.7, seed=11, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in prompts_for_tests()]
    a = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert a == b and llm.llm_engine.engine_core.scheduler.spec_stats.num_drafts > 0
    _no_leak(llm)


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_async_scheduling_on_cuda_equals_sync_and_hf(tiny_llama, enforce_eager):
    """Async scheduling is the CUDA default: steps run in the executor's thread (CUDA graphs
    replayed there), output token-identical to sync steps and to HF."""
    prompts = _prompts()
    runs = {}
    for on in (False, True):
        llm = LLM(tiny_llama, device="cuda", dtype="float32", block_size=4,
                  max_num_batched_tokens=16, max_num_seqs=8, enforce_eager=enforce_eager,
                  num_blocks=NUM_BLOCKS, async_scheduling=on)
        assert llm.llm_engine.scheduler_config.async_scheduling is on
        runs[on], _ = _generate(llm, prompts)
        _no_leak(llm)
    assert runs[True] == runs[False] == hf_greedy(tiny_llama, prompts, MAX_NEW)


def test_async_scheduling_is_the_cuda_default(tiny_llama):
    llm = LLM(tiny_llama, device="cuda", dtype="float32", num_blocks=NUM_BLOCKS)
    assert llm.llm_engine.scheduler_config.async_scheduling
