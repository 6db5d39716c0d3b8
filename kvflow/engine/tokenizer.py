"""Tokenizer: the `tokenizers` library on tokenizer.json (or one built from GGUF metadata), the
chat template rendered with jinja2 the way HF renders it, and the special tokens."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from kvflow.model.loader.checkpoint import Checkpoint


def _token_str(t) -> str | None:
    return t.get("content") if isinstance(t, dict) else t


def _raise(msg: str):
    raise jinja2.exceptions.TemplateError(msg)


class Tokenizer:
    def __init__(self, tok: HFTokenizer, chat_template: str | None = None, *,
                 bos_token_id: int | None = None, eos_token_id: int | None = None,
                 add_bos_token: bool = False) -> None:
        self.tok = tok
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos_token = add_bos_token
        self.bos_token = tok.id_to_token(bos_token_id) if bos_token_id is not None else None
        self.eos_token = tok.id_to_token(eos_token_id) if eos_token_id is not None else None
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self._template = None
        self._token_text: dict[int, str] = {}

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint) -> "Tokenizer":
        if ckpt.tokenizer_json is not None:       # GGUF
            s = ckpt.special
            return cls(ckpt.tokenizer_json, ckpt.chat_template, bos_token_id=s["bos_token_id"],
                       eos_token_id=s["eos_token_id"], add_bos_token=s["add_bos_token"])
        d = Path(ckpt.path)
        if not (d / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{ckpt.path!r} has no tokenizer.json")
        tok = HFTokenizer.from_file(str(d / "tokenizer.json"))
        tc = _read_json(d / "tokenizer_config.json")
        template = tc.get("chat_template")
        if isinstance(template, list):      # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"),
                            template[0]["template"] if template else None)
        if template is None and (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()
        bos, eos = _token_str(tc.get("bos_token")), _token_str(tc.get("eos_token"))
        bos_id = tok.token_to_id(bos) if bos else ckpt.config.get("bos_token_id")
        eos_id = tok.token_to_id(eos) if eos else None
        if eos_id is None:
            e = _read_json(d / "generation_config.json").get("eos_token_id",
                                                             ckpt.config.get("eos_token_id"))
            eos_id = e[0] if isinstance(e, list) and e else (e if isinstance(e, int) else None)
        # tokenizer.json's post-processor adds BOS itself where the model wants it.
        return cls(tok, template, bos_token_id=bos_id, eos_token_id=eos_id, add_bos_token=False)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"prompt must be a str, got {type(text).__name__}")
        ids = self.tok.encode(text, add_special_tokens=add_special_tokens).ids
        if (add_special_tokens and self.add_bos_token and self.bos_token_id is not None
                and (not ids or ids[0] != self.bos_token_id)):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_token(self, token_id: int) -> str:
        """One token's text, special tokens included (logprobs name their tokens by it)."""
        cache = self._token_text
        text = cache.get(token_id)
        if text is None:
            text = cache[token_id] = self.tok.decode([token_id], skip_special_tokens=False)
        return text

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        if self.chat_template is None:
            raise ValueError("this model has no chat template; use generate() with a prompt")
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                     **kwargs)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        # The template already writes any BOS it wants, so no special tokens are added again.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt),
                           add_special_tokens=False)


def _read_json(p: Path) -> dict:
    return json.loads(p.read_text()) if p.is_file() else {}
