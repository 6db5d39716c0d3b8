"""Host-to-device input copies. Bound for a GPU, host data goes through pinned memory and the
copy does not block: torch's caching host allocator keeps the pinned block alive until the copy
has run, so the next step can build its inputs while this one computes. On CPU both are no-ops."""
from __future__ import annotations

import torch


def host(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A list or CPU tensor as a CPU tensor of dtype, pinned when it is bound for a GPU."""
    t = data.to(dtype) if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    return t.pin_memory() if device.type == "cuda" else t


def upload(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A list or tensor as a contiguous tensor of dtype on device."""
    if isinstance(data, torch.Tensor) and data.device == device:
        return data.to(dtype).contiguous()
    return host(data, dtype, device).contiguous().to(device, non_blocking=True)
