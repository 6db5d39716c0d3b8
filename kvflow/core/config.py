"""Scheduler configuration. Field names follow vLLM's SchedulerConfig / CacheConfig."""
from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("fcfs", "priority")


def _pos_int(name: str, v) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v!r}")


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

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_num_batched_tokens", "max_num_seqs",
                     "max_model_len"):
            _pos_int(name, getattr(self, name))
        t = self.long_prefill_token_threshold
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise ValueError(f"long_prefill_token_threshold must be an int >= 0, got {t!r}")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "reserve_full_sequence"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        w = self.watermark
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not 0.0 <= w < 1.0:
            raise ValueError(f"watermark must be a fraction in [0, 1), got {w!r}")

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * self.num_blocks)
