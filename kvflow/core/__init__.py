"""The scheduler core: pure Python, no torch (tests/test_import_boundaries.py enforces it)."""
from kvflow.core.block_pool import BlockPool, KVCacheBlock
from kvflow.core.config import SchedulerConfig
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.outputs import (EMPTY_MODEL_RUNNER_OUTPUT, CachedRequestData, EngineCoreOutput,
                                 ModelRunnerOutput, NewRequestData, RequestFailure,
                                 SchedulerOutput, SchedulerStats)
from kvflow.core.request import Request, RequestStatus
from kvflow.core.scheduler import AsyncScheduler, Scheduler

__all__ = ["AsyncScheduler", "BlockPool", "CachedRequestData", "EMPTY_MODEL_RUNNER_OUTPUT",
           "EngineCoreOutput", "KVCacheBlock", "KVCacheManager", "ModelRunnerOutput",
           "NewRequestData", "Request", "RequestFailure", "RequestStatus", "Scheduler",
           "SchedulerConfig", "SchedulerOutput", "SchedulerStats"]
