"""Paged attention: the backend interface, the CPU and triton backends, choosing one."""
