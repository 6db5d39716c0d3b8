"""The frontend's two halves around the engine core: prompts in, text out.

InputProcessor turns a prompt and SamplingParams into a validated EngineCoreRequest (every
refusal is a ValueError here, before anything reaches the core). OutputProcessor turns the
core's token ids into cumulative RequestOutputs: detokenization and stop strings.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from kvflow.core import SchedulerConfig
from kvflow.core.outputs import EngineCoreOutput
from kvflow.core.config import check_new_request
from kvflow.engine.detokenizer import IncrementalDetokenizer
from kvflow.engine.messages import EngineCoreRequest
from kvflow.engine.outputs import (CompletionOutput, Logprob, PromptLogprobs, RequestOutput,
                                  SampleLogprobs)
from kvflow.engine.tokenizer import Tokenizer
from kvflow.model.config import ModelConfig
from kvflow.sampling_params import SamplingParams


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, model_config: ModelConfig,
                 scheduler_config: SchedulerConfig) -> None:
        self.tokenizer, self.model_config = tokenizer, model_config
        self.scheduler_config = scheduler_config
        eos = tokenizer.eos_token_id
        self.eos_token_id = eos if eos is not None else next(iter(model_config.eos_token_ids),
                                                             None)
        # Models with several end tokens (e.g. Llama 3) stop on all of them.
        self.extra_eos = [t for t in model_config.eos_token_ids if t != self.eos_token_id]

    def process(self, request_id: str, prompt, sampling_params: SamplingParams | None,
                arrival_time: float | None = None, priority: int = 0
                ) -> tuple[str | None, EngineCoreRequest]:
        """(prompt text if any, the request for the core); ValueError names what is wrong."""
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str, got {request_id!r}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"request {request_id!r}: priority must be an int, got {priority!r}")
        text, ids = self._tokenize(prompt)
        sp = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sp).__name__}")
        if self.extra_eos and not sp.ignore_eos:
            sp = dataclasses.replace(sp, stop_token_ids=sp.stop_token_ids + self.extra_eos)
        if sp.bad_words:
            sp = dataclasses.replace(sp, bad_words_token_ids=self._bad_words(sp.bad_words))
        sp.check_vocab(self.model_config.vocab_size)
        sp.check_seed()     # again: sp may have been changed since it was built
        max_tokens = sp.max_tokens if sp.max_tokens is not None else 1 << 62
        check_new_request(self.scheduler_config, request_id, len(ids), max_tokens)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        return text, EngineCoreRequest(request_id, ids, sp, self.eos_token_id, arrival, priority)

    def _bad_words(self, words: list[str]) -> list[list[int]]:
        """Each bad word's tokens, alone and after a space (as vLLM: the same word is often
        one token mid-sentence and another at the start)."""
        out = []
        for w in words:
            for text in (w, " " + w.lstrip(" ")):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)):
                    raise ValueError(f"prompt_token_ids must be a list of ints, "
                                     f"got {type(ids).__name__}")
                text = prompt.get("prompt")
                return text if isinstance(text, str) else None, self._tokenize(ids)[1]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            vocab = self.model_config.vocab_size
            for t in prompt:
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                    raise ValueError(f"prompt token id {t!r} is not an int in [0, {vocab})")
            return None, list(prompt)
        raise ValueError(f"a prompt must be a str, a list of token ids or a dict, "
                         f"got {type(prompt).__name__}")


@dataclass(slots=True)
class RequestState:
    prompt: str | None
    prompt_token_ids: list[int]
    detok: IncrementalDetokenizer
    output_token_ids: list[int]
    num_cached_tokens: int = 0
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: PromptLogprobs | None = None


class OutputProcessor:
    """Per-request text state; process() is called with each step's outputs, in order."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add(self, prompt: str | None, r: EngineCoreRequest) -> None:
        if r.request_id in self.states:
            raise ValueError(f"request id {r.request_id!r} is already in use")
        sp = r.sampling_params
        detok = IncrementalDetokenizer(self.tokenizer, r.prompt_token_ids, sp.stop, sp.min_tokens)
        st = RequestState(prompt, r.prompt_token_ids, detok, [])
        if sp.logprobs is not None:
            st.logprobs, st.cumulative_logprob = [], 0.0
        self.states[r.request_id] = st

    def abort(self, request_ids) -> None:
        for rid in request_ids:
            self.states.pop(rid, None)

    def process(self, outputs: list[EngineCoreOutput]
                ) -> tuple[list[RequestOutput], list[str]]:
        """(RequestOutputs, ids the core must abort: stopped by a stop string or failed here)."""
        results: list[RequestOutput] = []
        to_abort: list[str] = []
        for co in outputs:
            st = self.states.get(co.request_id)
            if st is None:
                continue                # aborted by the frontend while the step ran
            reason, stop_reason, err = co.finish_reason, co.stop_reason, None
            st.output_token_ids.extend(co.new_token_ids)
            st.num_cached_tokens = co.num_cached_tokens
            if co.new_logprobs and st.logprobs is not None:
                st.logprobs += [self._logprob_dict(e) for e in co.new_logprobs]
                st.cumulative_logprob += sum(e[1][0] for e in co.new_logprobs)
            if co.new_prompt_logprobs is not None:
                st.prompt_logprobs = [None] + [self._logprob_dict(e)
                                               for e in co.new_prompt_logprobs]
            if reason == "error":
                err = (ValueError if co.error_is_input else RuntimeError)(co.error)
            else:
                try:
                    if st.detok.update(co.new_token_ids):
                        reason, stop_reason = "stop", st.detok.stop_reason
                        if co.finish_reason is None:
                            to_abort.append(co.request_id)
                except Exception as e:      # its detokenizer or stop strings: fail it alone
                    reason, err = "error", e
                    if co.finish_reason is None:
                        to_abort.append(co.request_id)
            results.append(self._output(co.request_id, st, reason, stop_reason, err))
            if reason is not None:
                del self.states[co.request_id]
        return results, to_abort

    def _logprob_dict(self, entry) -> dict[int, Logprob]:
        """The chosen token (its own rank) then the top alternatives (ranks 1..k)."""
        ids, lps, rank = entry
        name = self.tokenizer.decode_token
        d = {ids[0]: Logprob(lps[0], rank, name(ids[0]))}
        for j in range(1, len(ids)):
            if ids[j] not in d:
                d[ids[j]] = Logprob(lps[j], j, name(ids[j]))
        return d

    @staticmethod
    def _output(rid: str, st: RequestState, reason, stop_reason, err) -> RequestOutput:
        comp = CompletionOutput(0, st.detok.text, list(st.output_token_ids), reason,
                                stop_reason if reason is not None else None, err,
                                list(st.logprobs) if st.logprobs is not None else None,
                                st.cumulative_logprob)
        return RequestOutput(rid, st.prompt, st.prompt_token_ids, [comp], reason is not None,
                             st.num_cached_tokens, st.prompt_logprobs)
