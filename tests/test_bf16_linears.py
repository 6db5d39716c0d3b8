"""How a bf16 CPU model runs its nn.Linear layers (kvflow/model/models/layers.py, prepare_linears).

Where oneDNN can take bf16 weights (AVX512BW/VL/DQ or AVX-NE-CONVERT), each weight is packed once
and the plain copy dropped; elsewhere (e.g. AVX2-only CPUs, where packing raises) the weights are
kept bf16 for kvflow's bf16w_linear kernel (tests/test_bf16_weights.py), or, without the kernels or
with KVFLOW_CPU_BF16W=0, held in float32 and each matmul rounds once to bf16.
KVFLOW_CPU_BF16_PACK=0 forces the fallback, so every path runs on any CPU.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvflow import LLM, SamplingParams
from kvflow.model.models import layers

CAN_PACK = layers._cpu_can_pack_bf16()
NO_PACK_REASON = ("this CPU cannot pack bf16 weights for oneDNN (needs AVX512BW+VL+DQ or "
                  "AVX-NE-CONVERT)")


def _generate_4(llm: LLM) -> None:
    out = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def _linears(llm: LLM) -> list[torch.nn.Linear]:
    model = llm.llm_engine.runner.model
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)] + [model.lm_linear]


def _assert_fallback(llm: LLM) -> None:
    """Not packed: bf16 weights for kvflow's bf16w_linear where its kernels are built (and
    KVFLOW_CPU_BF16W is not 0), float32 copies otherwise."""
    linears = _linears(llm)
    assert linears and all("packed" not in m.__dict__ for m in linears)
    want = torch.bfloat16 if layers.bf16w_available() else torch.float32
    assert all(m.weight.dtype == want and m.weight.numel() > 0 for m in linears)
    assert all(m.__dict__.get("bf16w", False) == (want == torch.bfloat16) for m in linears)


def test_the_packing_check_agrees_with_what_onednn_accepts(monkeypatch):
    monkeypatch.delenv("KVFLOW_CPU_BF16_PACK", raising=False)
    assert layers.bf16_pack_supported() == CAN_PACK
    # torch's own CPU test; the trial reorder must not turn it down where it says yes.
    assert CAN_PACK == (torch.backends.mkldnn.is_available()
                        and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    w = torch.randn(32, 16).bfloat16()
    if CAN_PACK:
        torch.ops.mkldnn._reorder_linear_weight(w, 4)
    else:   # the failure the check exists to avoid
        with pytest.raises(RuntimeError):
            torch.ops.mkldnn._reorder_linear_weight(w, 4)
    monkeypatch.setenv("KVFLOW_CPU_BF16_PACK", "0")
    assert not layers.bf16_pack_supported()


def test_bf16_linears_are_packed_once_and_the_plain_copies_dropped(tiny_llama, monkeypatch):
    monkeypatch.delenv("KVFLOW_CPU_BF16_PACK", raising=False)
    llm = LLM(tiny_llama, dtype="bfloat16")
    _generate_4(llm)
    if not CAN_PACK:
        _assert_fallback(llm)       # no crash, the fallback chosen; the packing itself is untested
        pytest.skip(NO_PACK_REASON + "; checked that the float32 fallback was chosen instead")
    linears = _linears(llm)
    assert linears and all("packed" in m.__dict__ and m.weight.numel() == 0 for m in linears)


@pytest.mark.parametrize("bf16w", ["1", "0"])       # bf16 weights kept (if built); float32 copies
@pytest.mark.parametrize("ckpt", ["tiny_llama", "tiny_qwen2"])     # untied head; tied, with biases
def test_bf16_linears_fall_back_when_the_cpu_cannot_pack(ckpt, bf16w, request, monkeypatch):
    monkeypatch.setenv("KVFLOW_CPU_BF16_PACK", "0")
    monkeypatch.setenv("KVFLOW_CPU_BF16W", bf16w)
    llm = LLM(request.getfixturevalue(ckpt), dtype="bfloat16")
    _assert_fallback(llm)
    model = llm.llm_engine.runner.model
    # Only the linears widen: the embedding (a tied head's source too) stays bf16.
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    _generate_4(llm)


def test_float32_models_keep_their_linears_as_loaded(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32")
    model = llm.llm_engine.runner.model
    assert "lm_linear" not in model.__dict__
    assert all("packed" not in m.__dict__ for m in model.modules())


def _bf16_linear(bias: bool) -> tuple[torch.nn.Linear, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    m = torch.nn.Linear(48, 40, bias=bias).bfloat16().requires_grad_(False)
    m.weight.copy_(torch.randn(40, 48, generator=g))
    if bias:
        m.bias.copy_(torch.randn(40, generator=g))
    x = torch.randn(7, 48, generator=g).bfloat16()
    residual = torch.randn(7, 40, generator=g).bfloat16()
    return m, x, residual


@pytest.mark.parametrize("bias", [False, True])
def test_the_fallback_sums_in_float32_and_rounds_once(bias):
    m, x, residual = _bf16_linear(bias)
    w, b = m.weight.float(), (m.bias.float() if bias else None)
    layers.upcast_linear(m)
    assert torch.equal(layers.linear(x, m), F.linear(x.float(), w, b).bfloat16())
    assert torch.equal(layers.linear(x, m, residual),
                       (F.linear(x.float(), w, b) + residual.float()).bfloat16())


@pytest.mark.parametrize("bias", [False, True])
def test_the_fallback_agrees_with_the_packed_path(bias):
    if not CAN_PACK:
        pytest.skip(NO_PACK_REASON)
    m, x, residual = _bf16_linear(bias)
    packed, _, _ = _bf16_linear(bias)
    layers.upcast_linear(m)
    layers.pack_linear(packed)
    for r in (None, residual):
        a, b = layers.linear(x, m, r).float(), layers.linear(x, packed, r).float()
        # Same products and float32 sums, in another order: one bf16 ulp apart at most.
        torch.testing.assert_close(a, b, rtol=2 ** -8, atol=1e-2)
