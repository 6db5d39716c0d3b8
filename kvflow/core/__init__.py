"""The scheduler core: pure Python, no torch (tests/test_import_boundaries.py enforces it)."""
from kvflow.core.block_pool import BlockPool, KVCacheBlock
from kvflow.core.config import SchedulerConfig
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.outputs import (CachedRequestData, EngineCoreOutput, NewRequestData,
                                 SchedulerOutput, SchedulerStats)
from kvflow.core.request import Request, RequestStatus
from kvflow.core.scheduler import Scheduler

__all__ = ["BlockPool", "CachedRequestData", "EngineCoreOutput", "KVCacheBlock", "KVCacheManager",
           "NewRequestData", "Request", "RequestStatus", "Scheduler", "SchedulerConfig",
           "SchedulerOutput", "SchedulerStats"]
