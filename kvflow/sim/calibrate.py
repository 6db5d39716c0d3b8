"""Fit the cost model's constants to measured step times and report the prediction error.

Input: a JSON-lines file, one measured step per line,
    {"seconds": 0.0123, "reqs": [[num_new_tokens, context_len_after], ...]}
optionally preceded by a header line {"model": ..., "gpu": {...}} that names the shape and the
hardware peaks the measurements were taken on (benchmarks/sim_calibrate.py writes such a file
from steps of kvflow's own engine: real SchedulerOutputs run by the real ModelRunner on the CPU).
Other keys on a line (a step index, the header's "measured" notes) are ignored.

The fit: for each (mfu, mbu) on a log grid (then a finer one around the best), the overheads
(fixed per step, and per request) are the non-negative weighted least-squares solution, weights
1/seconds^2 so that the fit minimises *relative* error. Half the samples (every other one) are
held out; the report gives the mean and max absolute percentage error on both halves.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvflow.sim.cost_model import CostConstants, CostModel, step_totals
from kvflow.sim.hardware import GPUSpec, ModelShape


@dataclass(slots=True)
class StepSample:
    reqs: list[tuple[int, int]]     # (tokens computed this step, context length after it)
    seconds: float


@dataclass(slots=True)
class Calibration:
    constants: CostConstants
    fit_mape: float                 # mean |predicted - measured| / measured, fitting half
    holdout_mape: float             # the same on the held-out half
    holdout_max_ape: float
    default_holdout_mape: float     # what the uncalibrated constants would have scored
    num_samples: int

    def report(self) -> str:
        c = self.constants
        return (f"fitted on {self.num_samples // 2 + self.num_samples % 2} steps, checked on "
                f"{self.num_samples // 2}: mfu={c.mfu:.3f} mbu={c.mbu:.3f} "
                f"step_overhead={c.step_overhead_s * 1e3:.3f} ms "
                f"host_per_request={c.host_s_per_request * 1e6:.1f} us\n"
                f"prediction error: fit half {self.fit_mape:.1%} mean; held-out half "
                f"{self.holdout_mape:.1%} mean, {self.holdout_max_ape:.1%} max "
                f"(uncalibrated constants: {self.default_holdout_mape:.1%} mean)")


def load_samples(path: str | Path) -> tuple[dict, list[StepSample]]:
    header, samples = {}, []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        d = json.loads(line)
        if "seconds" in d:
            samples.append(StepSample([tuple(x) for x in d["reqs"]], float(d["seconds"])))
        else:
            header = d
    return header, samples


def _features(shape: ModelShape, gpu: GPUSpec, samples: list[StepSample]) -> dict[str, np.ndarray]:
    """Per-sample times at 100% of peak, split by roofline term, plus the request count."""
    unit = CostModel(shape, gpu, CostConstants(1.0, 1.0, 0.0, 0.0))
    rows = []
    for s in samples:
        nreq, tok, dec, dctx, pairs, pkv = step_totals(s.reqs)
        rows.append((nreq, tok * unit.t_token + nreq * unit.t_lm_head, unit.t_weights,
                     dctx * unit.t_pair, (dctx + dec) * unit.t_kv,
                     pairs * unit.t_pair, pkv * unit.t_kv))
    a = np.array(rows, dtype=np.float64).reshape(-1, 7)
    return {k: a[:, j] for j, k in enumerate(("nreq", "lin_c", "lin_m", "dec_c", "dec_m",
                                              "pre_c", "pre_m"))}


def _roofline(f: dict[str, np.ndarray], mfu: np.ndarray, mbu: np.ndarray) -> np.ndarray:
    """Kernel time for every (mfu, mbu) pair (rows) and sample (columns)."""
    cf, cm = (1.0 / mfu)[:, None], (1.0 / mbu)[:, None]
    return (np.maximum(f["lin_c"] * cf, f["lin_m"] * cm)
            + np.maximum(f["dec_c"] * cf, f["dec_m"] * cm)
            + np.maximum(f["pre_c"] * cf, f["pre_m"] * cm))


def _overheads(g: np.ndarray, nreq: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Best non-negative (fixed, per-request) overheads for each row of kernel times g."""
    w = 1.0 / y**2
    r = y[None, :] - g                                  # residual the overheads must explain
    s1, sn, snn = w.sum(), (w * nreq).sum(), (w * nreq**2).sum()
    b1, bn = (r * w).sum(1), (r * w * nreq).sum(1)
    det = s1 * snn - sn * sn
    if det > 1e-30 * s1 * snn:
        o = (snn * b1 - sn * bn) / det
        h = (s1 * bn - sn * b1) / det
    else:                                               # every sample has the same batch size
        o, h = b1 / s1, np.zeros_like(b1)
    # Clamp to >= 0 and refit the other one alone.
    neg_h = h < 0
    o = np.where(neg_h, b1 / s1, o)
    h = np.where(neg_h, 0.0, h)
    neg_o = o < 0
    h = np.where(neg_o, np.maximum(bn / snn, 0.0), h)
    o = np.where(neg_o, 0.0, o)
    return o, h


def _ape(pred: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.abs(pred - y) / y


def fit(shape: ModelShape, gpu: GPUSpec, samples: list[StepSample]) -> Calibration:
    if len(samples) < 4:
        raise ValueError("calibration needs at least 4 measured steps")
    f_all = _features(shape, gpu, samples)
    y_all = np.array([s.seconds for s in samples])
    fit_idx, hold_idx = np.arange(0, len(samples), 2), np.arange(1, len(samples), 2)
    f = {k: v[fit_idx] for k, v in f_all.items()}
    y = y_all[fit_idx]

    def search(mfus: np.ndarray, mbus: np.ndarray):
        mf, mb = (a.ravel() for a in np.meshgrid(mfus, mbus, indexing="ij"))
        g = _roofline(f, mf, mb)
        o, h = _overheads(g, f["nreq"], y)
        pred = g + o[:, None] + h[:, None] * f["nreq"][None, :]
        err = (((pred - y) / y) ** 2).mean(1)
        k = int(np.argmin(err))
        return mf[k], mb[k], o[k], h[k]

    grid = np.geomspace(1e-3, 1.0, 61)
    mf, mb, o, h = search(grid, grid)
    step = grid[1] / grid[0]
    fine = np.geomspace(1 / step, step, 21)
    mf, mb, o, h = search(np.clip(mf * fine, 1e-4, 1.0), np.clip(mb * fine, 1e-4, 1.0))
    consts = CostConstants(float(mf), float(mb), float(o), float(h))

    def ape_with(c: CostConstants, idx: np.ndarray) -> np.ndarray:
        ff = {k: v[idx] for k, v in f_all.items()}
        pred = (_roofline(ff, np.array([c.mfu]), np.array([c.mbu]))[0] + c.step_overhead_s
                + c.host_s_per_request * ff["nreq"])
        return _ape(pred, y_all[idx])

    hold = ape_with(consts, hold_idx) if len(hold_idx) else np.array([np.nan])
    return Calibration(consts, float(ape_with(consts, fit_idx).mean()), float(hold.mean()),
                       float(hold.max()), float(ape_with(CostConstants(), hold_idx).mean()),
                       len(samples))


def errors(shape: ModelShape, gpu: GPUSpec, constants: CostConstants,
           samples: list[StepSample]) -> np.ndarray:
    """|predicted - measured| / measured of each sample under the given constants (e.g. to check
    constants fitted on one set of steps against another)."""
    cost = CostModel(shape, gpu, constants)
    return np.array([abs(predict(cost, s) - s.seconds) / s.seconds for s in samples])


def predict(cost: CostModel, sample: StepSample) -> float:
    """The cost model's time for a measured step (a convenience for reports and tests)."""
    return cost.time_from_totals(*step_totals(sample.reqs))
