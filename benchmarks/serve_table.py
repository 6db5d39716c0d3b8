"""Markdown table of `kvflow bench serve` result files: python benchmarks/serve_table.py F.json ..."""
import json
import os
import sys


def row(path: str) -> str:
    r = json.load(open(path))
    name = os.path.basename(path).removesuffix(".json")
    cells = [name, r["date"][11:16], str(r["request_rate"]), f"{r['duration']:.0f}",
             f"{r['request_throughput']:.2f}", f"{r['output_throughput']:.0f}",
             f"{r['total_token_throughput']:.0f}"]
    for k in ("ttft", "tpot", "itl", "e2el"):
        cells.append(f"{r[f'median_{k}_ms']:.0f} / {r[f'p99_{k}_ms']:.0f}")
    return "| " + " | ".join(cells) + " |"


if __name__ == "__main__":
    print("| run | UTC | rate | s | req/s | out tok/s | total tok/s | TTFT P50 / P99 ms "
          "| TPOT P50 / P99 ms | ITL P50 / P99 ms | E2EL P50 / P99 ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for p in sys.argv[1:]:
        print(row(p))
