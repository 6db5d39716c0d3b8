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
