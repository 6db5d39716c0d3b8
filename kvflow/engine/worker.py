"""What one process of the engine needs to run steps: its shard of the model and its runner.

The same code builds both for the engine core (rank 0, kvflow/engine/executor.py) and for every
tensor-parallel worker (kvflow/engine/tp_worker.py), so that the ranks agree by construction.
"""
from __future__ import annotations

from kvflow.core.config import SchedulerConfig
from kvflow.engine.arg_utils import EngineArgs
from kvflow.model.loader.model_loader import Checkpoint, build_model, open_checkpoint
from kvflow.model.runner.model_runner import ModelRunner


def load_model(args: EngineArgs, device: str, tp=None, ckpt: Checkpoint | None = None):
    """(config, model, dtype): the whole model, or this rank's shard of it under tp."""
    ckpt = ckpt if ckpt is not None else open_checkpoint(args.model)
    return build_model(ckpt, args.dtype, args.max_model_len, device=device,
                       quantization=args.quantization, tp=tp)


def make_model_runner(args: EngineArgs, model, cfg, dtype, backend, device: str,
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
