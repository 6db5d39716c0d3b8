"""EngineCore: the scheduler and the model runner, stepping on token ids only.

It runs in the frontend's process (LLMEngine, a thread of AsyncLLM) or in a process of its own
(kvflow/engine/core_proc.py); either way it takes EngineCoreRequests and aborts, and returns
EngineCoreOutputs. Text (tokenizer, detokenizer, stop strings) is the frontend's.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import torch

from kvflow.core import Request, RequestStatus, Scheduler, SchedulerConfig
from kvflow.core.outputs import EngineCoreOutput
from kvflow.core.spec_decode import NgramProposer
from kvflow.engine.arg_utils import EngineArgs
from kvflow.engine.messages import EngineCoreOutputs, EngineCoreRequest, Ready
from kvflow.engine.tp_executor import TPDriver, launch
from kvflow.model.attention.selector import make_backend, resolve_attention_backend, resolve_device
from kvflow.model.config import ModelConfig
from kvflow.model.loader.model_loader import Checkpoint, build_model, open_checkpoint
from kvflow.model.distributed.parallel import max_kv_heads
from kvflow.model.runner.model_runner import ModelRunner, num_blocks_for_memory

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
        tp = launch(args, ModelConfig.from_hf(ckpt.config), device)    # None: one process
        try:
            cfg, model, dtype = build_model(ckpt, args.dtype, args.max_model_len, device=device,
                                            quantization=args.quantization,
                                            tp=tp.tp if tp else None)
            self.model_config, self.dtype = cfg, dtype
            self.scheduler_config = _scheduler_config(args, cfg, dtype, device, model, backend)
            self.runner = _make_runner(args, model, cfg, dtype, backend, device,
                                       self.scheduler_config)
            if tp is not None:
                self.runner = TPDriver(self.runner, tp, self.scheduler_config)
        except BaseException:
            if tp is not None:
                tp.abort()
            raise
        self.scheduler = Scheduler(self.scheduler_config)
        spec = self.scheduler_config.speculative_config
        self.proposer = NgramProposer(spec, self.scheduler_config.max_model_len) if spec else None
        self._errors: list[EngineCoreOutput] = []   # requests refused by add_request
        # Made at the first request with a grammar (engines without any pay nothing); the
        # checkpoint is kept for its tokenizer, not its weights.
        self.structured_output_manager = None
        self._tokenizer_ckpt = dataclasses.replace(ckpt, weights=None)
        self.load_time = time.perf_counter() - t0

    def ready_message(self) -> Ready:
        return Ready(self.model_config, self.scheduler_config,
                     str(self.dtype).replace("torch.", ""), self.device, self.attention_backend,
                     self.load_time)

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, r: EngineCoreRequest) -> None:
        """The frontend validated r; a refusal here is a bug, reported as that request's error."""
        try:
            self.runner.check_sampling_params(r.sampling_params)
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
        self.runner.release(request_ids)
        self._release_grammars(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._errors)

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        t0 = time.monotonic()
        sched = self.scheduler
        outputs, self._errors = self._errors, []
        if not sched.has_unfinished_requests():
            return EngineCoreOutputs(outputs, sched.make_stats(), t0, t0)
        so = sched.schedule()
        if so.structured_output_request_ids:
            so.grammar_bitmask = self.structured_output_manager.grammar_bitmask(
                so.structured_output_request_ids)
        sampled = self.runner.execute_model(so)
        new_ids = so.scheduled_new_req_ids
        num_prompt = sum(sched.requests[rid].num_prompt_tokens for rid in new_ids)
        for rid, err in self.runner.take_failed().items():
            outputs.append(self._fail_request(rid, err))
        outs = sched.update_from_output(so, sampled)
        if self.structured_output_manager is not None and so.structured_output_request_ids:
            outs = self._advance_grammars(outs)
        self._attach_logprobs(outs)
        finished = [o.request_id for o in outs if o.finish_reason is not None]
        if finished:
            self.runner.release(finished)
            self._release_grammars(finished)
        if self.proposer is not None:
            sched.update_draft_token_ids(self.proposer.propose(sched.running, len(sched.running)))
        outputs += outs
        return EngineCoreOutputs(outputs, sched.make_stats(), t0, time.monotonic(), new_ids,
                                 num_prompt)

    def _attach_logprobs(self, outs: list[EngineCoreOutput]) -> None:
        lps, prompt = self.runner.take_logprobs([o.request_id for o in outs])
        if lps or prompt:
            for o in outs:
                lp = lps.get(o.request_id)
                if lp is not None:      # a stop may have cut the accepted tokens short
                    o.new_logprobs = lp[:len(o.new_token_ids)]
                o.new_prompt_logprobs = prompt.get(o.request_id)

    def _fail_request(self, rid: str, err: Exception) -> EngineCoreOutput:
        """Finish one request with finish_reason "error" (blocks and generator freed); the
        others go on. A ValueError means the request's input was at fault."""
        logger.error("request %s failed: %r", rid, err, exc_info=err)
        self.scheduler.finish_requests(rid, RequestStatus.FINISHED_ERROR)
        self.runner.release((rid,))
        self._release_grammars((rid,))
        return EngineCoreOutput(rid, [], "error", error=f"{type(err).__name__}: {err}"
                                if not isinstance(err, ValueError) else str(err),
                                error_is_input=isinstance(err, ValueError))

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
                result.append(self._fail_request(rid, ValueError(
                    f"structured_outputs: no token is allowed by both the grammar and the other "
                    f"sampling parameters after {len(o.new_token_ids) - 1} tokens")))
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
        s = self.scheduler
        return {"running": len(s.running), "waiting": len(s.waiting),
                "unfinished": len(s.requests), "runner_requests": len(self.runner.requests),
                "free_blocks": s.kv_cache_manager.block_pool.num_free_blocks,
                "grammars": len(m.matchers) if (m := self.structured_output_manager) else 0,
                "num_blocks": self.scheduler_config.num_blocks}

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (they also stop when this process exits)."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()


def _scheduler_config(args: EngineArgs, cfg, dtype, device: str, model, backend
                      ) -> SchedulerConfig:
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
        watermark=args.watermark, speculative_config=args.speculative_config_obj())


def _tp_cuda_kv_memory(utilization: float) -> int:
    """CUDA under tensor parallelism: no profiling pass (its forward would need every rank);
    the share of GPU memory not in use, less 1 GiB for activations (--kv-cache-memory to set
    it). Rank 0 decides for all ranks: the GPUs are assumed alike."""
    free, total = torch.cuda.mem_get_info()
    return max(int(total * utilization) - (total - free) - (1 << 30), 0)


def _make_runner(args: EngineArgs, model, cfg, dtype, backend, device: str,
                 sc: SchedulerConfig) -> ModelRunner:
    """cfg: the whole model's (the sampler's vocabulary); the KV cache holds model.cfg's heads
    (under tensor parallelism, this rank's)."""
    kv_heads = getattr(model, "cfg", cfg).num_kv_heads
    if device == "cuda":
        from kvflow.model.runner.cuda_model_runner import CudaModelRunner
        # No CUDA graphs under tensor parallelism: the NCCL collectives are not captured.
        eager = args.enforce_eager or getattr(model, "tp", None) is not None
        return CudaModelRunner(model, cfg, dtype, sc.block_size, sc.num_blocks, backend,
                               args.seed, sc.max_num_seqs, sc.max_model_len, eager,
                               num_kv_heads=kv_heads)
    return ModelRunner(model, cfg, dtype, sc.block_size, sc.num_blocks, backend, seed=args.seed,
                       num_kv_heads=kv_heads)

