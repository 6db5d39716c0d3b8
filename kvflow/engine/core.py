"""EngineCore: the scheduler and the model runner, stepping on token ids only.

It runs in the frontend's process (LLMEngine, a thread of AsyncLLM) or in a process of its own
(kvflow/engine/core_proc.py); either way it takes EngineCoreRequests and aborts, and returns
EngineCoreOutputs. Text (tokenizer, detokenizer, stop strings) is the frontend's.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import torch

from kvflow.core import Request, RequestStatus, Scheduler, SchedulerConfig
from kvflow.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from kvflow.core.spec_decode import NgramProposer
from kvflow.engine.arg_utils import EngineArgs
from kvflow.engine.executor import Executor, UniProcExecutor
from kvflow.engine.messages import EngineCoreOutputs, EngineCoreRequest, Ready
from kvflow.model.attention.selector import make_backend, resolve_attention_backend, resolve_device
from kvflow.model.distributed.parallel import max_kv_heads
from kvflow.model.loader.model_loader import Checkpoint, open_checkpoint
from kvflow.model.runner.kv_cache import num_blocks_for_memory
from kvflow.model.runner.model_runner import ModelRunner

if TYPE_CHECKING:
    from kvflow.engine.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)

_DEFAULT_KV_CACHE_MEMORY = 2 << 30     # bytes; vLLM's CPU backend is usually run with 2-4 GiB


class EngineCore:
    def __init__(self, args: EngineArgs, ckpt: Checkpoint | None = None) -> None:
        t0 = time.perf_counter()
        device = resolve_device(args.device)
        backend_name = resolve_attention_backend(args.attention_backend, device)
        backend = make_backend(backend_name, device)    # its errors come before any loading
        self.device, self.attention_backend = device, backend_name
        if args.num_threads is not None:
            torch.set_num_threads(args.num_threads)
        ckpt = ckpt if ckpt is not None else open_checkpoint(args.model)
        # Load (and, under tensor parallelism, start the workers), size the KV cache, build.
        self.model_executor = ex = _executor_class(args)(args, ckpt, device, backend)
        try:
            cfg, dtype = ex.model_config, ex.dtype
            self.model_config, self.dtype = cfg, dtype
            self.scheduler_config = _scheduler_config(args, cfg, dtype, device, ex.model,
                                                      backend, ex.max_concurrent_batches > 1)
            ex.initialize(self.scheduler_config)
        except BaseException:
            ex.shutdown()
            raise
        self.scheduler = Scheduler(self.scheduler_config)
        spec = self.scheduler_config.speculative_config
        self.proposer = NgramProposer(spec, self.scheduler_config.max_model_len) if spec else None
        # Async scheduling: the steps in flight, oldest first (at most two: one computing, one
        # scheduled behind it): [SchedulerOutput, Future, start time, ids finished since].
        self.batch_queue: collections.deque | None = (
            collections.deque() if self.scheduler_config.async_scheduling else None)
        self._errors: list[EngineCoreOutput] = []   # requests refused by add_request
        # Made at the first request with a grammar (engines without any pay nothing); the
        # checkpoint is kept for its tokenizer, not its weights.
        self.structured_output_manager = None
        self._tokenizer_ckpt = dataclasses.replace(ckpt, weights=None)
        self.load_time = time.perf_counter() - t0

    @property
    def runner(self) -> ModelRunner:
        """This process's model runner (rank 0's under tensor parallelism)."""
        return self.model_executor.runner

    def ready_message(self) -> Ready:
        return Ready(self.model_config, self.scheduler_config,
                     str(self.dtype).replace("torch.", ""), self.device, self.attention_backend,
                     self.load_time)

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, r: EngineCoreRequest) -> None:
        """The frontend validated r; a refusal here is a bug, reported as that request's error."""
        try:
            self.model_executor.check_sampling_params(r.sampling_params)
            grammar = r.sampling_params.structured_outputs
            if grammar is not None:     # compiled first: a grammar xgrammar refuses is a ValueError
                self._structured_outputs().add_request(r.request_id, grammar)
            try:
                self.scheduler.add_request(Request(
                    r.request_id, r.prompt_token_ids, r.sampling_params,
                    eos_token_id=r.eos_token_id, arrival_time=r.arrival_time,
                    priority=r.priority))
            except ValueError:
                self._release_grammars((r.request_id,))
                raise
        except ValueError as e:
            logger.error("request %s refused: %s", r.request_id, e)
            self._errors.append(EngineCoreOutput(r.request_id, [], "error", error=str(e),
                                                 error_is_input=True))

    def abort_requests(self, request_ids: list[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self.scheduler.finish_requests(request_ids, status)
        self._finished(request_ids)

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or bool(self._errors)
                or bool(self.batch_queue))

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        """Schedule, execute, update: one step's outputs (with async scheduling, those of the
        oldest step in flight, or none while the next one was only scheduled)."""
        if self.batch_queue is not None:
            return self.step_with_batch_queue()
        t0 = time.monotonic()
        outputs, self._errors = self._errors, []
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(outputs, self.scheduler.make_stats(), t0, t0)
        so = self.scheduler.schedule()
        out = self.model_executor.execute_model(so, self._grammar_bitmask(so))
        return self._update(so, out, outputs, t0)

    def step_with_batch_queue(self) -> EngineCoreOutputs:
        """Async scheduling (vLLM's name): schedule step N+1 while step N runs in the
        executor's thread; then take N's output. Requests with a grammar need their previous
        token before their next bitmask, so while any is unfinished a step waits for the one
        before it (no overlap then)."""
        t0 = time.monotonic()
        sched, queue = self.scheduler, self.batch_queue
        outputs, self._errors = self._errors, []
        scheduled = False
        depth = self.model_executor.max_concurrent_batches
        if len(queue) < depth and sched.has_unfinished_requests() and not (
                queue and sched.num_structured_requests):
            so = sched.schedule()
            queue.append([so, self.model_executor.execute_model(
                so, self._grammar_bitmask(so), non_block=True), t0, set()])
            scheduled = so.total_num_scheduled_tokens > 0
        if queue and (len(queue) == depth or not scheduled):
            so, future, start, gone = queue.popleft()
            out = future.result()
            if gone:    # their tokens are not for a request that reuses the id since
                out = ModelRunnerOutput.from_sampled(
                    {r: t for r, t in out.sampled().items() if r not in gone},
                    logprobs=out.logprobs, prompt_logprobs_dict=out.prompt_logprobs_dict,
                    failed={r: f for r, f in out.failed.items() if r not in gone})
            return self._update(so, out, outputs, start)
        return EngineCoreOutputs(outputs, sched.make_stats(), t0, time.monotonic())

    def _grammar_bitmask(self, so: SchedulerOutput):
        if not so.structured_output_request_ids:
            return None
        return self.structured_output_manager.grammar_bitmask(so.structured_output_request_ids)

    def _update(self, so: SchedulerOutput, out: ModelRunnerOutput,
                outputs: list[EngineCoreOutput], t0: float) -> EngineCoreOutputs:
        """Apply one step's output: tokens, stop rules, grammars, logprobs, failures, drafts."""
        sched = self.scheduler
        new_ids = so.scheduled_new_req_ids
        num_prompt = 0
        if new_ids:     # first admissions (scheduled_new_reqs also holds resumed requests)
            new = set(new_ids)
            num_prompt = sum(len(r.prompt_token_ids) for r in so.scheduled_new_reqs
                             if r.req_id in new)
        for rid, failure in out.failed.items():
            outputs.append(self._fail_request(rid, failure.error, failure.is_input))
        outs = sched.update_from_output(so, out)
        if self.structured_output_manager is not None and so.structured_output_request_ids:
            outs = self._advance_grammars(outs)
        if out.logprobs or out.prompt_logprobs_dict:
            _attach_logprobs(outs, out)
        finished = [o.request_id for o in outs if o.finish_reason is not None]
        if finished:
            self._finished(finished)
        if self.proposer is not None:
            sched.update_draft_token_ids(self.proposer.propose(sched.running, len(sched.running)))
        outputs += outs
        return EngineCoreOutputs(outputs, sched.make_stats(), t0, time.monotonic(), new_ids,
                                 num_prompt)

    def _fail_request(self, rid: str, error: str, is_input: bool) -> EngineCoreOutput:
        """Finish one request with finish_reason "error" (blocks and generator freed); the
        others go on. is_input: the request's own input was at fault."""
        self.scheduler.finish_requests(rid, RequestStatus.FINISHED_ERROR)
        self._finished((rid,))
        return EngineCoreOutput(rid, [], "error", error=error, error_is_input=is_input)

    def _finished(self, request_ids) -> None:
        """Let go of finished requests in the runner and the grammars; a step still in flight
        that ran them drops their tokens (the id may come back as a new request before)."""
        self.model_executor.release(request_ids)
        self._release_grammars(request_ids)
        for so, _, _, gone in self.batch_queue or ():
            gone.update(r for r in request_ids if r in so.num_scheduled_tokens)

    # ---- structured outputs ---------------------------------------------------------------
    def _structured_outputs(self) -> StructuredOutputManager:
        if self.structured_output_manager is None:
            from kvflow.engine.structured_output import StructuredOutputManager
            from kvflow.engine.tokenizer import Tokenizer
            tok = Tokenizer.from_checkpoint(self._tokenizer_ckpt)
            cfg = self.model_config
            stops = list(dict.fromkeys(
                ([tok.eos_token_id] if tok.eos_token_id is not None else [])
                + list(cfg.eos_token_ids)))
            self.structured_output_manager = StructuredOutputManager(tok, cfg.vocab_size,
                                                                     stops)
        return self.structured_output_manager

    def _release_grammars(self, request_ids) -> None:
        if self.structured_output_manager is not None:
            self.structured_output_manager.remove_requests(request_ids)

    def _advance_grammars(self, outs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Feed each structured request's new tokens to its matcher. A grammar that has ended
        ends its request ("stop") even where the scheduler would go on (ignore_eos, a stop
        token banned below min_tokens left no allowed token): its output is complete. A token
        the grammar refuses before that (only when every allowed token was also banned, e.g. by
        allowed_token_ids) is dropped and fails the request alone."""
        mgr = self.structured_output_manager
        result = []
        for o in outs:
            rid = o.request_id
            if rid not in mgr.matchers:
                result.append(o)
                continue
            n, ended = mgr.accept_tokens(rid, o.new_token_ids)
            if n < len(o.new_token_ids) and not ended:
                error = (f"structured_outputs: no token is allowed by both the grammar and the "
                         f"other sampling parameters after {len(o.new_token_ids) - 1} tokens")
                logger.error("request %s failed: %s", rid, error)
                result.append(self._fail_request(rid, error, True))
                continue
            del o.new_token_ids[n:]
            if ended and o.finish_reason is None:
                self.scheduler.finish_requests(rid, RequestStatus.FINISHED_STOPPED)
                o.finish_reason = "stop"
            result.append(o)
        return result

    # ---- utilities (callable by name from the frontend) --------------------------------------
    def check_structured_outputs(self, so: dict) -> str | None:
        """Compile a grammar for the frontend (the server, before it answers 200): None, or
        why it cannot be used. The compiler's cache keeps it for the request that follows."""
        from kvflow.sampling_params import StructuredOutputsParams
        try:
            self._structured_outputs().compile(
                so if isinstance(so, StructuredOutputsParams) else StructuredOutputsParams(**so))
        except (ValueError, TypeError) as e:
            return str(e)
        return None

    def kv_state(self) -> dict:
        self.model_executor.wait_idle()     # releases queued behind a step in flight
        s = self.scheduler
        return {"running": len(s.running), "waiting": len(s.waiting),
                "unfinished": len(s.requests), "runner_requests": len(self.runner.requests),
                "free_blocks": s.kv_cache_manager.block_pool.num_free_blocks,
                "grammars": len(m.matchers) if (m := self.structured_output_manager) else 0,
                "num_blocks": self.scheduler_config.num_blocks}

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the executor's thread and the tensor-parallel workers, if any (they also stop
        when this process exits)."""
        self.model_executor.shutdown()


def _executor_class(args: EngineArgs) -> type[Executor]:
    if args.tensor_parallel_size > 1:
        from kvflow.engine.tp_executor import TPExecutor     # torch.distributed: only if asked
        return TPExecutor
    return UniProcExecutor


def _attach_logprobs(outs: list[EngineCoreOutput], out: ModelRunnerOutput) -> None:
    lps, prompt = out.logprobs or {}, out.prompt_logprobs_dict
    for o in outs:
        lp = lps.get(o.request_id)
        if lp is not None:      # a stop may have cut the accepted tokens short
            o.new_logprobs = lp[:len(o.new_token_ids)]
        o.new_prompt_logprobs = prompt.get(o.request_id)


def _scheduler_config(args: EngineArgs, cfg, dtype, device: str, model, backend,
                      async_scheduling: bool) -> SchedulerConfig:
    max_len = args.max_model_len or cfg.max_position_embeddings
    if max_len > cfg.max_position_embeddings and not cfg.rope_scaling:
        raise ValueError(f"max_model_len={max_len} exceeds the model's "
                         f"max_position_embeddings={cfg.max_position_embeddings}")
    # CPU: 2048-token steps keep a prefill chunk's activations in cache (BENCHMARKS.md).
    default_budget = 2048 if device == "cpu" else 8192
    budget = args.max_num_batched_tokens or max(default_budget, args.max_num_seqs)
    if not args.enable_chunked_prefill and args.max_num_batched_tokens is None:
        budget = max(budget, max_len)
    num_blocks = args.num_blocks
    kv_cfg, tp = cfg, getattr(model, "tp", None)
    if tp is not None:      # the rank holding the most KV heads (an uneven split) sets the size
        kv_cfg = dataclasses.replace(cfg, num_kv_heads=max_kv_heads(cfg, tp.world_size))
    if num_blocks is None:
        mem = args.kv_cache_memory
        if mem is None and device == "cuda" and tp is not None:
            mem = _tp_cuda_kv_memory(args.gpu_memory_utilization)
        elif mem is None and device == "cuda":
            from kvflow.model.runner.cuda_model_runner import profile_kv_cache_memory
            mem = profile_kv_cache_memory(model, cfg, dtype, backend, args.block_size, budget,
                                          args.max_num_seqs, max_len, args.gpu_memory_utilization)
        elif mem is None:     # no more than the longest batch could ever hold
            need = kv_cfg.kv_bytes_per_token(dtype.itemsize) * max_len * args.max_num_seqs
            mem = min(_DEFAULT_KV_CACHE_MEMORY, need)
        num_blocks = num_blocks_for_memory(kv_cfg, dtype, args.block_size, mem)
    return SchedulerConfig(
        block_size=args.block_size, num_blocks=num_blocks, max_num_batched_tokens=budget,
        max_num_seqs=args.max_num_seqs, max_model_len=max_len,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        long_prefill_token_threshold=args.long_prefill_token_threshold, policy=args.policy,
        watermark=args.watermark, speculative_config=args.speculative_config_obj(),
        async_scheduling=async_scheduling)


def _tp_cuda_kv_memory(utilization: float) -> int:
    """CUDA under tensor parallelism: no profiling pass (its forward would need every rank);
    the share of GPU memory not in use, less 1 GiB for activations (--kv-cache-memory to set
    it). Rank 0 decides for all ranks: the GPUs are assumed alike."""
    free, total = torch.cuda.mem_get_info()
    return max(int(total * utilization) - (total - free) - (1 << 30), 0)
