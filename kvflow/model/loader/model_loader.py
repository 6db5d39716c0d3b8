"""Find, read and instantiate a checkpoint: an HF directory (config.json + *.safetensors) or a
GGUF file (dequantised at load). With no path, the embedded SmolLM2-135M-Instruct GGUF."""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from kvflow.model.loader.checkpoint import (Checkpoint, default_model_path,  # noqa: F401
                                     open_checkpoint)
from kvflow.model.config import ModelConfig

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


def bf16_is_fast() -> bool:
    # bf16 matmuls are fast only where oneDNN packs bf16 weights (AVX512-BF16 / AMX class CPUs);
    # elsewhere torch emulates them, slower than float32. KVFLOW_CPU_BF16_PACK=0 says no here too.
    from kvflow.model.models.layers import bf16_pack_supported
    return bf16_pack_supported()


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: str, device: str = "cpu"):
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
        return _DTYPES[dtype]
    want = _DTYPES.get(checkpoint_dtype, torch.float32)
    if device != "cpu":     # GPUs: half precision, bf16 unless the checkpoint is float16
        return torch.float16 if want == torch.float16 else torch.bfloat16
    if want in (torch.bfloat16, torch.float16):
        return torch.bfloat16 if bf16_is_fast() else torch.float32
    return want


def keeps_bf16_weights(dtype, checkpoint_dtype: str, resolved: torch.dtype, device: str) -> bool:
    """dtype="auto" on a CPU where bf16 is slow resolves a bf16 checkpoint to float32 compute; its
    weights still stay bf16 (bf16w_linear widens them exactly), as fast and half the memory."""
    from kvflow.model.models.layers import bf16w_available
    return (dtype == "auto" and device == "cpu" and checkpoint_dtype == "bfloat16"
            and resolved == torch.float32 and bf16w_available())


def _prepare_linears(model: nn.Module, dtype: torch.dtype, device: str) -> None:
    """Pack, keep or widen the bf16 Linear weights (layers.prepare_linears), the LM head's too. A
    tied head is the embedding, which the lookup still needs as it is: the head gets its own
    Linear over it (the same tensor unless packed or widened), which compute_logits uses."""
    from kvflow.model.models.layers import prepare_linears
    from kvflow.model.quantization.quant_weights import set_quant
    linears = [m for m in model.modules()
               if isinstance(m, nn.Linear) and "quant" not in m.__dict__]
    head = model.lm_head
    if head is None:
        head = nn.Linear(model.cfg.hidden_size, model.cfg.vocab_size, bias=False, device="meta")
        head.weight = nn.Parameter(model.embed_tokens.weight.detach(), requires_grad=False)
        quant = model.embed_tokens.__dict__.get("quant")
        if quant is not None:       # the tied head reads the embedding's blocks
            set_quant(head, quant)
        else:
            linears.append(head)
    if prepare_linears(linears, dtype, device) or "quant" in head.__dict__:
        model.__dict__["lm_linear"] = head


def _weights(ckpt: Checkpoint, quantization: str | None, device: str, dtype: torch.dtype,
             tensor_parallel: bool = False):
    """The checkpoint's weights as the model will hold them: a GGUF's blocks as stored where
    the kernels run them, an HF checkpoint's quantized at load when asked. Under tensor
    parallelism they are dequantized to float (a rank's slice of a block-quantized row would
    cut its blocks; the simplest correct choice, at 4-8x the weights' memory per element)."""
    from kvflow.model.quantization.quant_weights import keep_quantized, quantize_weights
    keep = keep_quantized(device, dtype) and not tensor_parallel
    if quantization is not None:
        if ckpt.quantized_weights is not None:
            raise ValueError(f"quantization={quantization!r} is for HF checkpoints; a GGUF file "
                             "runs the quantized blocks it stores")
        return quantize_weights(ckpt.weights(), quantization, keep)
    if ckpt.quantized_weights is not None and keep:
        return ckpt.quantized_weights()
    return ckpt.weights()


@contextlib.contextmanager
def _no_init():
    """Skip the random init of layers whose weights the checkpoint overwrites anyway. (Building on
    the meta device instead costs ~1.5 s of imports on the first init call.)"""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def build_model(ckpt: Checkpoint, dtype: str | torch.dtype = "auto", max_model_len: int | None = None,
                device: str = "cpu", quantization: str | None = None, tp=None
                ) -> tuple[ModelConfig, nn.Module, torch.dtype]:
    """(the model's whole config, the model, its dtype). With tp (a parallel.TPGroup) the model
    is this rank's shard (model.cfg its shape)."""
    from kvflow.model.models.layers import keep_bf16_weights, use_cpu_kernels
    from kvflow.model.models.llama import LlamaForCausalLM, fused_decode_args
    from kvflow.model.models.qwen2 import Qwen2ForCausalLM
    from kvflow.model.models.qwen3 import Qwen3ForCausalLM
    classes = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM}
    cfg = ModelConfig.from_hf(ckpt.config)
    if tp is not None:
        from kvflow.model.distributed.parallel import check_tp_size
        check_tp_size(cfg, tp.world_size)
    dt = resolve_dtype(dtype, cfg.torch_dtype, device)
    max_len = max_model_len or cfg.max_position_embeddings
    with _no_init():
        model = classes[cfg.architecture](cfg, max_len, tp).to(dtype=dt, device=device)
    if quantization is None and keeps_bf16_weights(dtype, cfg.torch_dtype, dt, device):
        keep_bf16_weights(model)
    with torch.inference_mode():
        model.load_weights(_weights(ckpt, quantization, device, dt, tp is not None))
    model.rotary.build(dt, device)
    model.eval().requires_grad_(False)
    use_cpu_kernels(model, dt, device)
    _prepare_linears(model, dt, device)
    if device == "cpu":
        model.__dict__["fused_decode"] = fused_decode_args(model)
        pin_attributes(model)
    return cfg, model, dt


def pin_attributes(model: nn.Module) -> None:
    """Put each module's submodules and parameters in its __dict__ too, so that reading them
    skips nn.Module.__getattr__: ~20 such reads a layer cost ~8% of a CPU decode step of the
    default model (measured). Assigning a module or Parameter later still works (nn.Module's
    __setattr__ drops the pinned copy); only in-place swaps of _parameters (model.to() with
    new tensors) would leave it stale, so this runs last, on the finished CPU model."""
    for m in model.modules():
        m.__dict__.update(m._modules)
        m.__dict__.update(m._parameters)
