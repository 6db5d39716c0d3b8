"""Offline throughput: kvflow vs HF transformers static batching vs vLLM's CPU build, one run.

Every engine sees the same prompts (token ids, generated once here and handed to each worker as
JSON), greedy decoding, per-request output lengths, ignore_eos on by default. Each engine x round
runs in a fresh subprocess, so load and cold start are measured cold every time:

  kvflow  .venv/bin/python benchmarks/throughput.py --worker kvflow --spec SPEC --result OUT
          LLM(model, dtype, max_num_seqs, max_num_batched_tokens, max_model_len) + generate()
  hf      .venv/bin/python benchmarks/throughput.py --worker hf --spec SPEC --result OUT
          AutoModelForCausalLM (bf16, sdpa) + generate() on static batches of --hf-batch-size
          prompts in the given order, left padded with an attention mask, do_sample=False,
          min_new_tokens = max_new_tokens = the longest requested output in the batch (with
          ignore_eos): a static batch runs until its longest member is done. Only each
          request's own requested tokens count as output; the rest is padding work.
          --hf-batch-size 8,16,32,0 runs the whole workload once per batch size in the one HF
          process (after its warm-up) and credits HF with the fastest; all times are printed.
  vllm    .venv-vllm/bin/python benchmarks/vllm_throughput_worker.py --spec SPEC --result OUT
          (env HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_NUM_OF_RESERVED_CPU=0)
          LLM(model, dtype, max_model_len, max_num_seqs[, max_num_batched_tokens]) +
          generate() with SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

Rounds alternate the engines in the order given (round 1: kvflow, vllm, hf; round 2: the same);
the table shows medians over rounds, each round's values, and the ratio kvflow / engine of output
tok/s (ratio of the medians; the per-round ratios of runs next to each other are printed too).

Per worker:
  cold start  process start -> first generated token. Every engine gets the same probe: right
              after construction, one request (the workload's first prompt, max_tokens=1) is run
              to its first token (kvflow: LLMEngine.add_request + step() until the token appears,
              on llm.llm_engine; vLLM and HF: generate with max_tokens=1). "cold start" in the
              table counts from the parent's spawn (so includes the interpreter start);
              cold_start_s in the JSON counts from time.time() on the worker's first line.
              The probe is also each engine's warm-up; it is not part of the timed run.
  generate    wall time of the one generate() call over all prompts (HF: all static batches).
  output tok/s  requested output tokens / generate wall; total tok/s adds the prompt tokens.

Workloads (--dataset):
  random      --num-prompts random prompts, ids uniform in [0, vocab); input lengths uniform in
              [--input-len-min, --input-len-max] (or fixed --input-len), output lengths likewise.
              The defaults (64 prompts, input 16..256, output 16..128, seed 0) are nano-vllm's
              bench.py scaled for a 2-core CPU: nano-vllm draws 256 prompts of randint(100, 1024)
              ids and randint(100, 1024) output tokens with Python's random seeded 0 (prompts
              first, then output lengths), which is what this does with the smaller ranges
              (nano-vllm samples at temperature 0.6; this is greedy). Mixed lengths.
  azure-conv, azure-code, sharegpt
              --num-prompts rows sampled (random.Random(seed).sample) from
              kvflow/sim/data/{splitwise_conv,splitwise_code,sharegpt_8k}.csv; prompt and output
              lengths from the row times --trace-scale (rounded, at least 1; "auto": the largest
              scale <= 1 at which every sampled request fits max_model_len), prompts are random
              ids of that length. The scale used is printed. On the 2-core machine a full-size
              Azure conversation prompt (mean 1155 tokens) is slow for HF's padded batches;
              --trace-scale 0.125 (64 rows, seed 0) gives input mean 132 [6..513], output
              mean 30 [2..124].

Examples (the issue's workloads; vLLM's start-up is 35-85 s per round on this machine):
    .venv/bin/python benchmarks/throughput.py --engines kvflow,vllm,hf --dataset random \\
        --num-prompts 256 --input-len 32 --output-len 64 --rounds 1          # headline
    .venv/bin/python benchmarks/throughput.py --engines kvflow,hf --rounds 3  # mixed, vs HF
    .venv/bin/python benchmarks/throughput.py --engines kvflow,hf --dataset azure-conv \\
        --num-prompts 64 --trace-scale 0.125
The model defaults to the 62.9M bench Llama of make_bench_model.py (built on first use).

Noise: the development machine is shared. Each run line says how many cores other processes
used while that worker ran (from /proc/stat minus the worker tree's own CPU time); runs with
<= 0.1 cores are "quiet" and get their own median line. torch's OpenMP threads spin-wait by
default, so kvflow and HF slow down several-fold when another process takes a core (vLLM
binds its threads and suffers less); --wait-idle S waits up to S seconds for an idle machine
before each worker, and --env OMP_WAIT_POLICY=PASSIVE shows how much of a slowdown is spinning.
"""
from __future__ import annotations

import time

_T_PROC = time.time()       # a worker's process start, before any heavy import

import argparse  # noqa: E402
import csv  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
KV_PY = os.path.join(ROOT, ".venv", "bin", "python")
VLLM_PY = os.path.join(ROOT, ".venv-vllm", "bin", "python")
VLLM_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
TRACES = {"azure-conv": "splitwise_conv.csv", "azure-code": "splitwise_code.csv",
          "sharegpt": "sharegpt_8k.csv"}
ENGINES = ("kvflow", "hf", "vllm")
QUIET_CORES = 0.1       # a run counts as quiet if other processes used at most this many cores


# ---------------------------------------------------------------------------------- workload
def make_workload(a, vocab: int, max_model_len: int) -> tuple[list[list[int]], list[int], str]:
    """(prompts as token ids, requested output lengths, a one-line description)."""
    rng = random.Random(a.seed)
    if a.dataset == "random":
        imin, imax = (a.input_len, a.input_len) if a.input_len else (a.input_len_min,
                                                                     a.input_len_max)
        omin, omax = (a.output_len, a.output_len) if a.output_len else (a.output_len_min,
                                                                        a.output_len_max)
        if not (1 <= imin <= imax and 1 <= omin <= omax):
            sys.exit(f"bad length ranges: input {imin}..{imax}, output {omin}..{omax}")
        if imax + omax > max_model_len:
            sys.exit(f"input {imax} + output {omax} exceeds max_model_len {max_model_len}")
        # As nano-vllm's bench.py: all prompts (length, then ids), then all output lengths.
        prompts = [[rng.randint(0, vocab - 1) for _ in range(rng.randint(imin, imax))]
                   for _ in range(a.num_prompts)]
        outs = [rng.randint(omin, omax) for _ in range(a.num_prompts)]
        desc = (f"random ids in [0, {vocab}), input {_rng_str(imin, imax)}, output "
                f"{_rng_str(omin, omax)} tokens, seed {a.seed}")
        return prompts, outs, desc
    from kvflow.sim.workload import data_dir
    path = os.path.join(a.data_dir or data_dir(), TRACES[a.dataset])
    with open(path, newline="") as f:
        rows = [(int(r["num_prefill_tokens"]), int(r["num_decode_tokens"]))
                for r in csv.DictReader(f)]
    if a.num_prompts > len(rows):
        sys.exit(f"{path} has only {len(rows)} rows")
    rows = rng.sample(rows, a.num_prompts)
    longest = max(i + o for i, o in rows)
    if a.trace_scale == "auto":
        scale = min(1.0, max_model_len / longest)
    else:
        scale = float(a.trace_scale)
    prompts, outs = [], []
    for i, o in rows:
        n_in = max(1, round(i * scale))
        n_out = max(1, round(o * scale))
        n_in = min(n_in, max_model_len - 1)
        n_out = min(n_out, max_model_len - n_in)
        prompts.append([rng.randint(0, vocab - 1) for _ in range(n_in)])
        outs.append(n_out)
    ins = [len(p) for p in prompts]
    desc = (f"{a.dataset}: {a.num_prompts} rows sampled (seed {a.seed}) from "
            f"{TRACES[a.dataset]}, lengths x {scale:.4g} (trace-scale {a.trace_scale}; "
            f"max_model_len {max_model_len}) -> input mean {statistics.mean(ins):.0f} "
            f"[{min(ins)}..{max(ins)}], output mean {statistics.mean(outs):.0f} "
            f"[{min(outs)}..{max(outs)}]; random ids in [0, {vocab})")
    return prompts, outs, desc


def _rng_str(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}..{hi}"


# ---------------------------------------------------------------------------------- workers
def _finish(spec: dict, res: dict, out_ids: list[list[int]], result_path: str) -> None:
    prompts, want = spec["prompts"], spec["output_lens"]
    prompt_tokens = sum(len(p) for p in prompts)
    # Useful output: each request's own tokens, at most what it asked for.
    out_tokens = sum(min(len(o), w) for o, w in zip(out_ids, want))
    gen = res["generate_s"]
    res.update(
        spawn_time=spec["spawn_time"], proc_start=_T_PROC,
        cold_start_s=res["t_first_token"] - _T_PROC,
        cold_start_from_spawn_s=res["t_first_token"] - spec["spawn_time"],
        num_requests=len(prompts), prompt_tokens=prompt_tokens, output_tokens=out_tokens,
        requested_output_tokens=sum(want), total_tokens=prompt_tokens + out_tokens,
        output_tok_s=out_tokens / gen, total_tok_s=(prompt_tokens + out_tokens) / gen,
        short_requests=sum(1 for o, w in zip(out_ids, want) if len(o) < w),
        output_token_ids=out_ids)
    with open(result_path, "w") as f:
        json.dump(res, f)


def worker_kvflow(spec: dict, result_path: str) -> None:
    from kvflow import envs
    envs.set_process_defaults()     # first: GOMP_SPINCOUNT must be set before torch loads
    from kvflow import LLM, SamplingParams
    import kvflow
    import torch
    t_import = time.time()
    kw = dict(dtype=spec["dtype"], max_num_seqs=spec["max_num_seqs"],
              max_model_len=spec["max_model_len"])
    if spec["max_num_batched_tokens"]:
        kw["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    if spec["num_threads"]:
        kw["num_threads"] = spec["num_threads"]
    if spec.get("kvflow_quantization"):
        kw["quantization"] = spec["kvflow_quantization"]
    llm = LLM(spec["model"], **kw)
    t_load = time.time()
    # Cold-start probe through LLMEngine: one request, step until its first token.
    eng = llm.llm_engine
    eng.add_request("cold-start", {"prompt_token_ids": spec["prompts"][0]},
                    SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    t_first = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if t_first is None and o.outputs[0].token_ids:
                t_first = time.time()
    assert t_first is not None
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=spec["ignore_eos"])
              for n in spec["output_lens"]]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    gen = time.perf_counter() - t0
    sc = eng.scheduler_config
    res = dict(engine="kvflow", version=kvflow.__version__, torch=torch.__version__,
               threads=torch.get_num_threads(), import_s=t_import - _T_PROC,
               load_s=t_load - t_import, t_first_token=t_first, generate_s=gen,
               dtype=str(eng.dtype).replace("torch.", ""),
               config=dict(max_num_seqs=sc.max_num_seqs,
                           max_num_batched_tokens=sc.max_num_batched_tokens,
                           max_model_len=sc.max_model_len, num_blocks=sc.num_blocks,
                           block_size=sc.block_size))
    _finish(spec, res, [list(o.outputs[0].token_ids) for o in outs], result_path)


def worker_hf(spec: dict, result_path: str) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    from hf_common import left_pad       # this script's folder is sys.path[0]
    t_import = time.time()
    if spec["num_threads"]:
        torch.set_num_threads(spec["num_threads"])
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32,
             "float16": torch.float16}[spec["dtype"]]
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype).eval()
    t_load = time.time()
    pad = spec["pad_token_id"]
    eos = spec["eos_token_id"]
    ignore_eos = spec["ignore_eos"]

    def run(batch: list[list[int]], new: int) -> torch.Tensor:
        ids, mask, width = left_pad(batch, pad)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                             min_new_tokens=new if ignore_eos else 0, do_sample=False,
                             pad_token_id=pad, eos_token_id=eos)
        return out[:, width:]

    def run_all(bs: int) -> tuple[float, list[list[int]], int]:
        prompts, want = spec["prompts"], spec["output_lens"]
        out_ids: list[list[int]] = []
        steps = 0
        t0 = time.perf_counter()
        for s in range(0, len(prompts), bs):
            new = max(want[s:s + bs])
            gen = run(prompts[s:s + bs], new).tolist()
            steps += len(gen) * len(gen[0])
            for row, w in zip(gen, want[s:s + bs]):
                row = row[:w]
                if not ignore_eos and eos in row:
                    row = row[:row.index(eos) + 1]
                out_ids.append(row)
        return time.perf_counter() - t0, out_ids, steps

    with torch.inference_mode():
        run([spec["prompts"][0]], 1)
        t_first = time.time()
        # Several batch sizes: each runs the whole workload; HF is credited with its fastest.
        tried = {}
        for bs in spec["hf_batch_sizes"]:
            bs = bs or len(spec["prompts"])
            tried[bs] = run_all(bs)
        bs = min(tried, key=lambda b: tried[b][0])
        gen_s, out_ids, steps = tried[bs]
    res = dict(engine="hf", version=transformers.__version__, torch=torch.__version__,
               threads=torch.get_num_threads(), import_s=t_import - _T_PROC,
               load_s=t_load - t_import, t_first_token=t_first, generate_s=gen_s,
               dtype=spec["dtype"], generated_incl_padding=steps,
               generate_s_by_batch_size={str(b): v[0] for b, v in tried.items()},
               config=dict(batch_size=bs, attn_implementation=getattr(
                   model.config, "_attn_implementation", None)))
    _finish(spec, res, out_ids, result_path)


# ---------------------------------------------------------------------------------- parent
def machine() -> dict:
    m = {"nproc": len(os.sched_getaffinity(0)), "cpu_count": os.cpu_count(),
         "python": platform.python_version(), "platform": platform.platform()}
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        m["cpu"] = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                         if ln.startswith("model name")), "?")
        flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines()
                      if ln.startswith("flags")), [])
        m["cpu_flags"] = [x for x in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
                          if x in flags]
        with open("/proc/meminfo") as f:
            m["mem_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "kvflow"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        m["kvflow_git"] = sha + (" + uncommitted changes in kvflow/" if dirty else "")
    except OSError:
        pass
    return m


def _cpu_busy_s() -> float:
    """CPU seconds all processes on the machine have used since boot (from /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return float("nan")
    # user nice system idle iowait irq softirq steal ...: everything but idle and iowait.
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    import resource
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def wait_idle(max_wait: float, threshold: float = 0.25) -> float:
    """Wait (up to max_wait s) until other processes use < threshold cores over 2 s; return
    the cores they used in the last sample."""
    t_end = time.time() + max_wait
    while True:
        b0, t0 = _cpu_busy_s(), time.time()
        time.sleep(2.0)
        used = (_cpu_busy_s() - b0) / (time.time() - t0)
        if used < threshold or time.time() >= t_end:
            return used
        time.sleep(3.0)


def run_worker(engine: str, spec: dict, spec_path: str, work: str, tag: str,
               timeout: float, extra_env: dict[str, str], vllm_env: dict[str, str]) -> dict:
    result = os.path.join(work, f"{tag}.result.json")
    log = os.path.join(work, f"{tag}.log")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **extra_env)
    if engine == "vllm":
        cmd = [VLLM_PY, os.path.join(HERE, "vllm_throughput_worker.py")]
        env.update(VLLM_ENV)
        env.update(vllm_env)
    else:
        cmd = [KV_PY, os.path.abspath(__file__), "--worker", engine]
        env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH")
                                    else "")
    # The spawn time is part of the spec the worker reads (set just before writing it; the
    # write itself takes milliseconds).
    load = os.getloadavg()[0]
    busy0, own0 = _cpu_busy_s(), _children_cpu_s()
    spec["spawn_time"] = time.time()
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    with open(log, "w") as lf:
        p = subprocess.run(cmd + ["--spec", spec_path, "--result", result], cwd=ROOT, env=env,
                           stdout=lf, stderr=subprocess.STDOUT, timeout=timeout)
    wall = time.time() - spec["spawn_time"]
    busy, own = _cpu_busy_s() - busy0, _children_cpu_s() - own0
    if p.returncode != 0 or not os.path.exists(result):
        with open(log) as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"{engine} worker failed (rc {p.returncode}); log {log}:\n{tail}")
    with open(result) as f:
        res = json.load(f)
    res["process_wall_s"] = wall
    res["loadavg_before"], res["loadavg_after"] = load, os.getloadavg()[0]
    # How busy the machine was with other work while this worker ran (the worker's own CPU
    # time, its children's included, subtracted): average cores taken by others.
    res["worker_cpu_s"] = own
    res["others_cores"] = max(0.0, busy - own) / wall
    res["log"] = log
    return res


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Greedy outputs of two engines: first-token agreement and mean common-prefix fraction."""
    first = sum(1 for x, y in zip(a, b) if x[:1] == y[:1]) / len(a)
    frac = []
    for x, y in zip(a, b):
        k = 0
        for u, v in zip(x, y):
            if u != v:
                break
            k += 1
        frac.append(k / max(len(x), 1))
    return {"first_token": first, "prefix_fraction": statistics.mean(frac)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--worker", choices=("kvflow", "hf"), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--engines", default="kvflow,vllm,hf",
                    help="comma-separated subset of kvflow,hf,vllm (run in this order each round)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--dataset", choices=("random",) + tuple(TRACES), default="random")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, help="fixed input length (overrides min/max)")
    ap.add_argument("--input-len-min", type=int, default=16)
    ap.add_argument("--input-len-max", type=int, default=256)
    ap.add_argument("--output-len", type=int, help="fixed output length (overrides min/max)")
    ap.add_argument("--output-len-min", type=int, default=16)
    ap.add_argument("--output-len-max", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--trace-scale", default="auto",
                    help="traces: multiply lengths by this; 'auto' = fit max_model_len")
    ap.add_argument("--data-dir", default=None, help="default: the traces kvflow ships")
    ap.add_argument("--model", help="HF checkpoint dir (default: the bench Llama of "
                                    "make_bench_model.py, built if missing)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--kvflow-quantization", choices=("int8", "q4"),
                    help="kvflow only: quantize the weights at load (activations in --dtype)")
    ap.add_argument("--max-model-len", type=int,
                    help="default: the model's max_position_embeddings")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int,
                    help="kvflow and vLLM; default: each engine's own default")
    ap.add_argument("--hf-batch-size", default="256",
                    help="HF static batch size (0 = all prompts in one batch); a comma-separated "
                         "list runs the workload once per size in one HF process and credits HF "
                         "with its fastest (all sizes' times are printed)")
    ap.add_argument("--num-threads", type=int, help="torch threads for kvflow and HF "
                                                    "(default: torch's default)")
    ap.add_argument("--vllm-kwargs", default="{}",
                    help="extra vllm.LLM keyword arguments as JSON, e.g. '{\"enforce_eager\": true}'")
    ap.add_argument("--wait-idle", type=float, default=0, metavar="S",
                    help="before each worker, wait up to S seconds for the machine to be idle "
                         "(other processes < 0.25 cores over 2 s)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment variable for every worker (repeatable), e.g. "
                         "OMP_WAIT_POLICY=PASSIVE")
    ap.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment variable for the vLLM worker only, e.g. vLLM's "
                         "recommended LD_PRELOAD=$PWD/.venv-vllm/lib/libiomp5.so")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per worker")
    ap.add_argument("--work-dir", help="where specs, logs and per-run results go "
                                       "(default: a new temp dir)")
    ap.add_argument("--json", help="write the summary (and per-run results) here")
    a = ap.parse_args()

    if a.worker:
        with open(a.spec) as f:
            spec = json.load(f)
        {"kvflow": worker_kvflow, "hf": worker_hf}[a.worker](spec, a.result)
        return

    t_run = time.time()
    engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in ENGINES]
    if bad or not engines:
        sys.exit(f"unknown engine(s) {bad}; choose from {ENGINES}")
    if "vllm" in engines and not os.path.exists(VLLM_PY):
        sys.exit(f"{VLLM_PY} missing: run bash benchmarks/install_vllm_cpu.sh")
    if a.model is None:
        sys.path.insert(0, HERE)
        from make_bench_model import ensure_model
        a.model = ensure_model()
    a.model = os.path.abspath(a.model)
    with open(os.path.join(a.model, "config.json")) as f:
        cfg = json.load(f)
    vocab = cfg["vocab_size"]
    max_model_len = a.max_model_len or cfg.get("max_position_embeddings", 2048)
    eos = cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    pad = cfg.get("pad_token_id")
    pad = eos if pad is None else pad
    prompts, outs, desc = make_workload(a, vocab, max_model_len)
    try:
        hf_sizes = [int(x) for x in a.hf_batch_size.split(",")]
        assert hf_sizes and all(x >= 0 for x in hf_sizes)
    except (ValueError, AssertionError):
        sys.exit(f"--hf-batch-size wants non-negative integers, got {a.hf_batch_size!r}")

    extra_env, vllm_env = _env_pairs(a.env), _env_pairs(a.vllm_env)
    work = a.work_dir or tempfile.mkdtemp(prefix="kvflow-throughput-")
    os.makedirs(work, exist_ok=True)
    spec_path = os.path.join(work, "spec.json")
    spec = dict(model=a.model, dtype=a.dtype, max_model_len=max_model_len,
                max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                hf_batch_sizes=hf_sizes, num_threads=a.num_threads,
                kvflow_quantization=a.kvflow_quantization, ignore_eos=a.ignore_eos,
                eos_token_id=eos, pad_token_id=pad,
                vllm_kwargs=json.loads(a.vllm_kwargs), prompts=prompts, output_lens=outs,
                spawn_time=0.0)
    m = machine()
    load0 = os.getloadavg()
    ins = [len(p) for p in prompts]
    print(f"workload: {len(prompts)} prompts; {desc}")
    print(f"  prompt tokens {sum(ins)} (mean {statistics.mean(ins):.1f}), requested output "
          f"tokens {sum(outs)} (mean {statistics.mean(outs):.1f}), ignore_eos={a.ignore_eos}, "
          f"greedy, dtype {a.dtype}")
    print(f"model: {a.model}; max_model_len {max_model_len}, max_num_seqs {a.max_num_seqs}, "
          f"max_num_batched_tokens {a.max_num_batched_tokens or 'engine default'}, "
          f"HF batch {','.join(str(b or len(prompts)) for b in hf_sizes)}"
          + (f"; worker env {extra_env}" if extra_env else "")
          + (f"; vLLM worker env {vllm_env}" if vllm_env else ""))
    print(f"work dir (specs, worker logs): {work}", flush=True)

    runs: dict[str, list[dict]] = {e: [] for e in engines}
    for r in range(1, a.rounds + 1):
        for e in engines:
            if a.wait_idle > 0:
                used = wait_idle(a.wait_idle)
                if used >= 0.25:
                    print(f"(machine still busy after --wait-idle {a.wait_idle:.0f} s: "
                          f"{used:.2f} cores in use)")
            print(f"[round {r}/{a.rounds}] {e:<6} started {time.strftime('%H:%M:%S')} ...",
                  end="", flush=True)
            res = run_worker(e, spec, spec_path, work, f"{e}-r{r}", a.timeout, extra_env, vllm_env)
            res["round"] = r
            runs[e].append(res)
            print(f" output {res['output_tok_s']:8.1f} tok/s, total {res['total_tok_s']:8.1f} "
                  f"tok/s, generate {res['generate_s']:6.2f} s, cold start "
                  f"{res['cold_start_from_spawn_s']:5.2f} s, process {res['process_wall_s']:5.1f} s, "
                  f"other processes used {res['others_cores']:.2f} cores"
                  + (f", {res['short_requests']} requests SHORT" if res['short_requests'] else ""),
                  flush=True)
            if len(res.get("generate_s_by_batch_size", {})) > 1:
                print("    HF generate s by batch size: " + ", ".join(
                    f"{b}: {v:.2f}" for b, v in res["generate_s_by_batch_size"].items())
                    + f" -> best {res['config']['batch_size']}", flush=True)

    summary = summarize(runs, engines)
    load1 = os.getloadavg()
    print()
    print(f"machine: {m.get('cpu', '?')}, nproc {m['nproc']}, {m.get('mem_gib', '?')} GiB, "
          f"flags {' '.join(m.get('cpu_flags', []))}, Python {m['python']}; load average "
          f"{load0[0]:.2f} at start, {load1[0]:.2f} at end; kvflow {m.get('kvflow_git', '?')}")
    for e in engines:
        x = runs[e][0]
        extra = f", vLLM {x['version']}" if e == "vllm" else (
            f", transformers {x['version']}" if e == "hf" else f", kvflow {x['version']}")
        print(f"  {e}: torch {x['torch']}{extra}, {x.get('threads', '?')} threads, "
              f"config {json.dumps(x.get('config', {}))}")
    print()
    hdr = (f"{'engine':<7} {'out tok/s':>10} {'total tok/s':>12} {'cold start s':>13} "
           f"{'load s':>7} {'generate s':>11} {'kvflow/engine':>14}   per-round output tok/s")
    print(hdr)
    print("-" * len(hdr))
    for e in engines:
        s = summary[e]
        ratio = "" if e == "kvflow" or "ratio_kvflow_over" not in s else \
            f"{s['ratio_kvflow_over']:.2f}x"
        print(f"{e:<7} {s['output_tok_s']:>10.1f} {s['total_tok_s']:>12.1f} "
              f"{s['cold_start_s']:>13.2f} {s['load_s']:>7.2f} {s['generate_s']:>11.2f} "
              f"{ratio:>14}   {' / '.join(f'{v:.1f}' for v in s['per_round_output_tok_s'])}")
    print("(medians over rounds; cold start = parent's spawn -> first token of a 1-token probe "
          "request; ratio = kvflow median output tok/s / engine's)")
    for e in engines:
        if e != "kvflow" and "kvflow" in engines:
            rr = summary[e]["per_round_ratio"]
            ag = summary[e].get("agreement")
            print(f"kvflow/{e} per round (same round): {' / '.join(f'{v:.2f}x' for v in rr)}"
                  + (f"; greedy agreement with kvflow (round 1): first token "
                     f"{ag['first_token']:.0%}, mean common prefix {ag['prefix_fraction']:.0%}"
                     if ag else ""))
    noisy = max(x["others_cores"] for rs in runs.values() for x in rs)
    if noisy > QUIET_CORES:
        parts = []
        for e in engines:
            q = [x["output_tok_s"] for x in runs[e] if x["others_cores"] <= QUIET_CORES]
            parts.append(f"{e} {statistics.median(q):.1f} ({len(q)} of {len(runs[e])} runs)"
                         if q else f"{e} - (0 of {len(runs[e])})")
        print(f"quiet runs only (other processes <= {QUIET_CORES} cores), median output tok/s: "
              + ", ".join(parts))
    if noisy > QUIET_CORES:
        print(f"WARNING: the machine was busy: other processes used up to {noisy:.2f} of the "
              f"{m['nproc']} cores during a worker's run; those numbers are unreliable, rerun "
              f"on a quiet machine")
    print(f"total wall {time.time() - t_run:.0f} s")

    if a.json:
        for rs in runs.values():
            for x in rs:
                x.pop("output_token_ids", None)
        spec_out = {k: v for k, v in spec.items() if k not in ("prompts", "output_lens",
                                                                "spawn_time")}
        with open(a.json, "w") as f:
            json.dump({"workload": desc, "args": vars(a), "spec": spec_out,
                       "prompt_lens": ins, "output_lens": outs, "machine": m,
                       "loadavg_start": load0, "loadavg_end": load1, "summary": summary,
                       "runs": runs}, f, indent=2)
        print(f"wrote {a.json}")


def _env_pairs(items: list[str]) -> dict[str, str]:
    env = {}
    for kv in items:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            sys.exit(f"--env/--vllm-env want KEY=VALUE, got {kv!r}")
        env[k] = v
    return env


def summarize(runs: dict[str, list[dict]], engines: list[str]) -> dict:
    med = statistics.median
    summary = {}
    for e in engines:
        rs = runs[e]
        summary[e] = {
            "output_tok_s": med(x["output_tok_s"] for x in rs),
            "total_tok_s": med(x["total_tok_s"] for x in rs),
            "cold_start_s": med(x["cold_start_from_spawn_s"] for x in rs),
            "cold_start_in_process_s": med(x["cold_start_s"] for x in rs),
            "load_s": med(x["load_s"] for x in rs),
            "generate_s": med(x["generate_s"] for x in rs),
            "per_round_output_tok_s": [x["output_tok_s"] for x in rs],
            "per_round_total_tok_s": [x["total_tok_s"] for x in rs],
            "per_round_cold_start_s": [x["cold_start_from_spawn_s"] for x in rs],
            "per_round_others_cores": [x["others_cores"] for x in rs],
        }
        quiet = [x["output_tok_s"] for x in rs if x["others_cores"] <= QUIET_CORES]
        if quiet:
            summary[e]["quiet_output_tok_s"] = statistics.median(quiet)
            summary[e]["quiet_runs"] = len(quiet)
    if "kvflow" in engines:
        k = summary["kvflow"]
        for e in engines:
            if e == "kvflow":
                continue
            summary[e]["ratio_kvflow_over"] = k["output_tok_s"] / summary[e]["output_tok_s"]
            summary[e]["ratio_kvflow_over_total"] = k["total_tok_s"] / summary[e]["total_tok_s"]
            summary[e]["per_round_ratio"] = [
                kv["output_tok_s"] / x["output_tok_s"] for kv, x in zip(runs["kvflow"], runs[e])]
            summary[e]["agreement"] = agreement(runs["kvflow"][0]["output_token_ids"],
                                                runs[e][0]["output_token_ids"])
    return summary


if __name__ == "__main__":
    main()
