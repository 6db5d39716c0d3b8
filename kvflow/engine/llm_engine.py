"""LLMEngine: the frontend and the engine core in one synchronous step loop, no IPC (the
offline `LLM`'s engine, as vLLM's with multiprocessing off)."""
from __future__ import annotations

import time
from collections.abc import Iterable

from kvflow.core import RequestStatus
from kvflow.engine.arg_utils import EngineArgs
from kvflow.engine.core import EngineCore
from kvflow.engine.outputs import RequestOutput
from kvflow.engine.parallel_sampling import ParentRequests
from kvflow.engine.processor import InputProcessor, OutputProcessor
from kvflow.engine.tokenizer import Tokenizer
from kvflow.model.loader.checkpoint import open_checkpoint
from kvflow.sampling_params import SamplingParams

__all__ = ["EngineArgs", "LLMEngine"]


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        t0 = time.perf_counter()
        ckpt = open_checkpoint(args.model)
        self.engine_core = core = EngineCore(args, ckpt)
        self.tokenizer = Tokenizer.from_checkpoint(ckpt)
        self.input_processor = InputProcessor(self.tokenizer, core.model_config,
                                              core.scheduler_config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.parent_requests = ParentRequests()     # n > 1: children run in the core
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.load_time = time.perf_counter() - t0

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    # What tests and benchmarks read; the core owns them.
    scheduler = property(lambda self: self.engine_core.scheduler)
    runner = property(lambda self: self.engine_core.runner)
    model_config = property(lambda self: self.engine_core.model_config)
    scheduler_config = property(lambda self: self.engine_core.scheduler_config)
    dtype = property(lambda self: self.engine_core.dtype)
    device = property(lambda self: self.engine_core.device)
    attention_backend = property(lambda self: self.engine_core.attention_backend)
    states = property(lambda self: self.output_processor.states)

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int] | dict,
                    sampling_params: SamplingParams | None = None, arrival_time: float | None = None,
                    priority: int = 0) -> None:
        text, req = self.input_processor.process(request_id, prompt, sampling_params,
                                                 arrival_time, priority)
        parent, reqs = self.parent_requests.fan_out(text, req)
        states = self.output_processor.states
        if request_id in self.parent_requests or any(r.request_id in states
                                                     for r in [req, *reqs]):
            raise ValueError(f"request id {request_id!r} is already in use")
        if parent is not None:
            self.parent_requests.add(parent)
        for r in reqs:      # all before the next step: the children share the prompt's blocks
            self.output_processor.add(text, r)
            self.engine_core.add_request(r)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        ids = self.parent_requests.abort(ids)      # a parent's: all its children
        self.engine_core.abort_requests(ids)
        self.output_processor.abort(ids)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers now (else at exit); the engine is unusable after."""
        self.engine_core.shutdown()

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.engine_core.scheduler.get_num_unfinished_requests()

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outs = self.engine_core.step()
        self.num_prompt_tokens += outs.num_prompt_tokens
        self.num_generation_tokens += sum(len(o.new_token_ids) for o in outs.outputs)
        results, stopped = self.output_processor.process(outs.outputs)
        if stopped:     # by a stop string (or its detokenizer failed): the core lets go now
            self.engine_core.abort_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return self.parent_requests.process(results)
