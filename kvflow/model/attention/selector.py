"""Choosing the device and the attention backend from EngineArgs' strings, with errors that name
the argument. Nothing here imports triton: only the triton backend itself does."""
from __future__ import annotations

import importlib.util

DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton")


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def check_device(device: str) -> None:
    if device not in DEVICES:
        raise ValueError(f"device must be one of {list(DEVICES)}, got {device!r}")
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise ValueError(f"device='cuda' but no CUDA device is usable (torch "
                             f"{torch.__version__}, torch.cuda.is_available() is False); "
                             f"use device='cpu' or 'auto'")


def check_attention_backend(name: str) -> None:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {list(ATTENTION_BACKENDS)}, "
                         f"got {name!r}")
    if name == "triton" and not triton_installed():
        raise ValueError("attention_backend='triton' needs the triton package, which is not "
                         "installed (pip install 'kvflow[cuda]')")


def resolve_device(device: str) -> str:
    check_device(device)
    if device == "auto":
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_attention_backend(name: str, device: str) -> str:
    check_attention_backend(name)
    if name == "auto":
        return "triton" if device == "cuda" else "torch"
    if name == "torch" and device != "cpu":
        raise ValueError(f"attention_backend='torch' runs on CPU only; with device={device!r} "
                         f"use 'triton' or 'auto'")
    return name


def make_backend(name: str, device: str):
    if name == "torch":
        from kvflow.model.attention.backend import TorchAttentionBackend
        return TorchAttentionBackend()
    from kvflow.model.attention.triton_backend import TritonAttentionBackend
    return TritonAttentionBackend(device)
