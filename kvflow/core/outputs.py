"""What crosses the scheduler's boundary: the plan for a step, per-request results, stats."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SchedulerOutput:
    """The one contract between the scheduler and whatever executes a step.

    Every scheduled request appears in `num_scheduled_tokens` and `block_ids`. Its tokens to run
    this step are `all_token_ids[num_computed_tokens - n : num_computed_tokens]`, read *after*
    schedule() returned (schedule() has already advanced num_computed_tokens by n). The block-id
    lists are snapshots: the KV cache manager never mutates a list it has handed out.

    A block is prefix-cached as soon as the step that fills it is scheduled, so a request admitted
    later in the same step may hit blocks whose K/V this very step computes (as in vLLM). An
    executor must therefore write every scheduled token's K/V for a layer before any attention
    of that layer reads the cache.
    """
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    scheduled_new_req_ids: list[str] = field(default_factory=list)
    scheduled_resumed_req_ids: list[str] = field(default_factory=list)
    scheduled_running_req_ids: list[str] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)
    block_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None    # "stop" | "length" | "abort"
    stop_reason: int | str | None = None


@dataclass(slots=True)
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0         # fraction of blocks held by requests
    prefix_cache_queries: int = 0       # cumulative, in tokens
    prefix_cache_hits: int = 0          # cumulative, in tokens
    num_preemptions: int = 0            # cumulative
