"""`kvflow simulate` end to end on a small run: summary.json, the PNG plots, the HTML viewer."""
import argparse
import json
import re


from kvflow.sim.cli import add_simulate_parser, main
from kvflow.sim.workload import data_dir

CONV = data_dir() / "splitwise_conv.csv"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_simulate_writes_summary_plots_and_step_viewer(tmp_path, capsys):
    rc = main(["--trace", str(CONV), "--num-requests", "40", "--request-rate", "6",
               "--model", "Llama-3-8B", "--gpu", "h100", "--policy", "vllm",
               "--max-num-batched-tokens", "2048", "--output", str(tmp_path),
               "--sweep-requests", "30", "--capacity-max-trials", "3",
               "--capacity-policies", "vllm,nano", "--frontier-budgets", "512,2048",
               "--frontier-thresholds", "256", "--trace-steps", "--trace-steps-max", "50",
               "--no-progress"])
    assert rc == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["simulated"] is True and s["completed"] == 40
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p99"):
            assert s[f"{stat}_{metric}_ms"] > 0
    assert s["request_throughput"] > 0 and "num_preemptions" in s
    assert s["scheduler_config"]["max_num_batched_tokens"] == 2048
    assert {p["label"] for p in s["frontier"]} == {"budget=512", "budget=2048", "threshold=256",
                                                   "nano (no chunking)"}
    assert [r["label"] for r in s["capacity"]["results"]] == ["vllm (budget 2048)",
                                                         "nano (no chunking)"]
    assert all(len(r["trials"]) == 3 for r in s["capacity"]["results"])
    for png in ("timeline.png", "frontier.png", "capacity.png"):
        assert (tmp_path / png).read_bytes()[:8] == PNG_MAGIC
    html = (tmp_path / "steps.html").read_text()
    assert "<script src" not in html and "<link" not in html
    assert not re.search(r"https?://", html)            # opens with no network
    frames = json.loads(re.search(r"const D=(.*?);\nconst F", html, re.S).group(1))["frames"]
    assert len(frames) == 50
    kinds = {kind for f in frames for kind, _ in f["events"]}
    assert {"admit", "decode", "finish"} <= kinds
    assert "Request throughput" in capsys.readouterr().out


def test_step_viewer_shows_chunks_preemptions_and_block_tables(tmp_path):
    rc = main(["--synthetic", "uniform", "--num-requests", "16", "--prompt-len", "40",
               "--output-len", "60", "--num-gpu-blocks", "20", "--max-num-seqs", "8",
               "--max-num-batched-tokens", "64", "--plots", "", "--trace-steps",
               "--output", str(tmp_path), "--no-progress"])
    assert rc == 0
    html = (tmp_path / "steps.html").read_text()
    frames = json.loads(re.search(r"const D=(.*?);\nconst F", html, re.S).group(1))["frames"]
    kinds = {kind for f in frames for kind, _ in f["events"]}
    assert {"admit", "chunk", "preempt", "finish"} <= kinds
    for f in frames:
        held = [b for r in f["running"] for b in r["blocks"]]
        assert len(held) == len(set(held)) == 20 - f["free"]     # no prefix sharing here
    assert not (tmp_path / "timeline.png").exists()


def test_simulate_mounts_as_a_subcommand():
    parser = argparse.ArgumentParser(prog="kvflow")
    add_simulate_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["simulate", "--scenario", "long-short", "--policy", "static",
                              "--no-enable-chunked-prefill", "--long-prefill-token-threshold",
                              "512"])
    assert args.func.__name__ == "run_simulate"
    assert (args.policy, args.enable_chunked_prefill, args.long_prefill_token_threshold) == (
        "static", False, 512)


def test_bad_input_is_an_error_message_not_a_traceback(tmp_path, capsys):
    assert main(["--output", str(tmp_path), "--no-progress"]) == 2
    assert "give a workload" in capsys.readouterr().err


def test_the_simulator_does_not_import_torch():
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = str(Path(__file__).parent.parent)
    code = ("import sys, kvflow.sim.cli, kvflow.sim.experiment, kvflow.sim.plots, "
            "kvflow.sim.calibrate; assert 'torch' not in sys.modules, 'torch imported'")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": root}, timeout=120)
    assert res.returncode == 0, res.stderr
