"""kvflow's native CPU kernels: the C++ sources (csrc/) and their build and loading (cpu_ops)."""
