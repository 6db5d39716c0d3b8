"""The Triton attention kernels against plain PyTorch, on CPU under TRITON_INTERPRET=1.

The interpreter runs the same kernel code the GPU compiles, with numpy semantics; this module
sets TRITON_INTERPRET=1 before anything imports triton, and checks that it took effect. One
difference is deliberate: the interpreter cannot run a bf16 tl.dot (it multiplies the uint16 bit
patterns), so interpreted kernels upcast dot operands to float32 — the same exact products and
float32 sums as the GPU's bf16 tensor cores. Everything else (bf16 loads, P rounded to bf16 before
P @ V, stores) is what the GPU runs.

Tolerances: float32 agrees to ~1e-6 (different summation order): 1e-5 allowed. bf16: inputs are
bf16, the reference computes in float32 from those same values; the kernel's P is rounded to bf16
(2^-9 relative) and the output is rounded to bf16 (|out| < ~3, half an ulp <= 2^-8): 2e-2
absolute + 2e-2 relative allowed; 1e-2 is seen.
"""
from __future__ import annotations

import os
import random
import weakref

_SAVED_INTERPRET = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"        # before triton is imported, here or by kvflow

import pytest  # noqa: E402
import torch  # noqa: E402

try:
    import triton  # noqa: F401
except ImportError:         # skipped, as importorskip would, leaving the environment as it was
    triton = None
    if _SAVED_INTERPRET is None:
        del os.environ["TRITON_INTERPRET"]
    pytest.skip("triton is not installed", allow_module_level=True)

from kvflow import LLM, SamplingParams  # noqa: E402
from kvflow.engine import EngineArgs, LLMEngine  # noqa: E402
from kvflow.model.attention import triton_attention as ops  # noqa: E402
from kvflow.model.attention.backend import AttentionMetadata, TorchAttentionBackend  # noqa: E402
from kvflow.model.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from attention_ref import D, make_cache, ref_attention, shuffled_tables  # noqa: E402
from model_fixtures import hf_greedy  # noqa: E402


def _restore_interpret() -> None:
    if _SAVED_INTERPRET is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _SAVED_INTERPRET


_restore_interpret()        # the kernels are decorated; other modules' tests never see it


@pytest.fixture(scope="module", autouse=True)
def _interpret():
    """Interpreted kernels need the variable while they run (triton reads it at launch too)."""
    os.environ["TRITON_INTERPRET"] = "1"
    yield
    _restore_interpret()


TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def test_the_interpreter_is_on():
    from triton.runtime.interpreter import InterpretedFunction
    assert ops.INTERPRETED
    assert isinstance(ops._prefill_kernel, InterpretedFunction)


# ---- store_kvcache -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kvh", [1, 2])
def test_store_kvcache_writes_by_slot_and_skips_minus_one(dtype, kvh):
    bs, nb = 8, 6
    sentinel = torch.full((nb, bs, kvh, D), 7.0, dtype=dtype)
    k_cache, v_cache = sentinel.clone(), sentinel.clone()
    kv = torch.randn(6, 2, kvh, D).to(dtype)      # the runner's layout: strided K and V views
    slots = torch.tensor([5, -1, 47, 0, 17, 30])
    ops.store_kvcache(kv[:, 0], kv[:, 1], k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, kvh, D), v_cache.view(-1, kvh, D)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat_k[s], kv[i, 0]) and torch.equal(flat_v[s], kv[i, 1])
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[[s for s in slots.tolist() if s >= 0]] = False
    assert (flat_k[untouched] == 7).all() and (flat_v[untouched] == 7).all()


# ---- prefill -------------------------------------------------------------------------------
PREFILL_CASES = [   # (q heads, kv heads, block size)
    (4, 2, 16), (4, 1, 8), (2, 2, 16), (6, 2, 32),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,kvh,bs", PREFILL_CASES)
def test_paged_prefill_matches_reference(h, kvh, bs, dtype):
    # A fresh prompt, a chunk continuing a cached prefix across many blocks, a long fresh
    # prompt spanning several query tiles, a one-token chunk after a prefix.
    q_lens, seq_lens = [5, 3, 70, 1], [5, 100, 70, 9]
    width = -(-max(seq_lens) // bs)
    nb = 4 * width + 3
    k_cache, v_cache = make_cache(nb, bs, kvh, dtype)
    table = shuffled_tables(4, width, nb)
    q = torch.randn(sum(q_lens), h, D).to(dtype)
    qsl = torch.tensor([0, 5, 8, 78, 79], dtype=torch.int32)
    out = ops.paged_prefill_attention(q, k_cache, v_cache, qsl, torch.tensor(seq_lens).int(),
                                      table, 0.3, max(q_lens))
    ref = ref_attention(q, k_cache, v_cache, table, q_lens, seq_lens, 0.3)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])


def test_prefill_rows_are_absolute_in_a_longer_batch():
    """The backend passes query_start_loc[num_decodes:]: rows outside the slice stay untouched."""
    k_cache, v_cache = make_cache(8, 4, 2, torch.float32)
    table = shuffled_tables(2, 4, 8)
    q = torch.randn(9, 4, D)
    out = torch.full_like(q, 5.0)
    qsl = torch.tensor([0, 1, 2, 9], dtype=torch.int32)     # two decodes, then one prefill of 7
    ops.paged_prefill_attention(q, k_cache, v_cache, qsl[2:], torch.tensor([10]).int(),
                                table[1:], 1.0, 7, out=out)
    ref = ref_attention(q[2:], k_cache, v_cache, table[1:], [7], [10], 1.0)
    torch.testing.assert_close(out[2:], ref, **TOL[torch.float32])
    assert (out[:2] == 5).all()


# ---- decode --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,kvh,bs", [(4, 2, 16), (4, 1, 8), (8, 8, 4)])
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_paged_decode_matches_reference(h, kvh, bs, dtype, num_splits):
    # Contexts of 1 token (empty splits), one block, and many blocks (300 / 4 = 75 blocks).
    seq_lens = [1, bs, 300]
    width = -(-max(seq_lens) // bs)
    nb = 3 * width
    k_cache, v_cache = make_cache(nb, bs, kvh, dtype)
    table = shuffled_tables(3, width, nb)
    q = torch.randn(3, h, D).to(dtype)
    out = ops.paged_decode_attention(q, k_cache, v_cache, torch.tensor(seq_lens).int(), table,
                                     0.25, max_seq_len=max(seq_lens), num_splits=num_splits)
    ref = ref_attention(q, k_cache, v_cache, table, [1, 1, 1], seq_lens, 0.25)
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])


def test_decode_with_many_splits_and_padded_rows():
    """16 splits over a 200-token context, and graph-style padding: seq_len 0 rows give zeros."""
    k_cache, v_cache = make_cache(60, 8, 2, torch.float32)
    table = shuffled_tables(2, 25, 60)
    q = torch.randn(3, 4, D)
    lens = torch.tensor([200, 33, 0]).int()
    out = ops.paged_decode_attention(q, k_cache, v_cache, lens,
                                     torch.cat([table, table[:1]]), 0.25, num_splits=16)
    ref = ref_attention(q[:2], k_cache, v_cache, table, [1, 1], [200, 33], 0.25)
    torch.testing.assert_close(out[:2], ref, **TOL[torch.float32])
    assert (out[2] == 0).all()


def test_split_count_grows_with_context_and_shrinks_with_batch():
    assert ops.num_decode_splits(1, 8, 100) == 1
    assert ops.num_decode_splits(1, 8, 4096) == ops.MAX_SPLITS
    assert ops.num_decode_splits(256, 8, 4096) == 1
    assert 1 < ops.num_decode_splits(8, 8, 4096) < ops.MAX_SPLITS


# ---- the backend against the torch backend, on one mixed step --------------------------------
def test_backend_mixed_step_matches_torch_backend():
    bs, kvh, h, nb = 4, 2, 4, 40
    # Two decodes, a prefill chunk continuing a cached prefix, a fresh prompt.
    q_lens, seq_lens = [1, 1, 6, 9], [13, 3, 22, 9]
    table = shuffled_tables(4, 6, nb, seed=3)
    slots = []
    for r, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
        slots += [int(table[r, p // bs]) * bs + p % bs for p in range(sl - ql, sl)]
    qsl = [0, 1, 2, 8, 17]
    t = qsl[-1]
    kv_cache = torch.randn(2, nb, bs, kvh, D)
    q, kv = torch.randn(t, h, D), torch.randn(t, 2, kvh, D)
    outs = []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend("cpu")):
        meta = AttentionMetadata(num_tokens=t, slot_mapping=torch.tensor(slots),
                                 query_start_loc=qsl, seq_lens=seq_lens,
                                 block_table=table.long(), num_decodes=2, block_size=bs,
                                 num_blocks=nb)
        backend.prepare(meta)
        cache = kv_cache.clone()
        outs.append((backend.forward(q, kv, cache, meta, 0.25), cache))
    torch.testing.assert_close(outs[1][0], outs[0][0], **TOL[torch.float32])
    assert torch.equal(outs[1][1], outs[0][1])


# ---- end to end: the engine with the triton backend against HF ----------------------------------
MAX_NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def _prompts():
    rng = random.Random(0)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 9, 17, 40)]


def _generate(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], outs


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen3"])
def test_engine_with_triton_backend_matches_hf(arch, request):
    ckpt = request.getfixturevalue(arch)
    prompts = _prompts()
    llm = LLM(ckpt, dtype="float32", attention_backend="triton", block_size=4,
              max_num_batched_tokens=7)      # chunked prefill, 7 tokens a step
    assert llm.llm_engine.attention_backend == "triton"
    got, _ = _generate(llm, prompts)
    assert got == hf_greedy(ckpt, prompts, MAX_NEW)


def test_engine_with_triton_backend_prefix_hit_matches_hf(tiny_qwen3):
    rng = random.Random(1)
    shared = [rng.randrange(3, 500) for _ in range(21)]
    prompts = [shared + [7, 8, 9], shared + [rng.randrange(3, 500) for _ in range(5)]]
    llm = LLM(tiny_qwen3, dtype="float32", attention_backend="triton", block_size=8)
    _generate(llm, prompts[:1])
    got, outs = _generate(llm, prompts)
    assert [o.num_cached_tokens for o in outs] == [16, 16]
    assert got == hf_greedy(tiny_qwen3, prompts, MAX_NEW)
    pool = llm.llm_engine.scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == llm.llm_engine.scheduler_config.num_blocks


class _EagerGraph:
    """Stands in for a captured CUDA graph on CPU: replay() re-runs the captured call eagerly
    into the same output tensor, so the static-buffer plumbing runs as it would on a GPU. Like a
    real graph it owns none of the tensors it reads: it holds them by weak reference, and a
    replay whose inputs were freed fails (on a GPU it would read reused memory)."""

    def __init__(self, fn, out):
        (args,) = fn.__defaults__             # DecodeGraphs captures `lambda args=args: ...`
        self.model = fn.__closure__[0].cell_contents
        self.refs = [weakref.ref(a) if isinstance(a, torch.Tensor) else (lambda a=a: a)
                     for a in args]
        self.out, self.replays = out, 0

    def replay(self):
        args = [r() for r in self.refs]
        assert all(a is not None for a in args), "a captured input was freed"
        self.out.copy_(self.model(*args))
        self.replays += 1

    def pool(self):
        return None


def test_cuda_runner_logic_on_cpu_with_eager_graphs(tiny_llama, monkeypatch):
    """The CUDA runner's own code (graph padding, static buffers, the sampler), minus the GPU."""
    from kvflow.model.runner.cuda_graphs import DecodeGraphs, capture_sizes
    from kvflow.model.runner.cuda_model_runner import CudaModelRunner
    def eager_capture(fn, pool):
        return (graph := _EagerGraph(fn, fn())), graph.out

    monkeypatch.setattr(DecodeGraphs, "_capture", staticmethod(eager_capture))
    engine = LLMEngine(EngineArgs(model=tiny_llama, dtype="float32", attention_backend="triton",
                                  block_size=4, max_num_seqs=5))
    old = engine.runner
    engine.engine_core.model_executor.runner = runner = CudaModelRunner(
        old.model, old.cfg, old.dtype, old.block_size, old.num_blocks, old.backend, 0,
        max_num_seqs=5, max_model_len=engine.scheduler_config.max_model_len,
        enforce_eager=False, device="cpu")
    assert capture_sizes(5) == [1, 2, 4, 5] and sorted(runner.graphs.graphs) == [1, 2, 4, 5]
    prompts = _prompts()[:3]        # 3 decodes replay the 4-row graph: one padded row
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out.outputs[0].token_ids
    assert [done[i] for i in range(3)] == hf_greedy(tiny_llama, prompts, MAX_NEW)
    assert runner.graphs.graphs[4][0].replays > 0


def test_cuda_graph_capture_sizes():
    from kvflow.model.runner.cuda_graphs import capture_sizes
    assert capture_sizes(1) == [1]
    assert capture_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
