"""lm-evaluation-harness as an outside judge of `kvflow serve`: the same two small tasks (one
scored by loglikelihood, one by generation; shipped in tests/data/lm_eval) run through lm_eval's
`local-completions` model against `kvflow serve`, and through its `hf` model (HF transformers)
on the same weights, and the two runs are compared score by score and item by item.

Both sides run the default model (the embedded SmolLM2-135M-Instruct GGUF): `kvflow serve` its
quantized blocks as it serves them by default, transformers the same weights dequantized to an
HF directory (gguf_to_hf.py) in float32.
Everything is offline: the task data are local JSON lines files.

    python benchmarks/lm_eval_judge.py [--tasks kvflow_mc,kvflow_gen] [--json OUT]
        [--url http://127.0.0.1:8000]   # a kvflow serve already running (default: start one)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# No dataset hub, no model hub: set before lm_eval / datasets / transformers are imported.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import httpx  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cpu_info import cpu_line  # noqa: E402
from gguf_to_hf import convert  # noqa: E402
from kvflow.model.loader.gguf_loader import default_model_path  # noqa: E402
from kvflow.server.cli import DEFAULT_SERVED_NAME  # noqa: E402

TASK_DIR = ROOT / "tests" / "data" / "lm_eval"
TASKS = ["kvflow_mc", "kvflow_gen"]
# Per-choice loglikelihoods summed over a few tokens: kvflow's quantized kernels round the
# activations to 16 bits per block of 32 (~1.5e-5 of a block's largest value), which moves them by
# up to ~2e-3 nats from float32 HF (observed; two float32 implementations agree to ~1e-4). A
# wrong token boundary or position is off by whole nats.
LOGLIK_TOL = 1e-2


# ---- the two models' inputs ---------------------------------------------------------------------
def hf_dir(cache: Path) -> Path:
    """The default GGUF as an HF float32 directory (converted once per cache dir)."""
    out = cache / "SmolLM2-135M-Instruct-f32"
    if not (out / "model.safetensors").exists():
        convert(default_model_path(), out, "float32")
    return out


def write_tasks(dst: Path) -> Path:
    """The shipped task YAMLs, their data_files made absolute (datasets resolves relative paths
    against the working directory, not the YAML's folder)."""
    import yaml
    dst.mkdir(parents=True, exist_ok=True)
    for src in TASK_DIR.glob("*.yaml"):
        cfg = yaml.safe_load(src.read_text())
        files = cfg["dataset_kwargs"]["data_files"]
        cfg["dataset_kwargs"]["data_files"] = {k: str(TASK_DIR / v) for k, v in files.items()}
        (dst / src.name).write_text(yaml.safe_dump(cfg, sort_keys=False))
    return dst


# ---- kvflow serve ------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_up(proc: subprocess.Popen, url: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"kvflow serve exited with {proc.returncode}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError("kvflow serve did not come up")
        time.sleep(0.25)


@contextlib.contextmanager
def kvflow_serve(num_threads: int, log: Path):
    """`kvflow serve` on the default model as a user starts it (a subprocess), float32."""
    port = _free_port()
    cmd = [sys.executable, "-m", "kvflow.cli", "serve", "--port", str(port), "--dtype",
           "float32", "--num-threads", str(num_threads), "--max-model-len", "1024",
           "--log-level", "warning"]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_up(proc, url)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- the harness -------------------------------------------------------------------------------
def evaluate(model: str, model_args: dict, tasks: list[str], include: Path) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks,
                                   task_manager=TaskManager(include_path=str(include)),
                                   log_samples=True, bootstrap_iters=0, use_cache=None)


def hf_args(hf: Path) -> dict:
    # batch_size 1: no padding, so each item runs the forward pass kvflow runs for it.
    return {"pretrained": str(hf), "dtype": "float32", "device": "cpu", "batch_size": 1}


def kvflow_args(url: str, hf: Path, concurrent: int) -> dict:
    # Token ids, not strings: lm_eval splits context from continuation with its own tokenizer,
    # and reads the continuation's logprobs at token_logprobs[ctxlen:-1]; sending the same ids
    # it counted keeps that boundary exact (a string would be re-tokenized by the server).
    # add_bos_token False on both sides, as the hf model's default for this tokenizer.
    return {"base_url": url + "/v1/completions", "model": DEFAULT_SERVED_NAME,
            "tokenizer": str(hf), "tokenizer_backend": "huggingface",
            "tokenized_requests": True, "add_bos_token": False,
            "num_concurrent": concurrent, "max_retries": 1, "timeout": 120}


def summary(res: dict) -> dict:
    """{task: {metric: value}} without the stderr entries."""
    return {t: {k: v for k, v in r.items() if "," in k and "stderr" not in k}
            for t, r in res["results"].items()}


def items(res: dict) -> dict:
    """{task: [per-doc answer]}: the per-choice loglikelihoods (loglikelihood tasks) or the
    filtered generation (generate_until tasks), in doc order."""
    out = {}
    for task, samples in res["samples"].items():
        rows = []
        for s in sorted(samples, key=lambda s: s["doc_id"]):
            r = s["filtered_resps"]
            rows.append([float(x[0]) for x in r] if isinstance(r[0], (list, tuple)) else r[0])
        out[task] = rows
    return out


def compare(a: dict, b: dict, tol: float = LOGLIK_TOL) -> list[str]:
    """Differences between two runs' items: loglikelihoods further apart than tol, generations
    that are not the same string."""
    diffs = []
    for task in a:
        for i, (x, y) in enumerate(zip(a[task], b[task], strict=True)):
            if isinstance(x, list):
                d = max(abs(p - q) for p, q in zip(x, y, strict=True))
                if not d <= tol or math.isnan(d):
                    diffs.append(f"{task}[{i}]: loglikelihoods {x} vs {y} (max diff {d:.2e})")
            elif x != y:
                diffs.append(f"{task}[{i}]: {x!r} vs {y!r}")
    return diffs


def run(tasks: list[str], cache: Path, url: str | None, num_threads: int,
        concurrent: int) -> dict:
    hf = hf_dir(cache)
    include = write_tasks(cache / "tasks")
    t0 = time.perf_counter()
    hf_res = evaluate("hf", hf_args(hf), tasks, include)
    t_hf = time.perf_counter() - t0
    with contextlib.ExitStack() as stack:
        if url is None:
            url = stack.enter_context(kvflow_serve(num_threads, cache / "kvflow_serve.log"))
        t0 = time.perf_counter()
        kv_res = evaluate("local-completions", kvflow_args(url, hf, concurrent), tasks, include)
        t_kv = time.perf_counter() - t0
    hf_items, kv_items = items(hf_res), items(kv_res)
    return {"cpu": cpu_line(), "tasks": tasks, "loglik_tol": LOGLIK_TOL,
            "scores": {"hf": summary(hf_res), "kvflow": summary(kv_res)},
            "seconds": {"hf": round(t_hf, 1), "kvflow": round(t_kv, 1)},
            "items": {"hf": hf_items, "kvflow": kv_items},
            "diffs": compare(hf_items, kv_items)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "kvflow_lm_eval"))
    ap.add_argument("--url", default=None, help="a running kvflow serve (default: start one)")
    ap.add_argument("--num-threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--num-concurrent", type=int, default=4)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    r = run(a.tasks.split(","), Path(a.cache_dir), a.url, a.num_threads, a.num_concurrent)
    print(f"# {r['cpu']}")
    for side in ("hf", "kvflow"):
        print(f"{side:7s} {r['seconds'][side]:6.1f} s  {json.dumps(r['scores'][side])}")
    for d in r["diffs"]:
        print("DIFF", d)
    same = r["scores"]["hf"] == r["scores"]["kvflow"] and not r["diffs"]
    print("same scores and items" if same else f"{len(r['diffs'])} item(s) differ")
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1))
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
