"""The offline API, shaped like vllm.LLM: a vLLM user changes only the import."""
from __future__ import annotations

import time

from tqdm.auto import tqdm

from kvflow.engine.llm_engine import EngineArgs, LLMEngine
from kvflow.engine.outputs import RequestOutput
from kvflow.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_args) -> None:
        fields = set(EngineArgs.__dataclass_fields__)
        unknown = sorted(set(engine_args) - fields)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; known: {sorted(fields)}")
        self.llm_engine = LLMEngine(EngineArgs(model=model, **engine_args))
        self._counter = 0

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None) -> list[RequestOutput]:
        prompts = _normalize_prompts(prompts)
        return self._run(prompts, sampling_params, use_tqdm, priority)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """`messages`: one conversation (a list of {'role', 'content'} dicts) or a list of them."""
        if isinstance(messages, list) and messages and isinstance(messages[0], dict):
            messages = [messages]
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a conversation or a non-empty list of them")
        tok = self.llm_engine.tokenizer
        prompts = []
        for conv in messages:
            text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
            prompts.append({"prompt_token_ids": tok.encode(text, add_special_tokens=False),
                            "prompt": text})
        return self._run(prompts, sampling_params, use_tqdm, None)

    def _run(self, prompts: list, sampling_params, use_tqdm: bool, priority) -> list[RequestOutput]:
        n = len(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != n:
                raise ValueError(f"got {len(sampling_params)} sampling_params for {n} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params or SamplingParams()] * n
        if priority is not None and len(priority) != n:
            raise ValueError(f"got {len(priority)} priorities for {n} prompts")
        engine = self.llm_engine
        ids = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                rid = str(self._counter)
                self._counter += 1
                engine.add_request(rid, p, sp, priority=priority[i] if priority else 0)
                ids.append(rid)
        except Exception:
            engine.abort_request(ids)       # nothing half-added stays behind
            raise
        return self._run_engine(ids, use_tqdm)

    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True,
                   disable=not use_tqdm)
        t0 = time.perf_counter()
        p0, g0 = engine.num_prompt_tokens, engine.num_generation_tokens
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        if use_tqdm:
                            dt = max(time.perf_counter() - t0, 1e-9)
                            bar.set_postfix_str(
                                f"est. speed input: {(engine.num_prompt_tokens - p0) / dt:.2f} "
                                f"toks/s, output: {(engine.num_generation_tokens - g0) / dt:.2f} "
                                f"toks/s", refresh=False)
                            bar.update(1)
        except BaseException:
            engine.abort_request([i for i in ids if i not in done])
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]


def _normalize_prompts(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise ValueError("prompts is empty")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]          # one prompt given as token ids
        for p in prompts:
            if not isinstance(p, (str, dict, list, tuple)):
                raise ValueError(f"each prompt must be a str, a list of token ids or a dict, "
                                 f"got {type(p).__name__}")
        return list(prompts)
    raise ValueError(f"prompts must be a str, a list of str, a list of token-id lists or "
                     f"prompt dicts, got {type(prompts).__name__}")
