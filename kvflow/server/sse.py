"""Server-sent events for streamed answers: the chunks of one answer (ChunkMaker), the stream a
route returns (SSEStream) and the merge of several engine streams (n, several prompts)."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from kvflow.engine.async_llm import RequestStream
from kvflow.engine.outputs import CompletionOutput, RequestOutput
from kvflow.sampling_params import SamplingParams
from kvflow.server.logprobs import chat_logprobs, completion_logprobs


class SSEStream:
    """A streamed answer: the SSE text chunks, and the requests to abort if nobody reads them."""

    def __init__(self, body: AsyncIterator[str], streams: list[RequestStream]) -> None:
        self.body, self.streams = body, streams

    def close(self) -> None:
        for s in self.streams:
            s.close()


class ChunkMaker:
    """The SSE chunks of one streamed answer."""

    def __init__(self, meta: dict, obj: str, chat: bool, extra: dict, sp: SamplingParams,
                 tokenizer) -> None:
        self.meta, self.obj, self.chat, self.extra = meta, obj, chat, extra
        self.sp, self.tokenizer = sp, tokenizer
        self.holdback = max((len(s) for s in sp.stop), default=1) - 1
        self.sent: dict[int, int] = {}          # characters sent, per choice
        self.sent_toks: dict[int, int] = {}     # tokens whose logprobs are sent, per choice
        self.done: set[int] = set()             # choices whose last chunk is sent

    def delta(self, k: int, c: CompletionOutput) -> str | None:
        """Choice k's chunk with what `c` adds since the last one, or None if nothing."""
        if k in self.done:
            return None
        sent, fin = self.sent.get(k, 0), c.finished()
        end = len(c.text) if fin else max(len(c.text) - self.holdback, sent)
        text = c.text[sent:end]
        self.sent[k] = end
        if not fin and not text:
            return None
        lps = c.logprobs[self.sent_toks.get(k, 0):] if c.logprobs is not None else None
        self.sent_toks[k] = len(c.token_ids)
        toks = c.token_ids[len(c.token_ids) - len(lps):] if lps is not None else []
        if not fin:
            return self(k, text, lps, toks)
        self.done.add(k)
        return self(k, text if text or not self.chat else None, lps, toks, c.finish_reason,
                    c.stop_reason)

    def __call__(self, i: int, text: str | None, lps, toks: list[int],
                 finish: str | None = None, stop_reason=None) -> str:
        if self.chat:
            delta = {} if text is None else {"content": text}
            lp = (chat_logprobs(lps, toks, self.sp.logprobs or 0) if lps is not None else None)
            c = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            lp = completion_logprobs(lps, toks, self.tokenizer) if lps is not None else None
            c = {"index": i, "text": text or "", "logprobs": lp, "finish_reason": finish}
        if finish is not None:
            c["stop_reason"] = stop_reason
        return sse({**self.meta, "object": self.obj, "choices": [c], **self.extra})

    def role(self, i: int) -> str:
        return sse({**self.meta, "object": self.obj, "choices": [
            {"index": i, "delta": {"role": "assistant", "content": ""},
             "logprobs": None, "finish_reason": None}], **self.extra})

    def echo(self, i: int, out: RequestOutput, prompt: str) -> str:
        """The prompt, first (completions with echo), with its logprobs if asked for."""
        lps = None
        if self.sp.logprobs is not None and out.prompt_logprobs is not None:
            lps = completion_logprobs(out.prompt_logprobs, out.prompt_token_ids,
                                      self.tokenizer)
        c = {"index": i, "text": prompt, "logprobs": lps, "finish_reason": None}
        return sse({**self.meta, "object": self.obj, "choices": [c], **self.extra})


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index, output) from several streams as they come; one stream needs no tasks."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                q.put_nowait((i, out))
        except asyncio.CancelledError:
            raise
        except BaseException as e:      # handed to the consumer, which raises it
            q.put_nowait((i, e))
            return
        q.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await q.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
