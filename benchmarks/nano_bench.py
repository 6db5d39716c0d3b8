"""nano-vllm's benchmark on kvflow: 256 random prompts, sampled outputs, a Qwen3-0.6B shape.

Workload (nano-vllm's bench.py, drawn the same way): random.seed(0); then for each of 256
sequences a prompt of randint(100, 1024) ids, each randint(0, 10000); then for each sequence
max_tokens = randint(100, 1024), temperature 0.6, ignore_eos. That is 142,827 prompt and
133,966 output tokens (checked when run with the defaults). With --max-input / --max-output
below 100, the lower bound of each length becomes the upper one.

Model: Qwen3-0.6B's shape with random bf16 weights (transformers' seeded init; hidden 1024,
28 layers, 16 query / 8 KV heads of 128, FFN 3072, vocab 151,936, tied embeddings: 596M
parameters), saved with a word-level tokenizer under --model-dir (reused when complete).
--tiny: a 2-layer, hidden-64 Qwen3 with a 10,240-word vocabulary, for smoke tests on CPU.

Timing: one warm-up request, then the wall time of one LLM.generate() over all prompts;
throughput = output tokens / that time, as nano-vllm reports it. --hf also times HF transformers
generate() on static batches of --hf-batch-size prompts (in order, left padded, sampling at 0.6,
each batch run to its longest requested output; only requested tokens count). --roofline counts,
for every decode-only step, the bytes a memory-bound step must read (all weights once, plus the
K and V of every context token of every running sequence) and divides by the HBM bandwidth
(--hbm-gbps, or the datasheet figure of a known GPU): the ideal decode time, and that as a
fraction of the measured run. Prefill steps are left out (they are compute-bound).

    python benchmarks/nano_bench.py --device cuda --hf --roofline        # the full workload
    python benchmarks/nano_bench.py --tiny --device cpu --num-seqs 4 --max-input 64 \\
        --max-output 16                                                   # smoke, seconds
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time

UNK, BOS, EOS = 0, 1, 2              # make_bench_model.write_tokenizer's special tokens
NANO_OUTPUT_TOKENS = 133_966        # nano-vllm's README, for the default workload
QWEN3_06B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936,
                 max_position_embeddings=40960)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=128, vocab_size=10240, max_position_embeddings=4096)
COMMON = dict(tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6, hidden_act="silu",
              bos_token_id=BOS, eos_token_id=EOS, pad_token_id=UNK, initializer_range=0.02)
DEFAULTS = dict(num_seqs=256, max_input=1024, max_output=1024, seed=0)


def ensure_model(out: str, tiny: bool) -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    from make_bench_model import is_complete, write_tokenizer
    if is_complete(out):
        return out
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM
    shape = TINY if tiny else QWEN3_06B
    print(f"building a random-weight Qwen3 ({'tiny' if tiny else '0.6B shape'}) in {out}",
          file=sys.stderr)
    torch.manual_seed(0)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)        # init in bf16: half the host memory
    try:
        model = Qwen3ForCausalLM(Qwen3Config(**shape, **COMMON)).eval()
    finally:
        torch.set_default_dtype(saved)
    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=UNK).save_pretrained(tmp)
    write_tokenizer(tmp, shape["vocab_size"], shape["max_position_embeddings"])
    p = os.path.join(tmp, "config.json")
    with open(p) as f:
        c = json.load(f)
    c.update(torch_dtype="bfloat16", architectures=["Qwen3ForCausalLM"])
    with open(p, "w") as f:
        json.dump(c, f, indent=2)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def make_workload(num_seqs: int, max_input: int, max_output: int, seed: int):
    """nano-vllm's draws, in its order: all prompts first, then all output lengths. (A
    Random(seed) draws what random.seed(seed) does, without touching the global state.)"""
    randint = random.Random(seed).randint
    lo_in, lo_out = min(100, max_input), min(100, max_output)
    prompts = [[randint(0, 10000) for _ in range(randint(lo_in, max_input))]
               for _ in range(num_seqs)]
    max_tokens = [randint(lo_out, max_output) for _ in range(num_seqs)]
    return prompts, max_tokens


def hbm_bandwidth(device: str, override_gbps: float | None) -> tuple[float | None, str]:
    if override_gbps:
        return override_gbps * 1e9, f"--hbm-gbps {override_gbps}"
    if device != "cuda":
        return None, "unknown for CPU (pass --hbm-gbps)"
    import torch
    from kvflow.sim.hardware import GPUS
    name = torch.cuda.get_device_name()
    if "H100" in name and "PCIe" in name:
        return 2.0e12, f"{name}: 2.0 TB/s (H100 PCIe datasheet)"
    for key, tag in (("h200", "H200"), ("h100", "H100"), ("a100-40gb", "A100-SXM4-40GB"),
                     ("a100", "A100")):
        if tag in name:
            return GPUS[key].mem_bandwidth, f"{name}: {GPUS[key].source}"
    return None, f"{name}: unknown (pass --hbm-gbps)"


class DecodeBytes:
    """Wraps the runner's execute_model to count what decode-only steps must read."""

    def __init__(self, engine) -> None:
        cfg, dtype = engine.model_config, engine.dtype
        self.weight_bytes = cfg.num_params * dtype.itemsize
        self.kv_per_token = cfg.kv_bytes_per_token(dtype.itemsize)
        self.steps = self.bytes = 0
        runner = engine.runner
        inner = runner.execute_model

        def counting(so, grammar_bitmask=None):
            n = so.num_scheduled_tokens
            if n and all(v == 1 for v in n.values()):
                ctx = sum(so.context_lens().values())
                self.steps += 1
                self.bytes += self.weight_bytes + ctx * self.kv_per_token
            return inner(so, grammar_bitmask)

        runner.execute_model = counting


def run_kvflow(a, model_dir: str, prompts, max_tokens) -> dict:
    from kvflow import LLM, SamplingParams
    t = time.perf_counter()
    llm = LLM(model_dir, device=a.device, dtype=a.dtype, attention_backend=a.attention_backend,
              max_model_len=a.max_input + a.max_output, max_num_seqs=a.max_num_seqs,
              max_num_batched_tokens=a.max_num_batched_tokens, enforce_eager=a.enforce_eager,
              gpu_memory_utilization=a.gpu_memory_utilization)
    eng = llm.llm_engine
    load_s = time.perf_counter() - t
    llm.generate([{"prompt_token_ids": prompts[0][:16]}], SamplingParams(max_tokens=4),
                 use_tqdm=False)                                              # warm-up
    counter = DecodeBytes(eng) if a.roofline else None
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    _sync(eng.device)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
    _sync(eng.device)
    dt = time.perf_counter() - t0
    got = sum(len(o.outputs[0].token_ids) for o in outs)
    assert got == sum(max_tokens), (got, sum(max_tokens))
    res = dict(engine="kvflow", device=eng.device, dtype=str(eng.dtype).replace("torch.", ""),
               attention_backend=eng.attention_backend, num_blocks=eng.scheduler_config.num_blocks,
               load_s=load_s, generate_s=dt, output_tokens=got, output_tok_s=got / dt)
    if counter is not None:
        bw, source = hbm_bandwidth(eng.device, a.hbm_gbps)
        res.update(decode_steps=counter.steps, decode_bytes=counter.bytes,
                   weight_bytes=counter.weight_bytes, hbm_source=source)
        if bw:
            ideal = counter.bytes / bw
            res.update(hbm_bytes_per_s=bw, ideal_decode_s=ideal, roofline_fraction=ideal / dt)
    return res


def run_hf(a, model_dir: str, prompts, max_tokens, device: str, dtype_name: str) -> dict:
    """HF in kvflow's resolved dtype, on the same device."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM
    dtype = getattr(torch, dtype_name)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    bs = a.hf_batch_size or len(prompts)

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from hf_common import left_pad

    def run(batch, new):
        ids, mask, _ = left_pad(batch, UNK)
        # min_new_tokens = max_new_tokens: EOS never ends a row (ignore_eos); top_k 0: plain
        # temperature sampling, as kvflow and nano-vllm do.
        model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                       max_new_tokens=new, min_new_tokens=new, do_sample=True, temperature=0.6,
                       top_k=0, top_p=1.0, pad_token_id=UNK, eos_token_id=EOS)

    with torch.inference_mode():
        run([prompts[0][:16]], 4)                                              # warm-up
        _sync(device)
        t0 = time.perf_counter()
        for s in tqdm(range(0, len(prompts), bs), desc="HF static batches"):
            run(prompts[s:s + bs], max(max_tokens[s:s + bs]))
        _sync(device)
        dt = time.perf_counter() - t0
    got = sum(max_tokens)
    return dict(engine="hf", batch_size=bs, dtype=str(dtype).replace("torch.", ""),
                generate_s=dt, output_tokens=got, output_tok_s=got / dt)


def _sync(device: str) -> None:
    if device == "cuda":
        import torch
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-seqs", type=int, default=DEFAULTS["num_seqs"])
    ap.add_argument("--max-input", type=int, default=DEFAULTS["max_input"])
    ap.add_argument("--max-output", type=int, default=DEFAULTS["max_output"])
    ap.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument("--tiny", action="store_true", help="a tiny Qwen3 instead of the 0.6B shape")
    ap.add_argument("--model-dir", default=None,
                    help="default /tmp/kvflow-bench/qwen3-0.6b-random (or qwen3-tiny-random)")
    ap.add_argument("--max-num-seqs", type=int, default=512, help="nano-vllm's default")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384,
                    help="nano-vllm's default")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--hf", action="store_true", help="also time HF transformers generate()")
    ap.add_argument("--hf-batch-size", type=int, default=64, help="0: one batch of all prompts")
    ap.add_argument("--roofline", action="store_true")
    ap.add_argument("--hbm-gbps", type=float, default=None, help="memory bandwidth, GB/s")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    model_dir = a.model_dir or ("/tmp/kvflow-bench/qwen3-tiny-random" if a.tiny
                                else "/tmp/kvflow-bench/qwen3-0.6b-random")
    ensure_model(model_dir, a.tiny)
    prompts, max_tokens = make_workload(a.num_seqs, a.max_input, a.max_output, a.seed)
    n_in, n_out = sum(map(len, prompts)), sum(max_tokens)
    if all(getattr(a, k) == v for k, v in DEFAULTS.items()):
        assert n_out == NANO_OUTPUT_TOKENS, n_out
    print(f"workload: {a.num_seqs} sequences, {n_in:,} prompt tokens, {n_out:,} output tokens "
          f"(nano-vllm's default workload has {NANO_OUTPUT_TOKENS:,})")
    results = {"workload": dict(num_seqs=a.num_seqs, max_input=a.max_input,
                                max_output=a.max_output, seed=a.seed, prompt_tokens=n_in,
                                output_tokens=n_out), "model_dir": model_dir}
    kv = results["kvflow"] = run_kvflow(a, model_dir, prompts, max_tokens)
    print(f"kvflow ({kv['device']}, {kv['dtype']}, {kv['attention_backend']}): "
          f"{kv['output_tokens']:,} tok in {kv['generate_s']:.2f} s, "
          f"{kv['output_tok_s']:,.2f} tok/s (load {kv['load_s']:.1f} s)")
    if a.roofline:
        line = (f"roofline: {kv['decode_steps']} decode steps read {kv['decode_bytes'] / 1e9:.2f} "
                f"GB (weights {kv['weight_bytes'] / 1e9:.3f} GB per step); HBM {kv['hbm_source']}")
        if "roofline_fraction" in kv:
            line += (f"; ideal decode time {kv['ideal_decode_s']:.3f} s = "
                     f"{kv['roofline_fraction']:.1%} of the measured run")
        print(line)
    if a.hf:
        hf = results["hf"] = run_hf(a, model_dir, prompts, max_tokens, kv["device"], kv["dtype"])
        print(f"HF transformers (static batches of {hf['batch_size']}, {hf['dtype']}): "
              f"{hf['generate_s']:.2f} s, {hf['output_tok_s']:,.2f} tok/s; kvflow / HF = "
              f"{kv['output_tok_s'] / hf['output_tok_s']:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
