"""A request as the scheduler sees it: token ids, progress, and where it is in its life."""
from __future__ import annotations

import enum
import time

from kvflow.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything after PREEMPTED is finished, so is_finished() is one comparison.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_IGNORED = 6
    FINISHED_ERROR = 7      # this request alone failed in the engine (vLLM's FinishReason.ERROR)

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: "RequestStatus") -> str | None:
        return _FINISH_REASON.get(status)


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "eos_token_id",
                 "arrival_time", "priority", "status", "output_token_ids", "all_token_ids",
                 "num_prompt_tokens", "num_computed_tokens", "num_cached_tokens",
                 "num_preemptions", "stop_reason", "block_hashes", "max_tokens", "min_tokens",
                 "stop_eos", "stop_token_set", "seq_no", "spec_token_ids", "ngram_index",
                 "use_structured_output", "num_output_placeholders")

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams | None = None, *, eos_token_id: int | None = None,
                 arrival_time: float | None = None, priority: int = 0) -> None:
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str, got {request_id!r}")
        sp = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sp).__name__}")
        ids = list(prompt_token_ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ValueError(f"request {request_id!r}: prompt_token_ids must be non-negative ints")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"request {request_id!r}: priority must be an int, got {priority!r}")
        self.request_id = request_id
        self.prompt_token_ids = ids
        self.sampling_params = sp
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(ids)
        self.num_prompt_tokens = len(ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        # Chained hashes of the full blocks of all_token_ids, extended lazily by the KV cache
        # manager (it knows the block size).
        self.block_hashes: list[int] = []
        # Stop rules flattened for the per-token check in update_from_output.
        self.max_tokens = sp.max_tokens if sp.max_tokens is not None else 1 << 62
        self.min_tokens = sp.min_tokens
        self.stop_eos = None if sp.ignore_eos else eos_token_id
        self.stop_token_set = frozenset(sp.stop_token_ids) or None
        self.seq_no = 0     # insertion order, set by the scheduler; breaks priority ties
        # Draft tokens proposed after the last step, verified in the next; never part of
        # all_token_ids (so never hashed into the prefix cache).
        self.spec_token_ids: list[int] = []
        self.ngram_index = None     # the n-gram proposer's per-request index, built lazily
        # A grammar constrains its tokens: the engine core fills a bitmask row for it in each
        # step that samples it (vLLM's name).
        self.use_structured_output = sp.structured_outputs is not None
        # Async scheduling: tokens scheduled to be sampled by steps still in flight. Counted in
        # num_computed_tokens (their positions are scheduled) but not yet in all_token_ids.
        self.num_output_placeholders = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def get_finished_reason(self) -> str | None:
        return _FINISH_REASON.get(self.status)

    def append_output_token_ids(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, out={len(self.output_token_ids)})")
