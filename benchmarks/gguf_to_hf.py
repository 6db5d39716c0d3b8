"""Write a GGUF checkpoint (default: the embedded SmolLM2-135M-Instruct) as an HF directory, so
that servers which cannot read it offline (vLLM needs the `gguf` package and an HF tokenizer for
GGUF) serve exactly the weights kvflow serves: kvflow's own GGUF reader dequantizes them, and the
tokenizer.json is the one kvflow builds from the GGUF metadata.

    python benchmarks/gguf_to_hf.py OUT_DIR [--gguf PATH] [--dtype bfloat16|float32]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvflow.model.loader.gguf_loader import default_model_path, load_gguf


def convert(gguf_path: str, out: Path, dtype: str) -> None:
    g = load_gguf(gguf_path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.to(getattr(torch, dtype)).contiguous() for name, t in g.tensors()}
    if g.config["tie_word_embeddings"]:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = {k: v for k, v in g.config.items() if v is not None or k == "rope_scaling"}
    cfg.update(torch_dtype=dtype, hidden_act="silu", initializer_range=0.02, use_cache=True,
               attention_dropout=0.0, mlp_bias=False, pretraining_tp=1)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    g.tokenizer.save(str(out / "tokenizer.json"))
    tok = g.tokenizer
    name = lambda i: None if i is None else tok.id_to_token(i)  # noqa: E731
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": g.chat_template,
        "bos_token": name(g.bos_token_id), "eos_token": name(g.eos_token_id),
        "add_bos_token": g.add_bos_token, "add_eos_token": False,
        # Decoded text exactly as the tokens spell it (kvflow's detokenizer does no clean-up;
        # older transformers clean " ." to "." unless told not to).
        "clean_up_tokenization_spaces": False,
        "model_max_length": g.config["max_position_embeddings"]}, indent=2))
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": g.bos_token_id, "eos_token_id": g.eos_token_id}, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    a = ap.parse_args()
    convert(a.gguf or default_model_path(), Path(a.out), a.dtype)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
