"""vLLM side of benchmarks/throughput.py: one fresh process per round, run by the parent as

    HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \\
        .venv-vllm/bin/python benchmarks/vllm_throughput_worker.py --spec SPEC --result OUT

SPEC is the JSON throughput.py writes (model dir, exact prompt token ids, output lengths, engine
settings, the parent's spawn time); OUT gets the same fields the kvflow and HF workers write.
Imports nothing from kvflow (vLLM's venv does not have it). Cold start: process start -> first
token of a one-request generate (the workload's first prompt, max_tokens=1) right after LLM().
"""
from __future__ import annotations

import time

_T_PROC = time.time()       # process start, before any heavy import

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--result", required=True)
    a = ap.parse_args()
    for k, v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                 "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}.items():
        os.environ.setdefault(k, v)
    with open(a.spec) as f:
        spec = json.load(f)

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    t_import = time.time()
    kw = dict(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
              max_num_seqs=spec["max_num_seqs"], seed=0)
    if spec["max_num_batched_tokens"]:
        kw["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    kw.update(spec.get("vllm_kwargs") or {})
    llm = LLM(**kw)
    t_load = time.time()
    llm.generate([{"prompt_token_ids": spec["prompts"][0]}],
                 SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    t_first = time.time()

    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=spec["ignore_eos"])
              for n in spec["output_lens"]]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    gen = time.perf_counter() - t0
    out_ids = [list(o.outputs[0].token_ids) for o in outs]

    config = {}
    try:
        vc = llm.llm_engine.vllm_config
        sc = vc.scheduler_config
        config = dict(max_num_seqs=sc.max_num_seqs,
                      max_num_batched_tokens=sc.max_num_batched_tokens,
                      max_model_len=vc.model_config.max_model_len,
                      block_size=vc.cache_config.block_size,
                      enforce_eager=vc.model_config.enforce_eager,
                      compilation_mode=str(getattr(vc.compilation_config, "mode", "?")),
                      extra=spec.get("vllm_kwargs") or {})
    except Exception as e:          # config layout differs across vLLM versions
        config = {"error": repr(e)}

    prompts_ids, want = spec["prompts"], spec["output_lens"]
    prompt_tokens = sum(len(p) for p in prompts_ids)
    out_tokens = sum(min(len(o), w) for o, w in zip(out_ids, want))
    res = dict(engine="vllm", version=vllm.__version__, torch=torch.__version__,
               threads=torch.get_num_threads(), import_s=t_import - _T_PROC,
               load_s=t_load - t_import, t_first_token=t_first, generate_s=gen,
               dtype=spec["dtype"], config=config,
               spawn_time=spec["spawn_time"], proc_start=_T_PROC,
               cold_start_s=t_first - _T_PROC,
               cold_start_from_spawn_s=t_first - spec["spawn_time"],
               num_requests=len(prompts_ids), prompt_tokens=prompt_tokens,
               output_tokens=out_tokens, requested_output_tokens=sum(want),
               total_tokens=prompt_tokens + out_tokens, output_tok_s=out_tokens / gen,
               total_tok_s=(prompt_tokens + out_tokens) / gen,
               short_requests=sum(1 for o, w in zip(out_ids, want) if len(o) < w),
               output_token_ids=out_ids)
    with open(a.result, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
