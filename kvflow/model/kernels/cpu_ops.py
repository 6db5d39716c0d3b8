"""kvflow's native CPU kernels (csrc/*.cpp: paged decode attention, RMSNorm, SwiGLU, RoPE, few-row float32 GEMM,
GGUF-quantized GEMV/GEMM): built once with the machine's C++ compiler, cached,
and loaded as torch ops (`torch.ops.kvflow.*`).

Why native code: a decode step's attention in plain torch gathers every request's context out of
the paged cache into a dense copy and then runs SDPA over it, so the KV bytes cross memory three
times; the kernel reads them once, straight through the block table. Everything falls back to the
torch path when the kernels cannot be built (no compiler) or KVFLOW_CPU_KERNELS=0 is set.

Built with -march=native for the machine it runs on, so the cache key includes the CPU's flags.
`make install` builds it ahead of time (`python -m kvflow.model.kernels.cpu_ops`) so that no engine start
pays the ~10 s compile.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from kvflow import envs

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / "cpu_attention.cpp", _CSRC / "cpu_layers.cpp", _CSRC / "cpu_gemm.cpp",
            _CSRC / "cpu_quant.cpp", _CSRC / "cpu_bf16.cpp", _CSRC / "cpu_decode.cpp"]
_HEADERS = [_CSRC / "cpu_common.h"]
_state: dict = {}


def _flags() -> list[str]:
    # KVFLOW_CPU_MARCH picks another target than this machine (e.g. x86-64-v3 for AVX2 only).
    return ["-O3", f"-march={envs.KVFLOW_CPU_MARCH}", "-fno-math-errno",
            "-fopenmp", "-shared", "-fPIC", "-std=c++20", "-w"]


def _cpu_flags() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def _cache_dir() -> Path:
    base = envs.KVFLOW_CACHE_DIR or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "kvflow")
    return Path(base)


def library_path() -> Path:
    h = hashlib.sha256()
    for src in _SOURCES + _HEADERS:
        h.update(src.read_bytes())
    h.update(" ".join(_flags() + [torch.__version__, sys.version, _cpu_flags()]).encode())
    return _cache_dir() / f"kvflow_cpu_ops-{h.hexdigest()[:16]}.so"


def build(out: Path) -> None:
    torch_dir = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cxx = os.environ.get("CXX", "g++")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written under a temporary name and renamed: concurrent builders never load a partial file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *_flags(), f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
           f"-I{torch_dir / 'include'}", f"-I{torch_dir / 'include/torch/csrc/api/include'}",
           *map(str, _SOURCES), "-o", tmp, f"-L{torch_dir / 'lib'}", "-ltorch_cpu", "-lc10"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"building kvflow's CPU kernels failed:\n{' '.join(cmd)}\n"
                               f"{r.stderr[-4000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _apply_quant_isa() -> None:
    """KVFLOW_CPU_QUANT_ISA (auto | avx2 | scalar) picks quant_linear's code path; a bad value
    is reported, not fatal to the other kernels."""
    from kvflow.model.quantization.quant import set_isa_from_env
    try:
        set_isa_from_env()
    except Exception as e:
        warnings.warn(f"KVFLOW_CPU_QUANT_ISA ignored: {e}", RuntimeWarning, stacklevel=3)


class _Ops:
    """torch.ops.kvflow's ops as their .default overloads, looked up once: calling the overload
    packet costs ~3 us more per call (measured), and a decode step makes ~300 such calls."""

    def __getattr__(self, name: str):
        op = getattr(torch.ops.kvflow, name).default
        setattr(self, name, op)
        return op


ops = _Ops()


def available() -> bool:
    """True when torch.ops.kvflow.paged_decode can be called; builds the kernels on first use."""
    if "ok" in _state:
        return _state["ok"]
    ok = False
    if envs.KVFLOW_CPU_KERNELS:
        try:
            path = library_path()
            if not path.exists():
                try:
                    build(path)
                except OSError:     # an unwritable cache directory: build into /tmp instead
                    path = Path(tempfile.gettempdir()) / f"kvflow-{os.getuid()}" / path.name
                    if not path.exists():
                        build(path)
            torch.ops.load_library(str(path))
            ok = True
            _apply_quant_isa()
        except Exception as e:      # no compiler, read-only cache, ...: the torch path still works
            warnings.warn(f"kvflow CPU kernels unavailable, using the torch attention path ({e})",
                          RuntimeWarning, stacklevel=2)
    _state["ok"] = ok
    if ok:      # outside the try: a bad value is an error, not a reason to drop every kernel
        _state["bf16w_isa"] = set_bf16w_isa(envs.KVFLOW_CPU_BF16W_ISA)
    return ok


def set_bf16w_isa(isa: str) -> str:
    """Which kernel bf16w_linear's few-row path uses: "auto" (AVX2 where the CPU has it),
    "scalar" (the portable fallback, so tests cover it on any CPU) or "avx2". Returns the one in
    effect. KVFLOW_CPU_BF16W_ISA sets it when the kernels load."""
    return torch.ops.kvflow.bf16w_set_isa(isa)


if __name__ == "__main__":
    print(f"kvflow CPU kernels: {'ready' if available() else 'NOT available'} "
          f"({library_path()})")
