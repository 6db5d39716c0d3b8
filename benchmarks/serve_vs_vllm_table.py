"""Medians over rounds of serve_vs_vllm.sh's results: python benchmarks/serve_vs_vllm_table.py DIR"""
import glob
import json
import os
import re
import statistics
import sys
from collections import defaultdict


def main(d: str) -> None:
    runs = defaultdict(list)
    for f in sorted(glob.glob(os.path.join(d, "*_r*.json"))):
        m = re.match(r"(.+)_r(\d+)\.json$", os.path.basename(f))
        runs[m.group(1)].append(json.load(open(f)))
    med = {k: statistics.median(r["output_throughput"] for r in v) for k, v in runs.items()}
    print("| run | rounds | output tok/s (each) | median | TTFT P50 ms | TPOT P50 ms |")
    print("|---|---|---|---|---|---|")
    for k, v in sorted(runs.items()):
        each = " / ".join(f"{r['output_throughput']:.0f}" for r in v)
        ttft = statistics.median(r.get("median_ttft_ms", float("nan")) for r in v)
        tpot = statistics.median(r.get("median_tpot_ms", float("nan")) for r in v)
        print(f"| {k} | {len(v)} | {each} | {med[k]:.0f} | {ttft:.0f} | {tpot:.1f} |")
    off = med.get("kvflow-offline-float32")
    for k in sorted(med):
        if k.startswith("kvflow-float32_c32") and off:
            print(f"\nserved/offline (float32, concurrency 32): {med[k] / off:.3f}")
    v = med.get("vllm-float32_c32")
    for k in sorted(med):
        if k.startswith("kvflow-") and k.endswith("_c32") and v:
            print(f"{k} / vllm-float32_c32: {med[k] / v:.3f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/serve_vs_vllm")
