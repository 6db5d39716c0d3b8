"""The messages rank 0 broadcasts to its tensor-parallel workers (pickled by TPGroup.send)."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvflow.core.config import SchedulerConfig
from kvflow.core.outputs import SchedulerOutput


@dataclass(slots=True)
class InitWorkers:
    """Rank 0 sized the KV cache: every rank builds its runner with this config."""
    scheduler_config: SchedulerConfig


@dataclass(slots=True)
class ExecuteStep:
    """One step. The workers never sample: `sampled` are the tokens rank 0 sampled in the step
    before (a worker's request states need them for their next inputs), `failed` the requests
    whose draw failed there (steps already scheduled skip them, as rank 0's runner does)."""
    scheduler_output: SchedulerOutput
    sampled: dict[str, list[int]] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)


@dataclass(slots=True)
class ShutdownWorkers:
    pass
