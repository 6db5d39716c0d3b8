"""bf16 weights kept bf16 on CPUs that cannot pack them (kvflow/model/kernels/csrc/cpu_bf16.cpp,
layers.prepare_linears / keep_bf16_weights, loader.keeps_bf16_weights).

bf16w_linear widens each bf16 weight to float32 in registers (exact) and sums in float32, so it
must equal a float64 product of the same values to float32 summation error, on both its AVX2 and
its portable path. A bf16 checkpoint loaded with dtype="auto" where bf16 is slow (forced here with
KVFLOW_CPU_BF16_PACK=0, so the test runs on any CPU) computes in float32 over its bf16 weights:
the same greedy tokens as HF in float32, at half the weight memory.
"""
from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.model.kernels import cpu_ops
from model_fixtures import hf_greedy, make_tiny_checkpoint

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="kvflow CPU kernels not built")

HAS_AVX2 = " avx2" in cpu_ops._cpu_flags() and " fma" in cpu_ops._cpu_flags()
TOKENS = [1, 2, 3, 5, 8, 13, 17, 64, 200]     # every tile shape, tile remainders, the wide path


@pytest.fixture(params=["scalar", "avx2"])
def isa(request):
    if request.param == "avx2" and not HAS_AVX2:
        pytest.skip("this CPU lacks AVX2/FMA")
    assert cpu_ops.set_bf16w_isa(request.param) == request.param
    yield request.param
    cpu_ops.set_bf16w_isa("auto")


def _case(T: int, I: int, O: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, I, generator=g)
    w = torch.randn(O, I, generator=g).bfloat16()
    return x, w, torch.randn(O, generator=g), torch.randn(T, O, generator=g)


def _reference(x, w, bias=None, residual=None) -> torch.Tensor:
    y = x.double() @ w.double().T
    if bias is not None:
        y += bias.double()
    if residual is not None:
        y += residual.double()
    return y


def _float32_tolerance(x, w) -> float:
    # float32 sums of I products: error grows like I * eps * sum|x w| at worst.
    return 4 * x.shape[1] * 2 ** -24 * (x.double().abs() @ w.double().abs().T).max().item() + 1e-6


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("I,O", [(64, 37), (203, 129)])   # odd O, I with a tail past 8 lanes
def test_bf16w_linear_equals_the_float64_product_to_float32_rounding(isa, T, I, O):
    x, w, bias, residual = _case(T, I, O)
    tol = _float32_tolerance(x, w)
    for b, r in ((None, None), (bias, None), (None, residual), (bias, residual)):
        y = torch.ops.kvflow.bf16w_linear(x, w, b, r)
        assert y.dtype == torch.float32 and y.shape == (T, O)
        assert (y.double() - _reference(x, w, b, r)).abs().max().item() < tol


@pytest.mark.parametrize("T", [1, 5, 17, 64])
def test_bf16w_linear_with_bf16_activations_rounds_once(isa, T):
    x, w, bias, residual = _case(T, 96, 41, seed=1)
    x, residual = x.bfloat16(), residual.bfloat16()
    y = torch.ops.kvflow.bf16w_linear(x, w, bias.bfloat16(), residual)
    assert y.dtype == torch.bfloat16
    exact = _reference(x, w, bias.bfloat16(), residual)
    # One rounding of a float32 sum: within half a bf16 ulp (2^-9 relative) plus the sum's error.
    err = (y.double() - exact).abs() - exact.abs() * 2 ** -8
    assert err.max().item() < _float32_tolerance(x, w)


def test_bf16w_linear_rejects_a_float32_weight():
    x, w, _, _ = _case(2, 16, 8)
    with pytest.raises(RuntimeError, match="weight must be bfloat16"):
        torch.ops.kvflow.bf16w_linear(x, w.float())


def test_the_isa_switch_accepts_only_known_names():
    with pytest.raises(RuntimeError, match="expected auto, scalar or avx2"):
        cpu_ops.set_bf16w_isa("avx512")
    assert cpu_ops.set_bf16w_isa("auto") == ("avx2" if HAS_AVX2 else "scalar")


def test_the_isa_env_switch_is_applied_when_the_kernels_load(monkeypatch):
    monkeypatch.setenv("KVFLOW_CPU_BF16W_ISA", "scalar")
    monkeypatch.delitem(cpu_ops._state, "ok")      # load again (the library itself is cached)
    try:
        assert cpu_ops.available() and cpu_ops._state["bf16w_isa"] == "scalar"
    finally:
        cpu_ops.set_bf16w_isa("auto")


# ---- the model ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_bf16_llama(tmp_path_factory) -> str:
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny_bf16_llama"),
                                dtype="bfloat16")


@pytest.fixture(scope="module")
def tiny_bf16_qwen2(tmp_path_factory) -> str:       # tied head, biases
    return make_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("tiny_bf16_qwen2"),
                                dtype="bfloat16")


def _weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _greedy(llm: LLM, prompts, n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("ckpt", ["tiny_bf16_llama", "tiny_bf16_qwen2"])
def test_auto_dtype_keeps_a_bf16_checkpoint_bf16_and_matches_hf_float32(ckpt, request,
                                                                          monkeypatch):
    path = request.getfixturevalue(ckpt)
    monkeypatch.setenv("KVFLOW_CPU_BF16_PACK", "0")     # the non-packing path on any CPU
    llm = LLM(path, dtype="auto")
    assert llm.llm_engine.dtype == torch.float32        # activations: the checkpoint's float math
    model = llm.llm_engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    head = model.lm_linear
    assert all(m.weight.dtype == torch.bfloat16 and m.__dict__.get("bf16w") for m in linears)
    assert head.weight.dtype == torch.bfloat16 and head.__dict__.get("bf16w")
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    if model.lm_head is None:       # a tied head reads the embedding itself, no copy
        assert head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    # No float32 copy of any matrix: only the norms' and biases' vectors are float32.
    assert all(p.dim() == 1 for p in model.parameters() if p.dtype == torch.float32)

    prompts = [[5, 17, 42, 99, 7, 250, 31], [300, 12], list(range(40, 73))]
    assert _greedy(llm, prompts, 10) == hf_greedy(path, prompts, 10)

    f32 = LLM(path, dtype="float32").llm_engine.runner.model
    ratio = _weight_bytes(model) / _weight_bytes(f32)
    assert 0.49 < ratio < 0.55, ratio


def test_the_old_float32_copies_come_back_with_the_switch(tiny_bf16_llama, monkeypatch):
    monkeypatch.setenv("KVFLOW_CPU_BF16_PACK", "0")
    monkeypatch.setenv("KVFLOW_CPU_BF16W", "0")
    model = LLM(tiny_bf16_llama, dtype="auto").llm_engine.runner.model
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_explicit_bfloat16_keeps_bf16_activations_and_weights(tiny_bf16_qwen2, monkeypatch):
    monkeypatch.setenv("KVFLOW_CPU_BF16_PACK", "0")
    llm = LLM(tiny_bf16_qwen2, dtype="bfloat16")
    assert llm.llm_engine.dtype == torch.bfloat16
    model = llm.llm_engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)] + [model.lm_linear]
    assert all(m.weight.dtype == torch.bfloat16 and m.__dict__.get("bf16w") for m in linears)
    assert _greedy(llm, [[5, 17, 42]], 4)[0].__len__() == 4
