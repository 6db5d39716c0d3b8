"""The overhead benchmark still drives the scheduler into a pure-decode state (no timing asserted)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
BENCH = ROOT / "benchmarks" / "scheduler_overhead.py"


def test_scheduler_overhead_benchmark_runs(tmp_path):
    out = tmp_path / "r.json"
    res = subprocess.run([sys.executable, str(BENCH), "--num-running", "8", "--steps", "3",
                          "--repeats", "1", "--json", str(out)],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stderr
    assert "us/request" in res.stdout
    assert '"num_running": 8' in out.read_text()


def test_throughput_benchmark_runs_kvflow_and_hf(tmp_path, tiny_llama):
    out = tmp_path / "t.json"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"),
                          "--engines", "kvflow,hf", "--model", tiny_llama, "--num-prompts", "4",
                          "--input-len-max", "24", "--output-len-min", "4", "--output-len-max", "8", "--dtype", "float32",
                          "--max-model-len", "128", "--work-dir", str(tmp_path / "w"),
                          "--json", str(out)],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    import json
    summary = json.loads(out.read_text())["summary"]
    assert summary["kvflow"]["output_tok_s"] > 0 and summary["hf"]["output_tok_s"] > 0
