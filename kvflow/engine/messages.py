"""The typed messages between the frontend (AsyncLLM, LLMEngine) and the engine core.

msgspec structs, encoded as msgpack: the same objects travel in-process (a thread) and over ZMQ
(a process). Torch-free, like everything the frontend needs to read them.
"""
from __future__ import annotations

from typing import Any

import msgspec

from kvflow.core.config import SchedulerConfig
from kvflow.core.outputs import EngineCoreOutput, SchedulerStats
from kvflow.model.config import ModelConfig
from kvflow.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request as the core needs it: token ids, already validated by the frontend."""
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0


# ---- frontend -> core ----------------------------------------------------------------------
class AddRequests(msgspec.Struct, tag=True, array_like=True, gc=False):
    requests: list[EngineCoreRequest]


class AbortRequests(msgspec.Struct, tag=True, array_like=True, gc=False):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Call a public EngineCore method by name (stats, tests); answered by a UtilityResult."""
    call_id: int
    method: str
    args: list[Any] = []


class Shutdown(msgspec.Struct, tag=True, array_like=True, gc=False):
    pass


CoreInput = AddRequests | AbortRequests | UtilityCall | Shutdown


# ---- core -> frontend ----------------------------------------------------------------------
class EngineCoreOutputs(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """What one step produced, with the step's timing (time.monotonic, one clock per machine)."""
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    step_start: float = 0.0
    step_end: float = 0.0
    newly_scheduled: list[str] = []     # requests whose first tokens were scheduled this step
    num_prompt_tokens: int = 0          # their prompt tokens


class UtilityResult(msgspec.Struct, tag=True, array_like=True, gc=False):
    call_id: int
    result: Any = None
    error: str | None = None


class Ready(msgspec.Struct, tag=True, array_like=True, gc=False):
    """The core's first message: what the frontend needs to validate and serve requests."""
    model_config: ModelConfig
    scheduler_config: SchedulerConfig
    dtype: str
    device: str
    attention_backend: str
    load_time: float


class EngineDead(msgspec.Struct, tag=True, array_like=True, gc=False):
    """The core's last message when it stops on an error (loading, or a failed step)."""
    error: str
    is_value_error: bool = False    # bad arguments (e.g. max_model_len): raised as ValueError


CoreOutput = EngineCoreOutputs | UtilityResult | Ready | EngineDead
