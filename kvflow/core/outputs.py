"""What crosses the scheduler's boundary: the plan for a step, per-request results, stats."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
import msgspec

from kvflow.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner does not hold: scheduled for the first time, or resumed after a
    preemption (the runner dropped it then, so it is sent in full again, sampled tokens too)."""
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]                # the whole block table (a snapshot)
    num_computed_tokens: int            # before this step: prefix-cache hits, else 0
    eos_token_id: int | None = None     # masked below min_tokens (unless ignore_eos)
    output_token_ids: list[int] = field(default_factory=list)     # resumed only


@dataclass(slots=True)
class CachedRequestData:
    """Running requests the runner already holds: only what changed.

    req_ids, new_token_ids and num_computed_tokens are parallel lists. The runner appends the
    tokens it samples itself, so new_token_ids are only those it never saw (none in kvflow's
    engine). new_block_ids holds only the requests whose table grew this step (a decode opens a
    block once in block_size steps), with the blocks appended: no per-request cost otherwise.
    """
    req_ids: list[str] = field(default_factory=list)
    new_token_ids: list[Sequence[int]] = field(default_factory=list)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    num_computed_tokens: list[int] = field(default_factory=list)    # before this step


@dataclass(slots=True)
class SchedulerOutput:
    """The one contract between the scheduler and whatever executes a step (vLLM V1's).

    A runner keeps its own state per request, built from `scheduled_new_reqs`, updated from
    `scheduled_cached_reqs`, dropped on `preempted_req_ids` and `finished_req_ids`; it never
    reads the scheduler's Request objects. A request's tokens to run this step are its tokens
    [num_computed_tokens, num_computed_tokens + num_scheduled_tokens[id]), num_computed_tokens
    as in the message (schedule() itself has already advanced the Request's count).

    `block_ids` (each scheduled request's whole table) and the *_req_ids lists are for the
    scheduler's side (tests, the simulator); a runner does not need them. Block-id lists are
    snapshots: the KV cache manager never mutates a list it has handed out, nor may a runner.

    A block is prefix-cached as soon as the step that fills it is scheduled, so a request admitted
    later in the same step may hit blocks whose K/V this very step computes (as in vLLM). An
    executor must therefore write every scheduled token's K/V for a layer before any attention
    of that layer reads the cache.

    Structured outputs (vLLM's fields): `structured_output_request_ids` are the scheduled
    requests with a grammar that sample a token this step (their scheduled tokens reach the end
    of their sequence; they never verify drafts). The engine core computes their bitmask from
    their grammars' states and passes it to `execute_model` beside this message (it is not a
    scheduling decision): an int32 tensor [len(ids), ceil(vocab_size / 32)], rows in the order
    of the ids, whose bit j of word w allows token 32 * w + j. The runner sets every
    disallowed logit of those requests' rows to -inf before sampling.
    """
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    scheduled_new_req_ids: list[str] = field(default_factory=list)
    scheduled_resumed_req_ids: list[str] = field(default_factory=list)
    scheduled_running_req_ids: list[str] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)
    block_ids: dict[str, list[int]] = field(default_factory=dict)
    # Draft tokens to verify, by request: its scheduled tokens end with them (vLLM's name).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    structured_output_request_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    def context_lens(self) -> dict[str, int]:
        """Each scheduled request's context length once this step has run."""
        n = self.num_scheduled_tokens
        out = {r.req_id: r.num_computed_tokens + n[r.req_id] for r in self.scheduled_new_reqs}
        c = self.scheduled_cached_reqs
        for rid, computed in zip(c.req_ids, c.num_computed_tokens):
            out[rid] = computed + n[rid]
        return out


# A logprob entry: ([token, top ids...], [logprobs...], rank of the token); see
# kvflow/model/sample/logprobs.py. Plain lists, so that an output crosses any boundary as it is.
LogprobEntry = tuple[list[int], list[float], int]


@dataclass(slots=True)
class RequestFailure:
    """One request's failure inside a step (its draw raised); the others go on."""
    error: str
    is_input: bool = False      # a ValueError: the request's own parameters were at fault


@dataclass(slots=True)
class ModelRunnerOutput:
    """The one answer of a step, from whatever executed it (vLLM's field names).

    `sampled_token_ids[req_id_to_index[rid]]` are the tokens request rid sampled: one, or its
    accepted drafts plus one. Only requests whose scheduled tokens reached the end of their
    sequence appear (a prefill chunk short of it samples nothing). `logprobs` holds the
    sampled tokens' entries of requests asking for them; `prompt_logprobs_dict` a request's
    whole prompt's, once, in the step that samples its first token; `failed` the requests
    whose draw raised (they sampled nothing; the engine finishes them with an error)."""
    req_ids: list[str] = field(default_factory=list)
    req_id_to_index: dict[str, int] = field(default_factory=dict)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: dict[str, list[LogprobEntry]] | None = None
    prompt_logprobs_dict: dict[str, list[LogprobEntry]] = field(default_factory=dict)
    failed: dict[str, RequestFailure] = field(default_factory=dict)
    # vLLM's field for pooling models, which kvflow does not serve: accepted and ignored, so
    # that code (and tests) written against vLLM's ModelRunnerOutput run unchanged.
    pooler_output: list | None = None

    @classmethod
    def from_sampled(cls, sampled: dict[str, list[int]], **kw) -> "ModelRunnerOutput":
        ids = list(sampled)
        return cls(ids, {rid: i for i, rid in enumerate(ids)}, list(sampled.values()), **kw)

    def sampled(self) -> dict[str, list[int]]:
        return dict(zip(self.req_ids, self.sampled_token_ids))


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput()


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request's news from one step: tokens sampled, and how it ended if it did. A msgspec
    struct: the engine core sends it as it is to a frontend in another process."""
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None    # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None            # finish_reason "error": the message ...
    error_is_input: bool = False        # ... and whether the request's input caused it
    # Per new token / per prompt token after the first (sent once, with the first token).
    new_logprobs: list[LogprobEntry] | None = None
    new_prompt_logprobs: list[LogprobEntry] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class SpecDecodingStats:
    """Cumulative speculative-decoding counts (vLLM's vllm:spec_decode_* metrics)."""
    num_drafts: int = 0                 # requests verified with at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_drafted:
            per_pos.extend([0] * (num_drafted - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1

    def copy(self) -> "SpecDecodingStats":
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                 list(self.num_accepted_tokens_per_pos))


@dataclass(slots=True)
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0         # fraction of blocks held by requests
    prefix_cache_queries: int = 0       # cumulative, in tokens
    prefix_cache_hits: int = 0          # cumulative, in tokens
    num_preemptions: int = 0            # cumulative
    spec_decoding: SpecDecodingStats | None = None     # cumulative; None without speculation
