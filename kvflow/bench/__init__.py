"""Client-side benchmarks: `kvflow bench serve` (kvflow/bench/serve.py)."""
