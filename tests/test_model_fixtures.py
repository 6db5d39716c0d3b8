"""Sanity checks for the on-the-fly tiny checkpoints in model_fixtures.py."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from model_fixtures import (CHAT_TEMPLATE, EOS_TOKEN_ID, SPECIAL_TOKENS, VOCAB_SIZE, hf_greedy,
                            hf_logits, top2_gaps)

ARCHS = ["tiny_llama", "tiny_qwen2", "tiny_qwen3"]
EXPECTED = {  # arch fixture -> (model_type, rope_theta, tie_word_embeddings)
    "tiny_llama": ("llama", 10000.0, False),
    "tiny_qwen2": ("qwen2", 1e6, True),
    "tiny_qwen3": ("qwen3", 1e6, True),
}


def _prompts(n=6, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randrange(1, 30))] for _ in range(n)]


def test_tokenizer_round_trip_and_specials(tiny_tokenizer_dir):
    tok = Tokenizer.from_file(str(Path(tiny_tokenizer_dir) / "tokenizer.json"))
    assert tok.get_vocab_size() == VOCAB_SIZE
    text = "The cat reads a long book today. Number 7 plus 8 is 15! Zebra xylophone \u00e9\U0001f600"
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges actually compress
    for i, special in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(special) == i
        assert tok.encode(special).ids == [i]
    chat = "<|im_start|>user\nHi<|im_end|>\n"
    assert tok.encode(chat).ids[0] == 1 and 2 in tok.encode(chat).ids
    assert tok.decode(tok.encode(chat).ids, skip_special_tokens=False) == chat
    cfg = json.loads((Path(tiny_tokenizer_dir) / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == CHAT_TEMPLATE
    assert cfg["eos_token"] == "<|im_end|>" and cfg["bos_token"] is None


@pytest.mark.parametrize("fixture", ARCHS)
def test_checkpoint_files_and_config(fixture, request):
    from transformers import AutoModelForCausalLM

    d = Path(request.getfixturevalue(fixture))
    for f in ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
              "tokenizer_config.json"]:
        assert (d / f).is_file(), f
    cfg = json.loads((d / "config.json").read_text())
    model_type, theta, tied = EXPECTED[fixture]
    assert cfg["model_type"] == model_type
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (64, 128, 2)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 16)
    assert cfg["vocab_size"] == VOCAB_SIZE and cfg["max_position_embeddings"] == 512
    assert cfg["rope_theta"] == theta and cfg["rope_scaling"] is None
    assert cfg["tie_word_embeddings"] is tied
    assert cfg["bos_token_id"] is None and cfg["eos_token_id"] == EOS_TOKEN_ID
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["eos_token_id"] == EOS_TOKEN_ID
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    assert model.config.model_type == model_type
    assert sum(p.numel() for p in model.parameters()) < 200_000


def test_llama3_rope_scaling_config(tiny_llama, tiny_llama3_rope):
    from transformers import AutoConfig

    cfg = json.loads((Path(tiny_llama3_rope) / "config.json").read_text())
    assert cfg["rope_theta"] == 10000.0
    assert cfg["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 128}
    rp = AutoConfig.from_pretrained(tiny_llama3_rope).rope_parameters
    assert rp["rope_type"] == "llama3" and rp["rope_theta"] == 10000.0 and rp["factor"] == 8.0
    # Same seed, same weights: only the RoPE scaling differs, and it must show in the logits.
    prompt = _prompts(1, seed=3)[0] + list(range(3, 40))
    assert not torch.allclose(hf_logits(tiny_llama, prompt), hf_logits(tiny_llama3_rope, prompt))


@pytest.mark.parametrize("fixture", ARCHS)
def test_hf_greedy_length_determinism_diversity(fixture, request):
    d = request.getfixturevalue(fixture)
    prompts = _prompts()
    out = hf_greedy(d, prompts, 16)
    assert [len(o) for o in out] == [16] * len(prompts)
    assert hf_greedy(d, prompts, 16) == out
    for full, cut in zip(out, hf_greedy(d, prompts, 16, stop_at_eos=True)):
        n = full.index(EOS_TOKEN_ID) + 1 if EOS_TOKEN_ID in full else len(full)
        assert cut == full[:n]
    assert all(0 <= t < VOCAB_SIZE for o in out for t in o)
    assert all(len(set(o)) > 4 for o in out), out  # not stuck on one token
    assert len({tuple(o) for o in out}) == len(prompts)  # output depends on the prompt
    # greedy == argmax of a full forward pass, token by token (EOS included, not suppressed)
    seq = prompts[0] + out[0]
    logits = hf_logits(d, seq)
    assert logits.shape == (len(seq), VOCAB_SIZE)
    assert logits[len(prompts[0]) - 1:-1].argmax(-1).tolist() == out[0]


@pytest.mark.parametrize("fixture", ARCHS)
def test_logits_are_peaky(fixture, request):
    d = request.getfixturevalue(fixture)
    gaps = torch.cat([top2_gaps(hf_logits(d, p)) for p in _prompts(8, seed=1)])
    assert (gaps > 1e-3).float().mean() >= 0.98, gaps.min()
    assert gaps.median() > 0.1
