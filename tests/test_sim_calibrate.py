"""Calibration recovers the constants that produced a set of step times, and says how wrong the
uncalibrated model was."""
import json

import numpy as np
import pytest

from kvflow.sim import CostConstants, CostModel, get_model
from kvflow.sim.calibrate import StepSample, fit, predict
from kvflow.sim.cli import main
from kvflow.sim.hardware import GPUSpec

# A made-up slow device, so the "measured" steps are far from the H100 defaults.
DEVICE = GPUSpec("test-device", peak_flops=2e12, mem_bandwidth=50e9, mem_bytes=16 << 30,
                 source="test")
SHAPE = get_model("SmolLM2-135M")
TRUE = CostConstants(mfu=0.35, mbu=0.55, step_overhead_s=4e-3, host_s_per_request=30e-6)


def _measured(n=120, noise=0.03, seed=0):
    rng = np.random.default_rng(seed)
    truth = CostModel(SHAPE, DEVICE, TRUE)
    samples = []
    for _ in range(n):
        kind = rng.integers(3)
        reqs = []
        if kind != 1:       # decodes
            reqs += [(1, int(c)) for c in rng.integers(64, 2048, rng.integers(1, 48))]
        if kind != 0:       # a prefill chunk
            n_new = int(rng.integers(16, 1024))
            reqs.append((n_new, n_new + int(rng.integers(0, 1024))))
        t = predict(truth, StepSample(reqs, 0.0)) * (1 + rng.normal(0, noise))
        samples.append(StepSample(reqs, t))
    return samples


def test_fit_recovers_the_constants_and_reports_held_out_error():
    cal = fit(SHAPE, DEVICE, _measured())
    c = cal.constants
    assert c.mfu == pytest.approx(TRUE.mfu, rel=0.15)
    assert c.mbu == pytest.approx(TRUE.mbu, rel=0.15)
    assert c.step_overhead_s == pytest.approx(TRUE.step_overhead_s, rel=0.3)
    assert cal.holdout_mape < 0.05                  # the noise is 3%
    assert cal.default_holdout_mape > 5 * cal.holdout_mape    # the defaults are far off here
    assert "held-out" in cal.report()


def test_cli_calibrate_writes_the_fitted_constants(tmp_path, capsys):
    header = {"model": SHAPE.name, "gpu": {"name": DEVICE.name, "peak_flops": DEVICE.peak_flops,
                                           "mem_bandwidth": DEVICE.mem_bandwidth,
                                           "mem_bytes": DEVICE.mem_bytes, "source": "test"}}
    lines = [json.dumps(header)] + [json.dumps({"seconds": s.seconds, "reqs": s.reqs})
                                    for s in _measured(40, seed=1)]
    path = tmp_path / "steps.jsonl"
    path.write_text("\n".join(lines))
    assert main(["--calibrate", str(path), "--output", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "calibration.json").read_text())
    assert out["holdout_mape"] < 0.08
    assert set(out["constants"]) == {"mfu", "mbu", "step_overhead_s", "host_s_per_request"}
    assert "prediction error" in capsys.readouterr().out
    # The fitted constants load back into a replay.
    rc = main(["--scenario", "long-short", "--model", SHAPE.name, "--cost-constants",
               str(tmp_path / "calibration.json"), "--plots", "", "--output",
               str(tmp_path / "run"), "--no-progress"])
    assert rc == 0
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["cost_model"]["mfu"] == out["constants"]["mfu"]


def _load_benchmark():
    import importlib.util
    import sys
    from pathlib import Path
    if "sim_calibrate_bench" in sys.modules:
        return sys.modules["sim_calibrate_bench"]
    path = Path(__file__).parent.parent / "benchmarks" / "sim_calibrate.py"
    spec = importlib.util.spec_from_file_location("sim_calibrate_bench", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod            # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_calibration_on_real_runner_steps(tiny_llama, tmp_path, capsys):
    """benchmarks/sim_calibrate.py times kvflow's own ModelRunner on the real Scheduler's steps
    (a tiny random Llama here) and the fit on them gives finite constants and an error."""
    import torch

    from kvflow.sim.calibrate import load_samples
    from kvflow.sim.hardware import ModelShape

    bench = _load_benchmark()
    out = tmp_path / "steps.jsonl"
    threads = torch.get_num_threads()
    try:
        rc = bench.main(["--model", tiny_llama, "--requests", "6", "--prompt-median", "24",
                         "--max-prompt", "80", "--max-num-batched-tokens", "32",
                         "--max-num-seqs", "4", "--repeats", "1", "--peak-matmul-n", "256",
                         "--peak-copy-mib", "8", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    header, samples = load_samples(out)
    shape, gpu = ModelShape(**header["model"]), GPUSpec(**header["gpu"])
    assert (shape.num_layers, shape.hidden_size) == (2, 64)
    assert gpu.peak_flops > 0 and gpu.mem_bandwidth > 0
    # Every step the scheduler produced was recorded: each request ran its prompt and all its
    # outputs but the last (sampled, never fed back), prefills chunked by the budget of 32.
    wl = bench.make_workload(6, shape.vocab_size, 0, 24, 80)
    assert sum(n for s in samples for n, _ in s.reqs) == sum(
        len(a.prompt) + a.max_tokens - 1 for a in wl)
    assert samples[0].reqs == [(min(32, len(wl[0].prompt)),) * 2]
    assert any(n > 1 for s in samples for n, _ in s.reqs)
    assert any(len(s.reqs) > 1 and all(n == 1 for n, _ in s.reqs) for s in samples)
    assert all(s.seconds > 0 for s in samples)

    cal = fit(shape, gpu, samples)
    c = cal.constants
    assert all(np.isfinite([c.mfu, c.mbu, c.step_overhead_s, c.host_s_per_request]))
    assert 0 < c.mfu <= 1 and 0 < c.mbu <= 1
    assert np.isfinite(cal.holdout_mape) and np.isfinite(cal.holdout_max_ape)
    printed = capsys.readouterr().out
    assert "prediction error" in printed and "held-out" in printed
    # The file is what `kvflow simulate --calibrate` reads.
    assert main(["--calibrate", str(out), "--output", str(tmp_path / "cal")]) == 0
