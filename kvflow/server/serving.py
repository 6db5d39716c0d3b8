"""/v1/completions and /v1/chat/completions on top of AsyncLLM: OpenAI JSON in, JSON or SSE out.

Prompts are tokenized here (so usage counts and the context-length check are exact before the
engine sees the request) and handed to the engine as {"prompt", "prompt_token_ids"}. Streaming
holds back the last len(longest stop string) - 1 characters until the request finishes, because
the engine cuts the text when a stop string completes and streamed text cannot be taken back;
the concatenated stream therefore always equals the non-streamed text.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import jinja2

from kvflow.engine.async_llm import AsyncLLM, EngineDeadError, RequestStream
from kvflow.engine.outputs import CompletionOutput, RequestOutput
from kvflow.engine.parallel_sampling import check_n
from kvflow.sampling_params import SamplingParams, short_repr
from kvflow.server.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs_json
from kvflow.server.protocol import (UNSUPPORTED, ApiError, ChatCompletionRequest,
                                     CompletionRequest, usage)
from kvflow.server.sse import ChunkMaker, SSEStream, merge, sse
from kvflow.server.structured import check_structured_outputs, structured_outputs_of


# Completions (prompts x n) one request may ask for: a 1 MiB body of one-token prompts would
# otherwise queue ~100k requests at once.
MAX_CHOICES = 4096


_SP_FIELDS = ("temperature", "top_p", "top_k", "seed", "max_tokens", "min_tokens", "stop",
              "stop_token_ids", "ignore_eos", "n", "presence_penalty", "frequency_penalty",
              "repetition_penalty", "min_p", "logit_bias", "allowed_token_ids", "bad_words",
              "logprobs", "prompt_logprobs")
# Passed to SamplingParams as they are when set.
_PASSED = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "min_p", "logit_bias", "allowed_token_ids", "bad_words",
           "prompt_logprobs")


def _param_of(msg: str) -> str | None:
    word = msg.split(" ", 1)[0]
    return word if word in _SP_FIELDS else None


class OpenAIServing:
    def __init__(self, llm: AsyncLLM, model_names: list[str]) -> None:
        self.llm = llm
        self.model_names = model_names
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.scheduler_config.max_model_len
        self.vocab_size = llm.model_config.vocab_size

    # ---- checks shared by both endpoints ----------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise ApiError(404, f"The model `{model}` does not exist. Served: "
                                f"{', '.join(self.model_names)}", "model", code="model_not_found")

    def _check_unsupported(self, req) -> None:
        try:
            check_n(req.n, self.llm.scheduler_config.max_num_seqs)
        except ValueError as e:
            raise ApiError(400, str(e), "n") from None
        if req.best_of not in (None, 1):        # as vLLM V1, which dropped it
            raise ApiError(400, "best_of is not supported (as in vLLM V1); use n for several "
                                "samples", "best_of")
        if isinstance(req, ChatCompletionRequest):
            if req.echo:
                raise ApiError(400, "echo is not supported for chat completions", "echo")
            if req.top_logprobs and not req.logprobs:
                raise ApiError(400, "top_logprobs needs logprobs to be true", "top_logprobs")
        for name, neutral in UNSUPPORTED.items():
            v = getattr(req, name, None)
            if v is not None and not any(v == n and type(v) is type(n) for n in neutral):
                raise ApiError(400, f"{name} is not supported by kvflow yet", name)

    def _sampling_params(self, req, max_tokens: int | None, default_max: int | None,
                         prompt_lens: list[int], what: str) -> SamplingParams:
        longest = max(prompt_lens)
        if longest >= self.max_model_len:
            raise ApiError(400, f"This model's maximum context length is {self.max_model_len} "
                                f"tokens. However, your request has {longest} input tokens. "
                                f"Please reduce the length of the input.", what)
        if max_tokens is not None and isinstance(max_tokens, int) and max_tokens >= 1 and \
                longest + max_tokens > self.max_model_len:
            raise ApiError(400, f"This model's maximum context length is {self.max_model_len} "
                                f"tokens. However, you requested "
                                f"{short_repr(longest + max_tokens)} tokens ({longest} in the "
                                f"{what}, {short_repr(max_tokens)} in the completion). "
                                f"Please reduce the length of the {what} or completion.",
                           "max_tokens")
        if max_tokens is None:
            room = self.max_model_len - longest
            max_tokens = room if default_max is None else min(default_max, room)
        kw = dict(n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens, seed=req.seed,
                  stop=req.stop if req.stop is not None else [],
                  stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos,
                  logprobs=_num_logprobs(req), structured_outputs=structured_outputs_of(req))
        for name in _PASSED:
            if getattr(req, name) is not None:
                kw[name] = getattr(req, name)
        if getattr(req, "echo", False) and kw["logprobs"] is not None:   # the prompt's too
            kw["prompt_logprobs"] = max(kw.get("prompt_logprobs") or 0, kw["logprobs"])
        try:
            return SamplingParams(**kw)
        except ValueError as e:
            raise ApiError(400, str(e), _param_of(str(e))) from None

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            text = prompt
        else:
            ids, text = list(prompt), None
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ApiError(400, f"prompt token id {bad} is not in [0, {self.vocab_size})",
                               "prompt")
        if not ids:
            raise ApiError(400, "the prompt is empty", "prompt")
        return text, ids

    async def _add(self, rid: str, prompts: list[tuple[str | None, list[int]]],
                   sp: SamplingParams, priority: int) -> list[RequestStream]:
        items = [(f"{rid}-{i}", {"prompt_token_ids": ids, "prompt": text}, sp, priority)
                 for i, (text, ids) in enumerate(prompts)]
        try:
            return await self.llm.add_requests(items)      # one batch, admitted together
        except ValueError as e:
            raise ApiError(400, str(e), _param_of(str(e))) from None
        except EngineDeadError as e:
            raise ApiError(503, str(e), None, type="server_error") from None

    # ---- /v1/completions ------------------------------------------------------------------
    async def create_completion(self, req: CompletionRequest):
        self.check_model(req.model)
        self._check_unsupported(req)
        if req.suffix:
            raise ApiError(400, "suffix is not supported", "suffix")
        p = req.prompt
        if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
            raw_prompts = [p]
        else:
            raw_prompts = list(p)
        if len(raw_prompts) * req.n > MAX_CHOICES:     # each choice is a request in the engine
            raise ApiError(400, f"{len(raw_prompts)} prompts x n={req.n} asks for "
                                f"{len(raw_prompts) * req.n} completions; at most {MAX_CHOICES} "
                                f"in one request", "prompt")
        if not raw_prompts:
            raise ApiError(400, "prompt must not be empty", "prompt")
        # Tokenizing (up to a megabyte) leaves the event loop, so other streams go on meanwhile.
        prompts = await asyncio.to_thread(lambda: [self._prompt_ids(x) for x in raw_prompts])
        sp = self._sampling_params(req, req.max_tokens, 16, [len(ids) for _, ids in prompts],
                                   "prompt")
        await check_structured_outputs(self.llm, req, sp)
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = await self._add(rid, prompts, sp, req.priority)
        meta = dict(id=rid, created=int(time.time()), model=req.model or self.model_names[0])
        if req.stream:
            inc = req.stream_options is not None and req.stream_options.include_usage
            return SSEStream(self._stream(streams, meta, "text_completion", inc, sp, chat=False,
                                          echo=req.echo), streams)
        outs = await _collect(streams)
        choices = [self._completion_choice(i * sp.n + c.index, o, c, sp, req.echo)
                   for i, o in enumerate(outs) for c in o.outputs]    # as vLLM: prompt-major
        return {**meta, "object": "text_completion", "choices": choices,
                "usage": _usage(outs)}

    def _completion_choice(self, i: int, o: RequestOutput, c: CompletionOutput,
                           sp: SamplingParams, echo: bool) -> dict:
        text, lps = c.text, None
        if echo:
            prompt = self._prompt_text(o)
            text = prompt + text
            if sp.logprobs is not None:
                lps = completion_logprobs(o.prompt_logprobs + c.logprobs,
                                          o.prompt_token_ids + c.token_ids, self.tokenizer)
        elif sp.logprobs is not None:
            lps = completion_logprobs(c.logprobs, c.token_ids, self.tokenizer)
        choice = {"index": i, "text": text, "logprobs": lps, "finish_reason": c.finish_reason,
                  "stop_reason": c.stop_reason}
        if sp.prompt_logprobs is not None and o.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(o.prompt_logprobs)
        return choice

    def _prompt_text(self, o: RequestOutput) -> str:
        return o.prompt if o.prompt is not None else self.tokenizer.decode(o.prompt_token_ids)

    # ---- /v1/chat/completions ---------------------------------------------------------------
    async def create_chat_completion(self, req: ChatCompletionRequest):
        self.check_model(req.model)
        self._check_unsupported(req)
        text, ids = await asyncio.to_thread(self.render_chat, req.messages,
                                            req.add_generation_prompt)     # off the loop
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        if req.max_completion_tokens is not None and req.max_completion_tokens < 1:
            raise ApiError(400, f"max_completion_tokens must be an int >= 1, got "
                                f"{req.max_completion_tokens}", "max_completion_tokens")
        sp = self._sampling_params(req, max_tokens, None, [len(ids)], "messages")
        await check_structured_outputs(self.llm, req, sp)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self._add(rid, [(text, ids)], sp, req.priority)
        meta = dict(id=rid, created=int(time.time()), model=req.model or self.model_names[0])
        if req.stream:
            inc = req.stream_options is not None and req.stream_options.include_usage
            return SSEStream(self._stream(streams, meta, "chat.completion.chunk", inc, sp,
                                          chat=True), streams)
        outs = await _collect(streams)
        return {**meta, "object": "chat.completion",
                "choices": [_chat_choice(outs[0], c, sp) for c in outs[0].outputs],
                "usage": _usage(outs)}

    def render_chat(self, messages, add_generation_prompt: bool) -> tuple[str, list[int]]:
        msgs = []
        for i, m in enumerate(messages):
            content = m.content
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise ApiError(400, f"messages[{i}].content: only text parts are "
                                            f"supported", "messages")
                    parts.append(part["text"])
                content = "".join(parts)
            msgs.append({"role": m.role, "content": content or ""})
        try:
            text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt)
        except (ValueError, jinja2.TemplateError) as e:
            raise ApiError(400, f"cannot apply the chat template: {e}", "messages") from None
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise ApiError(400, "the rendered prompt is empty", "messages")
        return text, ids

    # ---- SSE --------------------------------------------------------------------------------
    async def _stream(self, streams: list[RequestStream], meta: dict, obj: str,
                      include_usage: bool, sp: SamplingParams, chat: bool,
                      echo: bool = False) -> AsyncIterator[str]:
        n = sp.n        # choice k = stream i's completion j: i * n + j (chat: one stream)
        finals: list[RequestOutput | None] = [None] * len(streams)
        extra = {"usage": None} if include_usage else {}
        chunk = ChunkMaker(meta, obj, chat, extra, sp, self.tokenizer)
        to_echo = set(range(len(streams))) if echo else set()
        try:
            first = True
            async for i, out in merge(streams):
                if chat and first:      # as vLLM: the role chunks come with the first output
                    first = False
                    for k in range(n):
                        yield chunk.role(k)
                _raise_if_failed(out)
                if i in to_echo:
                    to_echo.discard(i)
                    for k in range(i * n, i * n + n):
                        yield chunk.echo(k, out, self._prompt_text(out))
                if out.finished:
                    finals[i] = out
                for c in out.outputs:
                    text = chunk.delta(i * n + c.index, c)
                    if text is not None:
                        yield text
            if include_usage:
                yield sse({**meta, "object": obj, "choices": [], "usage": _usage(finals)})
        except EngineDeadError as e:
            yield sse(ApiError(500, str(e), None, type="server_error").body())
        except ApiError as e:       # this request failed in the engine; the others go on
            yield sse(e.body())
        finally:
            for s in streams:
                s.close()
        yield "data: [DONE]\n\n"


def _chat_choice(o: RequestOutput, c: CompletionOutput, sp: SamplingParams) -> dict:
    lps = chat_logprobs(c.logprobs, c.token_ids, sp.logprobs or 0) \
        if sp.logprobs is not None else None
    choice = {"index": c.index, "message": {"role": "assistant", "content": c.text},
              "logprobs": lps, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
    if sp.prompt_logprobs is not None and o.prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs_json(o.prompt_logprobs)
    return choice


def _num_logprobs(req) -> int | None:
    """SamplingParams.logprobs: completions give the number; chat a flag and top_logprobs."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def _raise_if_failed(out: RequestOutput) -> None:
    """A request the engine failed alone (finish_reason "error"; the engine goes on): a 400
    naming the field when its input was at fault (a ValueError), else a 500 saying so."""
    c = next((c for c in out.outputs if c.finish_reason == "error"), None)
    if c is None:
        return
    err = c.error
    if isinstance(err, ValueError):
        raise ApiError(400, str(err), _param_of(str(err)))
    raise ApiError(500, f"the request failed in the engine ({type(err).__name__}: {err}); "
                        f"other requests are unaffected", None, type="server_error")


def _usage(outs: list[RequestOutput | None]) -> dict:
    # As vLLM: a prompt counts once however many completions (n) it has.
    p = sum(len(o.prompt_token_ids) for o in outs if o is not None)
    c = sum(len(c.token_ids) for o in outs if o is not None for c in o.outputs)
    return usage(p, c)


async def _collect(streams: list[RequestStream]) -> list[RequestOutput]:
    last: list[RequestOutput | None] = [None] * len(streams)
    try:
        async for i, out in merge(streams):
            _raise_if_failed(out)
            last[i] = out
    finally:
        for s in streams:
            s.close()
    return last     # type: ignore[return-value]
