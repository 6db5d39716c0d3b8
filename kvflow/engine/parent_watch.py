"""Child processes that must not outlive their parent (replicas, tensor-parallel workers)."""
from __future__ import annotations

import os
import threading
import time


def watch_parent(parent_pid: int, on_gone, name: str = "kvflow-parent-watch") -> None:
    """Call on_gone() from a daemon thread once parent_pid is no longer this process's
    parent, however it went (SIGKILL included: re-parenting is the only sign)."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        on_gone()
    threading.Thread(target=watch, name=name, daemon=True).start()
