"""Greedy token agreement: quantized weights run as stored vs the same weights dequantized to
float32 (KVFLOW_CPU_QUANT=0), on the default GGUF model or an HF checkpoint with --quantization.

    python benchmarks/quant_agreement.py                    # the embedded SmolLM2 Q4_1 GGUF
    python benchmarks/quant_agreement.py --model DIR --quantization int8

Prints, per prompt, how many of the first N greedy tokens are identical before the two part, and
the totals: prompts whose N tokens are all identical, and the mean identical prefix.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

QUESTIONS = [
    "What is the capital of France?", "Name three colours.", "What is 2 + 2?",
    "Write a haiku about the sea.", "Who wrote Romeo and Juliet?",
    "Explain photosynthesis in one sentence.", "What is the boiling point of water?",
    "List the planets of the solar system.", "Translate 'good morning' into Spanish.",
    "What does a CPU do?", "Give me a recipe for pancakes.", "Why is the sky blue?",
    "What is the largest ocean on Earth?", "Write a Python function that adds two numbers.",
    "What is the speed of light?", "Tell me a short joke.", "How many legs does a spider have?",
    "What language is spoken in Brazil?", "Summarise the plot of Cinderella.",
    "What is machine learning?",
]


def run(args, quant: str) -> list[list[int]]:
    os.environ["KVFLOW_CPU_QUANT"] = quant
    from kvflow import envs
    envs.set_process_defaults()     # first: GOMP_SPINCOUNT must be set before torch loads
    from kvflow import LLM, SamplingParams
    kw = {"quantization": args.quantization} if args.quantization else {}
    llm = LLM(args.model, max_model_len=1024, num_threads=args.threads, **kw)
    sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    return [o.outputs[0].token_ids for o in llm.chat(convs, sp, use_tqdm=False)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--quantization", choices=("int8", "q4"))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    ours, ref = run(args, "1"), run(args, "0")
    same = []
    for q, a, b in zip(QUESTIONS, ours, ref):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        same.append(n)
        print(f"{n:4d}/{len(a)}  {q}")
    full = sum(n == args.tokens for n in same)
    print(f"\n{full}/{len(same)} prompts identical for all {args.tokens} tokens; mean identical "
          f"prefix {sum(same) / len(same):.1f} tokens; first token identical in "
          f"{sum(n > 0 for n in same)}/{len(same)}")


if __name__ == "__main__":
    main()
