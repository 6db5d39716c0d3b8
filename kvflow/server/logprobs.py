"""Logprobs in the OpenAI wire formats: the completions API's parallel lists (with echo, the
prompt's tokens first, the first one without a logprob) and the chat API's per-token objects."""
from __future__ import annotations

from kvflow.engine.outputs import Logprob, PromptLogprobs, SampleLogprobs


def completion_logprobs(entries: PromptLogprobs | SampleLogprobs, token_ids: list[int],
                        tokenizer, text_offset: int = 0) -> dict:
    """{"tokens", "token_logprobs", "top_logprobs", "text_offset"} of token_ids, entries[i]
    being token i's dict (the chosen token, then its top alternatives) or None (no logprob:
    the prompt's first token)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for t, d in zip(token_ids, entries):
        text = tokenizer.decode_token(t)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if d is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(_finite(d[t].logprob))
        tops.append({lp.decoded_token: _finite(lp.logprob) for lp in d.values()})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(entries: SampleLogprobs, token_ids: list[int], top: int) -> dict:
    """{"content": [{"token", "logprob", "bytes", "top_logprobs": [the `top` most likely]}]}."""
    content = []
    for t, d in zip(token_ids, entries):
        alts = sorted((lp for lp in d.values() if lp.rank is not None and lp.rank <= top),
                      key=lambda lp: lp.rank)
        content.append({**_chat_token(d[t]), "top_logprobs": [_chat_token(a) for a in alts]})
    return {"content": content}


def prompt_logprobs_json(entries: PromptLogprobs) -> list[dict | None]:
    """vLLM's prompt_logprobs extra: per prompt token, {token id: {logprob, rank,
    decoded_token}} (None for the first)."""
    return [None if d is None else
            {str(t): {"logprob": _finite(lp.logprob), "rank": lp.rank,
                      "decoded_token": lp.decoded_token} for t, lp in d.items()}
            for d in entries]


def _chat_token(lp: Logprob) -> dict:
    text = lp.decoded_token or ""
    return {"token": text, "logprob": _finite(lp.logprob),
            "bytes": list(text.encode("utf-8", "surrogatepass"))}


def _finite(x: float) -> float:
    """JSON has no -Infinity: a token the model can never produce gets -9999.0 (vLLM's)."""
    return x if x > -9999.0 else -9999.0
