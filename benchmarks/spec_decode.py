"""N-gram speculative decoding against none, on the default model, in one process, alternating.

Input-grounded workloads built from texts every Python install ships (the standard library's
source files): "edit" asks the model to rewrite a code excerpt with one change, "answer" asks a
question about a documentation passage (a module docstring) to be answered from it. Batch 1:
requests one after another, output tok/s = tokens / time; concurrency: all prompts at once.
Both engines are built once; each round runs plain then speculative (then swaps the order next
round). Prints a table and writes JSON.

    python benchmarks/spec_decode.py --rounds 3 --json docs/spec_decode/cpu.json
"""
from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time

from cpu_info import cpu_line
from kvflow import envs
envs.set_process_defaults()     # first: GOMP_SPINCOUNT must be set before torch loads
from kvflow import LLM, SamplingParams  # noqa: E402

DOC_MODULES = ["textwrap", "heapq", "bisect", "fnmatch", "shlex", "string", "functools",
               "difflib"]
CODE = [("textwrap", "dedent"), ("heapq", "merge"), ("difflib", "get_close_matches"),
        ("fnmatch", "translate"), ("shlex", "split"), ("functools", "total_ordering"),
        ("json.encoder", "py_encode_basestring"), ("string", "capwords")]


def edit_prompts(n: int) -> list[list[dict]]:
    import importlib
    out = []
    for mod, name in CODE[:n]:
        src = inspect.getsource(getattr(importlib.import_module(mod), name))[:1500]
        out.append([{"role": "user", "content":
                     f"Here is a Python function:\n\n```python\n{src}\n```\n\nRewrite the whole "
                     f"function with a docstring line added at the top. Output only the code."}])
    return out


def answer_prompts(n: int) -> list[list[dict]]:
    import importlib
    out = []
    for mod in DOC_MODULES[:n]:
        doc = (importlib.import_module(mod).__doc__ or "")[:1500]
        out.append([{"role": "user", "content":
                     f"Read this documentation:\n\n{doc}\n\nUsing only the text above, explain "
                     f"what the `{mod}` module provides. Quote the text where you can."}])
    return out


def run(llm: LLM, convs: list, sp: SamplingParams, batch1: bool) -> tuple[float, int, dict]:
    core = llm.llm_engine.engine_core
    st0 = core.scheduler.spec_stats.copy()
    t0 = time.perf_counter()
    if batch1:
        outs = [llm.chat(c, sp, use_tqdm=False)[0] for c in convs]
    else:
        outs = llm.chat(convs, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    st = core.scheduler.spec_stats
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    spec = {"drafts": st.num_drafts - st0.num_drafts,
            "draft_tokens": st.num_draft_tokens - st0.num_draft_tokens,
            "accepted": st.num_accepted_tokens - st0.num_accepted_tokens}
    spec["tokens"] = [o.outputs[0].token_ids for o in outs]
    return dt, n, spec


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=4, help="per batch-1 workload")
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json")
    a = p.parse_args()
    spec_cfg = {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_min": 2,
                "prompt_lookup_max": 4}
    kw = dict(dtype="float32", max_model_len=4096, device=a.device)
    if a.device == "cuda":
        kw["num_blocks"] = 8192      # two engines share the GPU: a fixed cache each
    engines = {"plain": LLM(**kw), "ngram": LLM(**kw, speculative_config=spec_cfg)}
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    conc = (edit_prompts(8) + answer_prompts(8)) * (a.concurrency // 16 + 1)
    work = {"edit (batch 1)": (edit_prompts(a.num_prompts), True),
            "answer (batch 1)": (answer_prompts(a.num_prompts), True),
            f"mixed ({a.concurrency} at once)": (conc[:a.concurrency], False)}
    for llm in engines.values():
        llm.chat(work["edit (batch 1)"][0][0], SamplingParams(max_tokens=4), use_tqdm=False)
    res = {name: {e: [] for e in engines} for name in work}
    for r in range(a.rounds):
        for name, (convs, batch1) in work.items():
            order = list(engines) if r % 2 == 0 else list(engines)[::-1]
            toks = {}
            for e in order:
                dt, n, spec = run(engines[e], convs, sp, batch1)
                toks[e] = spec.pop("tokens")
                res[name][e].append({"s": dt, "tokens": n, "tok_s": n / dt, **spec})
                print(f"round {r} {name:22s} {e:6s} {n:5d} tok {dt:7.2f} s {n / dt:7.1f} tok/s "
                      f"{spec}", flush=True)
            res[name]["same_tokens"] = toks["plain"] == toks["ngram"]
    print(f"\nCPU: {cpu_line()}\n")
    print("| workload | plain tok/s | ngram tok/s | speedup (median of rounds) | acceptance | "
          "tokens per verification step | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for name, d in res.items():
        ratios = [s["tok_s"] / p_["tok_s"] for s, p_ in zip(d["ngram"], d["plain"])]
        dr = sum(x["draft_tokens"] for x in d["ngram"])
        acc = sum(x["accepted"] for x in d["ngram"])
        nd = sum(x["drafts"] for x in d["ngram"])
        print(f"| {name} | {statistics.median(x['tok_s'] for x in d['plain']):.1f} | "
              f"{statistics.median(x['tok_s'] for x in d['ngram']):.1f} | "
              f"**{statistics.median(ratios):.2f}x** ({', '.join(f'{x:.2f}' for x in ratios)}) | "
              f"{acc / dr if dr else 0:.0%} | {1 + acc / nd if nd else 1:.2f} | "
              f"{d['same_tokens']} |")
    if a.json:
        json.dump({"cpu": cpu_line(), "args": vars(a), "results": res}, open(a.json, "w"),
                  indent=1)


if __name__ == "__main__":
    main()
