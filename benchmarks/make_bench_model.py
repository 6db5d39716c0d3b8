"""Build the benchmark model: a randomly initialised 62.9M-parameter Llama as an HF checkpoint.

The model of the issue's throughput goal: hidden 768, 8 layers, 12 query / 4 KV heads (head_dim
64), FFN 2048, vocab 8192, untied embeddings (tied would be 56.6M), bf16 safetensors. Weights are
random (transformers' own init, std 0.02, seeded), so the text it writes is noise; throughput does
not care. Written next to it, so that kvflow, HF transformers and vLLM all load the directory
without a hub:

  config.json, generation_config.json, model.safetensors (bf16)
  tokenizer.json         a `tokenizers` WordLevel tokenizer with exactly 8192 tokens:
                         <unk>=0, <s>=1 (bos), </s>=2 (eos), then w3 .. w8191; whitespace split
  tokenizer_config.json  tokenizer_class PreTrainedTokenizerFast, bos/eos/unk/pad tokens
  special_tokens_map.json

    .venv/bin/python benchmarks/make_bench_model.py [--out DIR] [--force] [--seed 0]

Default DIR: /tmp/kvflow-bench/llama-62m. An existing complete directory is reused unless --force.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

DEFAULT_OUT = "/tmp/kvflow-bench/llama-62m"
VOCAB = 8192
MAX_POS = 4096
SPECIAL = ["<unk>", "<s>", "</s>"]
UNK, BOS, EOS = 0, 1, 2
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json")

CONFIG = dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4,
              intermediate_size=2048, vocab_size=VOCAB, max_position_embeddings=MAX_POS,
              rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu",
              tie_word_embeddings=False, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=UNK,
              initializer_range=0.02, attention_bias=False, mlp_bias=False)


def is_complete(out: str) -> bool:
    return all(os.path.isfile(os.path.join(out, f)) for f in REQUIRED)


def write_tokenizer(out: str, size: int = VOCAB, max_len: int = MAX_POS) -> None:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    vocab = {t: i for i, t in enumerate(SPECIAL)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL), size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    assert tok.get_vocab_size(with_added_tokens=True) == size
    tok.save(os.path.join(out, "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<unk>"}
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
                   "add_bos_token": False, "add_eos_token": False,
                   "clean_up_tokenization_spaces": False, **special}, f, indent=2)
    with open(os.path.join(out, "special_tokens_map.json"), "w") as f:
        json.dump(special, f, indent=2)


def build(out: str, seed: int) -> int:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**CONFIG)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    n = sum(p.numel() for p in model.parameters())
    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=UNK,
                     do_sample=False).save_pretrained(tmp)
    write_tokenizer(tmp)
    # Be explicit about the dtype whatever transformers version wrote config.json.
    p = os.path.join(tmp, "config.json")
    with open(p) as f:
        c = json.load(f)
    c["torch_dtype"] = "bfloat16"
    c["architectures"] = ["LlamaForCausalLM"]
    with open(p, "w") as f:
        json.dump(c, f, indent=2)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return n


def count_params(out: str) -> int:
    from safetensors import safe_open
    n = 0
    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as st:
        for k in st.keys():
            n += _prod(st.get_slice(k).get_shape())
    return n


def _prod(shape) -> int:
    r = 1
    for s in shape:
        r *= s
    return r


def ensure_model(out: str = DEFAULT_OUT, force: bool = False, seed: int = 0,
                 quiet: bool = False) -> str:
    """Return `out`, building the checkpoint there first if missing (or if force)."""
    if force or not is_complete(out):
        n = build(out, seed)
        if not quiet:
            print(f"wrote {out}: {n / 1e6:.2f}M parameters (bf16, seed {seed})", file=sys.stderr)
    elif not quiet:
        print(f"reusing {out} ({count_params(out) / 1e6:.2f}M parameters)", file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--force", action="store_true", help="rebuild even if the directory exists")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    ensure_model(a.out, a.force, a.seed)
    print(a.out)


if __name__ == "__main__":
    main()
