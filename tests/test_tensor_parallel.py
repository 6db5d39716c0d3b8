"""Tensor parallelism (issue 17) on CPU: gloo, worker processes with one thread each.

Greedy tokens under TP=2 equal TP=1's on the HF-exact tiny models: floating-point sums run in
another order across ranks, but these models' logits are peaky enough that no argmax flips.
"""
from __future__ import annotations

import itertools
import os
import random
import socket
import subprocess
import sys
import threading

import pytest

from kvflow import LLM, SamplingParams
from kvflow.engine.arg_utils import EngineArgs

# Small enough that the workload below chunks its prefills (32-token steps) and preempts
# (10 blocks of 16 tokens for four requests of 50-95 tokens).
KW = dict(dtype="float32", max_model_len=128, num_threads=1, max_num_batched_tokens=32,
          num_blocks=10, block_size=16)


def _workload() -> tuple[list[list[int]], list[list[int]], SamplingParams, SamplingParams]:
    """(first prompts, later prompts sharing their prefix, greedy params, greedy params with
    logprobs): run in two calls, so that the later ones hit the prefix cache."""
    rng = random.Random(0)
    prefix = [rng.randrange(3, 512) for _ in range(40)]
    first = [prefix + [rng.randrange(3, 512) for _ in range(10)]]
    later = [prefix + [rng.randrange(3, 512) for _ in range(n)] for n in (5, 20, 30)]
    later.append([rng.randrange(3, 512) for _ in range(60)])
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    lp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2,
                        prompt_logprobs=1)
    return first, later, sp, lp


def _run(llm: LLM) -> tuple[list[list[int]], list, object]:
    first, later, sp, lp = _workload()
    outs = llm.generate(first, sp, use_tqdm=False)
    outs += llm.generate(later, [lp] + [sp] * (len(later) - 1), use_tqdm=False)
    return ([list(o.outputs[0].token_ids) for o in outs], outs,
            llm.llm_engine.scheduler.make_stats())


def _tp_equals_tp1(path: str, n: int = 2, **extra) -> None:
    ref_tokens, ref_outs, ref_stats = _run(LLM(path, **KW, **extra))
    llm = LLM(path, tensor_parallel_size=n, **KW, **extra)
    try:
        tokens, outs, stats = _run(llm)
    finally:
        llm.llm_engine.shutdown()
    assert ref_stats.num_preemptions > 0 and ref_stats.prefix_cache_hits > 0   # exercised
    assert stats.num_preemptions == ref_stats.num_preemptions
    assert stats.prefix_cache_hits == ref_stats.prefix_cache_hits
    assert tokens == ref_tokens
    a, b = ref_outs[1], outs[1]     # the request with logprobs, scored on rank 0
    for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
        for tok in x:
            assert y[tok].logprob == pytest.approx(x[tok].logprob, abs=1e-4)
    for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
        for tok in x:
            assert y[tok].logprob == pytest.approx(x[tok].logprob, abs=1e-4)


def test_tp2_greedy_tokens_equal_tp1_on_llama(tiny_llama):
    _tp_equals_tp1(tiny_llama)


def test_tp2_greedy_tokens_equal_tp1_on_qwen2(tiny_qwen2):
    _tp_equals_tp1(tiny_qwen2)


def test_tp2_greedy_tokens_equal_tp1_on_qwen3_with_tied_embeddings(tiny_qwen3):
    _tp_equals_tp1(tiny_qwen3)


def test_tp4_replicates_the_kv_heads_when_ranks_outnumber_them(tiny_llama):
    # 2 KV heads, 4 ranks: each KV head on two ranks. A short run: 4 processes share 2 cores.
    prompts = [[5, 6, 7, 8, 9, 10] * 4, list(range(20, 60))]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    kw = dict(dtype="float32", max_model_len=128, num_threads=1, num_blocks=16)
    ref = [o.outputs[0].token_ids for o in LLM(tiny_llama, **kw).generate(prompts, sp,
                                                                            use_tqdm=False)]
    llm = LLM(tiny_llama, tensor_parallel_size=4, **kw)
    try:
        outs = llm.generate(prompts, sp, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_tp2_with_speculative_decoding_equals_tp1(tiny_llama):
    # several tokens a step per request: the workers learn them from the next step's message
    _tp_equals_tp1(tiny_llama, speculative_config={"method": "ngram",
                                                   "num_speculative_tokens": 3})


@pytest.mark.parametrize("n", [0, -1, True, 2.0, "2"])
def test_a_bad_tensor_parallel_size_raises_value_error_naming_it(n):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineArgs(tensor_parallel_size=n)


@pytest.mark.parametrize("n", [3, 8])
def test_a_tensor_parallel_size_the_model_cannot_split_into_raises_value_error(tiny_llama, n):
    # intermediate_size 128 is not a multiple of 3; 8 ranks exceed the 2 KV heads and 4 heads
    with pytest.raises(ValueError, match=f"tensor_parallel_size={n}"):
        LLM(tiny_llama, tensor_parallel_size=n, **KW)


def test_a_worker_crash_ends_the_engine_with_an_error(tiny_llama):
    llm = LLM(tiny_llama, tensor_parallel_size=2, **KW)
    driver = llm.llm_engine.runner
    worker, inner = driver.procs[0], driver.runner
    steps, execute = itertools.count(), inner.execute_model

    def execute_and_kill_at_step_3(so):
        if next(steps) == 3:        # mid-run: rank 0 has broadcast the step, not yet reduced
            worker.kill()
            worker.wait()
        return execute(so)

    inner.execute_model = execute_and_kill_at_step_3
    first, later, sp, _ = _workload()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            llm.generate(first + later, sp, use_tqdm=False)
        except BaseException as e:     # noqa: BLE001 (the test looks at it)
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "generate hangs after a worker died"
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    assert "worker rank 1" in str(errors[0])
    with pytest.raises(RuntimeError, match="tensor-parallel step failed"):     # stays dead
        llm.generate(first, sp, use_tqdm=False)
    llm.llm_engine.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_variables_join_the_ranks_a_launcher_started(tiny_llama, monkeypatch):
    """As torchrun (one node or several) starts them: rank 1 is `kvflow serve` with RANK=1,
    which runs the worker loop; this process is rank 0 and starts no worker of its own."""
    ref, _, _ = _run(LLM(tiny_llama, **KW))
    rdzv = dict(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    worker = subprocess.Popen(
        [sys.executable, "-m", "kvflow.cli", "serve", tiny_llama, "--tensor-parallel-size", "2",
         "--dtype", "float32", "--max-model-len", "128", "--num-threads", "1"],
        env={**os.environ, **rdzv, "RANK": "1", "LOCAL_RANK": "1"}, stdin=subprocess.DEVNULL)
    try:
        for k, v in {**rdzv, "RANK": "0", "LOCAL_RANK": "0"}.items():
            monkeypatch.setenv(k, v)
        llm = LLM(tiny_llama, tensor_parallel_size=2, **KW)
        assert llm.llm_engine.runner.procs == []
        try:
            tokens, _, _ = _run(llm)
        finally:
            llm.llm_engine.shutdown()
        assert tokens == ref
        assert worker.wait(30) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
