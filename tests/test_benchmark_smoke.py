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
