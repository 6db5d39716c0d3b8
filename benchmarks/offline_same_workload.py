"""kvflow's offline LLM.generate on serve_vs_vllm.sh's workload (random prompts of a fixed token
length, fixed output length, ignore_eos, at most max_num_seqs at once): output tok/s as JSON."""
import argparse
import json
import random
import time

from kvflow import envs
envs.set_process_defaults()     # first: GOMP_SPINCOUNT must be set before torch loads
from kvflow import LLM, SamplingParams  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result", required=True)
    a = p.parse_args()
    llm = LLM(a.model, dtype=a.dtype, max_num_seqs=a.max_num_seqs)
    vocab = llm.llm_engine.model_config.vocab_size
    rng = random.Random(a.seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(a.input_len)]
               for _ in range(a.num_prompts)]
    sp = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
    llm.generate(prompts[:2], sp, use_tqdm=False)       # warm-up, as the client's 2 warmups
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    res = {"duration": dt, "output_tokens": n, "output_throughput": n / dt, "dtype": a.dtype,
           "max_num_seqs": a.max_num_seqs, "num_prompts": a.num_prompts}
    json.dump(res, open(a.result, "w"), indent=1)
    print(f"offline: {n} tokens in {dt:.2f} s = {n / dt:.1f} output tok/s")


if __name__ == "__main__":
    main()
