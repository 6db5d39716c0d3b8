"""Find and open a checkpoint without loading its weights: an HF directory (config.json +
*.safetensors) or a GGUF file. With no path, the embedded SmolLM2-135M-Instruct GGUF.

Torch-free (the weights are read lazily, by the engine core), so that a frontend process reads
the config and the tokenizer without importing torch."""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class Checkpoint:
    path: str
    config: dict                       # HF config.json dict
    weights: object                    # callable -> iterator of (HF name, tensor)
    tokenizer_json: object = None      # tokenizers.Tokenizer, or None to read tokenizer.json
    chat_template: str | None = None
    special: dict = field(default_factory=dict)     # bos/eos tokens and ids, add_bos
    # callable -> (HF name, tensor or QuantTensor): weights kvflow can run quantized stay so
    quantized_weights: object = None


def default_model_path() -> str:
    from kvflow.model.loader.gguf_loader import default_model_path as p
    return p()


def open_checkpoint(path: str | os.PathLike | None) -> Checkpoint:
    path = default_model_path() if path is None else os.fspath(path)
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        from kvflow.model.loader.gguf_loader import load_gguf
        g = load_gguf(p)
        # Dequantised GGUF weights (fp16 scale x small int + offset) are exact in float32 and
        # would be rounded again in bf16; so "auto" means float32 here.
        cfg = dict(g.config, torch_dtype="float32")
        special = {"bos_token_id": g.bos_token_id, "eos_token_id": g.eos_token_id,
                   "add_bos_token": g.add_bos_token}
        return Checkpoint(str(p), cfg, g.tensors, g.tokenizer, g.chat_template, special,
                          g.quantized_tensors)
    if not p.is_dir():
        raise FileNotFoundError(f"model path {path!r} is neither a directory with config.json "
                                f"nor a .gguf file (kvflow never downloads from a hub)")
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{path!r} has no config.json")
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path!r} has no *.safetensors weights")
    cfg = json.loads((p / "config.json").read_text())
    return Checkpoint(str(p), cfg, lambda: _safetensors_weights(files))


def _safetensors_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)
