"""The model runner on a CUDA device: ModelRunner's step, with inputs copied from pinned host
memory without blocking, the block table in int32 for the Triton kernels, decode-only steps
replayed from CUDA graphs, and the KV cache sized from gpu_memory_utilization after a profiling
forward pass.
"""
from __future__ import annotations

import torch

from kvflow.model.attention.backend import AttentionBackend, AttentionMetadata
from kvflow.model.config import ModelConfig
from kvflow.model.runner.input_batch import StepInputs
from kvflow.model.runner.model_runner import ModelRunner
from kvflow.model.sample.sampler import Sampler

_GIB = 1 << 30


class CudaModelRunner(ModelRunner):
    block_table_dtype = torch.int32

    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, dtype: torch.dtype,
                 block_size: int, num_blocks: int, backend: AttentionBackend, seed: int,
                 max_num_seqs: int, max_model_len: int, enforce_eager: bool,
                 device: str = "cuda", num_kv_heads: int | None = None) -> None:
        # device="cpu" (with the triton backend under TRITON_INTERPRET=1) exists for tests; the
        # sampler then still samples as on a GPU.
        super().__init__(model, cfg, dtype, block_size, num_blocks, backend, seed=seed,
                         device=device, num_kv_heads=num_kv_heads)
        self.sampler = Sampler(seed, device, batch_noise=True)
        self.graphs = None
        if not enforce_eager:       # captured now: after the warm-up, with the KV cache in place
            from kvflow.model.runner.cuda_graphs import DecodeGraphs
            self.graphs = DecodeGraphs(self, max_num_seqs, max_model_len)

    def _forward(self, st: StepInputs) -> torch.Tensor:
        """A decode-only step that fits a graph replays it; any other step runs eagerly."""
        if self.graphs is None or not self.graphs.can_run(st):
            return super()._forward(st)
        hidden = self.graphs.run(st)        # every row: the graph computes them all anyway
        if (st.sample_reqs or st.prompt_rows) and len(st.rows) < len(st.input_ids):
            hidden = hidden[self._upload(st.rows, torch.long)]
        return hidden


@torch.inference_mode()
def profile_kv_cache_memory(model: torch.nn.Module, cfg: ModelConfig, dtype: torch.dtype,
                            backend: AttentionBackend, block_size: int, max_num_batched_tokens: int,
                            max_num_seqs: int, max_model_len: int, utilization: float) -> int:
    """Bytes for the KV cache: utilization x the GPU's memory, less what is in use (CUDA context,
    weights, other processes) and the activation peak of a forward pass over a full batch of
    max_num_batched_tokens tokens with max_num_seqs sampled rows."""
    dev = torch.device("cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    # The dummy batch: prompts as long as max_model_len allows; decodes (length 1) first.
    lens, left = [], max_num_batched_tokens
    while left > 0:
        lens.append(min(left, max_model_len))
        left -= lens[-1]
    lens.sort()
    n = sum(lens)
    qsl = [0]
    for ln in lens:
        qsl.append(qsl[-1] + ln)
    # Every position maps to block 0 of a one-block cache and no slot is written: the kernels
    # do their full work without the profile needing a real cache.
    cache = torch.zeros(cfg.num_layers, 2, 1, block_size, cfg.num_kv_heads, cfg.head_dim,
                        dtype=dtype, device=dev)
    meta = AttentionMetadata(num_tokens=n, slot_mapping=torch.full((n,), -1, dtype=torch.long),
                             query_start_loc=qsl, seq_lens=lens,
                             block_table=torch.zeros(len(lens), -(-max(lens) // block_size),
                                                     dtype=torch.long),
                             num_decodes=sum(1 for ln in lens if ln == 1), block_size=block_size,
                             num_blocks=1)
    backend.prepare(meta)
    positions = torch.cat([torch.arange(ln) for ln in lens]).to(dev)
    rows = torch.arange(n - min(n, max_num_seqs), n, device=dev)
    hidden = model(torch.zeros(n, dtype=torch.long, device=dev), positions,
                   list(cache.unbind(0)), backend, meta, rows)
    model.compute_logits(hidden).float().softmax(dim=-1)    # the sampler's float32 copies
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base - cache.numel() * cache.element_size()
    del cache, meta, hidden, positions, rows
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    used = total - free
    kv = int(total * utilization) - used - peak
    per_block = cfg.kv_bytes_per_token(dtype.itemsize) * block_size
    if kv < per_block:
        raise ValueError(
            f"gpu_memory_utilization={utilization} leaves no room for the KV cache: "
            f"{total * utilization / _GIB:.2f} GiB allowed, {used / _GIB:.2f} GiB in use "
            f"(weights, CUDA context, other processes), {peak / _GIB:.2f} GiB of activations at "
            f"max_num_batched_tokens={max_num_batched_tokens}; raise gpu_memory_utilization "
            f"or lower max_num_batched_tokens")
    return kv
