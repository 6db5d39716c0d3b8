"""What generate() returns, shaped like vllm.outputs so vLLM code reads it unchanged."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """One token's log-probability under the model (vLLM's)."""
    logprob: float
    rank: int | None = None             # 1 + the number of more likely tokens
    decoded_token: str | None = None


# Per position: token id -> Logprob, the chosen token first, then the top alternatives.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]     # None for the first prompt token


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None        # "stop" | "length" | "abort" | "error" | None
    stop_reason: int | str | None = None    # the stop string or stop token id that matched
    # With finish_reason "error": what failed this request alone (a ValueError: its input).
    error: BaseException | None = None
    logprobs: SampleLogprobs | None = None      # with SamplingParams.logprobs
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None   # with SamplingParams.prompt_logprobs
