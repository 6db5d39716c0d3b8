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

import json
import os
import tempfile

from overhead_common import parser, run, time_steps, workload

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
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    sched, hasher, cfg = create_scheduler(model_dir, n, block_size, 1 << 17, log_stats, hash_algo)
    prompts, tokens = workload(n, seed)      # the same prompts as scheduler_overhead.py
    sp = SamplingParams(max_tokens=4096, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        sched.add_request(Request(f"req-{i}", prompt, sp, None, block_hasher=hasher))
    # Prefill until every request is one token behind: a pure decode state.
    while sched.waiting or any(r.num_tokens - r.num_computed_tokens != 1 for r in sched.running):
        so = sched.schedule()
        sched.update_from_output(so, fake_output(so, tokens, sched.requests))
    assert len(sched.running) == n
    # The fake executor's output for a full decode step, precomputed (kvflow passes a dict).
    ids = [f"req-{i}" for i in range(n)]
    mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                            sampled_token_ids=[tokens[r] for r in ids])
    return sched, mro, cfg


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--log-stats", action="store_true",
                    help="build the scheduler with log_stats=True (vLLM's tests do; "
                         "`vllm serve` does unless --disable-log-stats)")
    ap.add_argument("--hash-algo", default=None,
                    help="prefix-caching hash (CacheConfig.prefix_caching_hash_algo); "
                         "default: vLLM's default")
    a = ap.parse_args()
    import vllm

    model_dir = make_model_dir()
    _, _, cfg = create_scheduler(model_dir, 1, a.block_size, 1024, a.log_stats, a.hash_algo)

    def measure(n: int, seed: int) -> dict:
        sched, mro, _ = build(model_dir, n, seed, a.block_size, a.log_stats, a.hash_algo)
        res = time_steps(sched.schedule, lambda so: sched.update_from_output(so, mro), n, a.steps)
        assert not sched.finished_req_ids and len(sched.running) == n
        return res

    run(f"vLLM {vllm.__version__} V1 Scheduler overhead (log_stats={a.log_stats}, prefix-cache "
        f"hash={cfg.cache_config.prefix_caching_hash_algo})", measure, a)


if __name__ == "__main__":
    main()
