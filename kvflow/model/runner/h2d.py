"""Host-to-device input copies. Bound for a GPU, host data goes through pinned memory and the
copy does not block: torch's caching host allocator keeps the pinned block alive until the copy
has run, so the next step can build its inputs while this one computes. On CPU both are no-ops."""
from __future__ import annotations

import torch


def host(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A list or tensor as a CPU tensor of dtype, pinned when it is bound for a GPU."""
    if isinstance(data, torch.Tensor):
        t = data.to("cpu", dtype)
    else:
        t = torch.tensor(data, dtype=dtype)
    return t.pin_memory() if device.type == "cuda" else t


def upload(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A list or tensor as a contiguous tensor of dtype on device."""
    if isinstance(data, torch.Tensor) and same_device(data.device, device):
        return data.to(dtype).contiguous()
    return host(data, dtype, device).contiguous().to(device, non_blocking=True)


def same_device(a: torch.device, b: torch.device) -> bool:
    """torch.device("cuda") != torch.device("cuda:0"), yet a tensor on either is on the current
    GPU: an index left out means the current one."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)
