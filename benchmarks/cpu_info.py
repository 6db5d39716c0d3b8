"""The CPU line every benchmark prints beside its figures: model name and the SIMD flags that
pick kvflow's kernels (AVX2 / AVX-512 / AMX)."""
import platform
import re


def cpu_line() -> str:
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return platform.processor() or platform.machine()
    name = re.search(r"model name\s*:\s*(.*)", info)
    flags = set(re.search(r"flags\s*:\s*(.*)", info).group(1).split())
    wanted = sorted(f for f in flags if f.startswith(("avx", "amx")) or f in ("fma", "f16c"))
    return f"{name.group(1) if name else platform.machine()}; flags: {' '.join(wanted)}"
