"""Scheduler configuration. Field names follow vLLM's SchedulerConfig / CacheConfig."""
from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("fcfs", "priority")


def _pos_int(name: str, v) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v!r}")


SPEC_METHODS = ("ngram",)
# vLLM refuses the same combination: a draft is proposed from the tokens of the step before,
# which async scheduling has not seen yet when it schedules the next step.
ASYNC_SPEC_ERROR = ("async_scheduling does not support speculative_config (n-gram drafts need "
                    "the previous step's tokens before the next step is scheduled); turn one off")


@dataclass(slots=True)
class SpeculativeConfig:
    """vLLM's speculative_config, n-gram (prompt lookup) method only. Each running request gets
    up to num_speculative_tokens drafts a step, found by matching the last prompt_lookup_max ..
    prompt_lookup_min tokens earlier in its own prompt and output. As the batch grows the
    drafts shrink (see num_drafts_for), and past disable_by_batch_size running requests there
    are none."""
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # A step verifies at most this many tokens (decodes plus drafts) before drafts shrink:
    # past ~12 rows a CPU step's cost grows with every row (BENCHMARKS.md, issue 14).
    max_batch_tokens: int = 12
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config method must be one of {SPEC_METHODS}, "
                             f"got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                     "max_batch_tokens"):
            _pos_int(f"speculative_config {name}", getattr(self, name))
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) "
                             f"must be <= prompt_lookup_max ({self.prompt_lookup_max})")
        if self.disable_by_batch_size is not None:
            _pos_int("speculative_config disable_by_batch_size", self.disable_by_batch_size)

    @classmethod
    def from_dict(cls, d: "dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """From vLLM's dict shape; unknown keys are an error naming them, not ignored."""
        if d is None or isinstance(d, cls):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(d).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown or unsupported keys {unknown} "
                             f"(kvflow takes {sorted(known)})")
        return cls(**d)

    def num_drafts_for(self, num_running: int) -> int:
        """Drafts per request in a step with num_running decodes: all of k while the step
        verifies at most max_batch_tokens tokens, then fewer, down to none."""
        if num_running < 1 or (self.disable_by_batch_size is not None
                               and num_running >= self.disable_by_batch_size):
            return 0
        return max(0, min(self.num_speculative_tokens,
                          self.max_batch_tokens // num_running - 1))


@dataclass(slots=True)
class SchedulerConfig:
    block_size: int = 16
    num_blocks: int = 1024              # usable blocks, ids 0..num_blocks-1 (no null block)
    max_num_batched_tokens: int = 8192  # the per-step token budget
    max_num_seqs: int = 256
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0   # 0 = off
    policy: str = "fcfs"
    watermark: float = 0.0              # fraction of num_blocks kept back from new admissions
    reserve_full_sequence: bool = True  # admission needs blocks for the whole current sequence
    speculative_config: SpeculativeConfig | None = None
    # Step N+1 is scheduled while step N runs: a request whose token is still in flight is
    # scheduled on a placeholder (Request.num_output_placeholders), as in vLLM's AsyncScheduler.
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_num_batched_tokens", "max_num_seqs",
                     "max_model_len"):
            _pos_int(name, getattr(self, name))
        t = self.long_prefill_token_threshold
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise ValueError(f"long_prefill_token_threshold must be an int >= 0, got {t!r}")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "reserve_full_sequence",
                     "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.speculative_config is not None and not isinstance(self.speculative_config,
                                                                 SpeculativeConfig):
            raise ValueError("speculative_config must be a SpeculativeConfig or None")
        if self.async_scheduling and self.speculative_config is not None:
            raise ValueError(ASYNC_SPEC_ERROR)
        w = self.watermark
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not 0.0 <= w < 1.0:
            raise ValueError(f"watermark must be a fraction in [0, 1), got {w!r}")

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * self.num_blocks)


def check_new_request(c: SchedulerConfig, rid: str, n: int, max_tokens: int) -> None:
    """What add_request refuses for a prompt of n tokens (a frontend checks it too, before a
    request travels to the engine core)."""
    if n == 0:
        raise ValueError(f"request {rid!r}: the prompt is empty")
    if n >= c.max_model_len:
        raise ValueError(f"request {rid!r}: prompt of {n} tokens must be shorter than "
                         f"max_model_len ({c.max_model_len})")
    if not c.enable_chunked_prefill and n > c.max_num_batched_tokens:
        raise ValueError(f"request {rid!r}: prompt of {n} tokens exceeds "
                         f"max_num_batched_tokens ({c.max_num_batched_tokens}) and chunked "
                         f"prefill is disabled")
    longest = min(n + max_tokens - 1, c.max_model_len)
    need = -(-longest // c.block_size)
    if need > c.num_blocks:
        raise ValueError(f"request {rid!r}: up to {longest} tokens need {need} KV blocks but "
                         f"the cache has only num_blocks={c.num_blocks}; lower max_tokens or "
                         f"add blocks")
