"""lm-evaluation-harness as an outside judge of the API: its `local-completions` model against
`kvflow serve` scores the shipped tasks (tests/data/lm_eval: multiple choice by loglikelihood,
which needs echo + logprobs; short answers by generate_until) exactly as its `hf` model does on
the same float32 weights. The run is benchmarks/lm_eval_judge.py, as a user runs it by hand."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
JUDGE = ROOT / "benchmarks" / "lm_eval_judge.py"


def test_lm_eval_scores_kvflow_serve_as_hf_transformers(tmp_path):
    out = tmp_path / "r.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "datasets")}
    res = subprocess.run([sys.executable, str(JUDGE), "--cache-dir", str(tmp_path / "c"),
                          "--json", str(out)], capture_output=True, text=True, timeout=600,
                         env=env)
    assert out.exists(), res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads(out.read_text())
    hf, kv = r["scores"]["hf"], r["scores"]["kvflow"]
    # Same metrics, same values: each choice's loglikelihood within 1e-2 nats of HF's float32
    # (observed: 2e-3, the quantized kernels' 16-bit activations), far below the gaps between
    # choices, so every argmax, every accuracy and every greedy answer is the same.
    assert r["diffs"] == [], r["diffs"]
    assert kv == hf
    assert set(kv) == {"kvflow_mc", "kvflow_gen"}
    assert len(r["items"]["kvflow"]["kvflow_mc"]) == 32
    assert len(r["items"]["kvflow"]["kvflow_gen"]) == 16
    # A model that read the questions, not one scoring noise the same way twice.
    assert kv["kvflow_mc"]["acc,none"] > 0.5 and kv["kvflow_gen"]["exact_match,none"] > 0.5
    assert res.returncode == 0, res.stdout[-3000:]
