"""CUDA graphs for decode-only steps.

One graph per batch size in capture_sizes(max_num_seqs); a step of n decodes replays the smallest
graph of at least n rows. The graphs read static device buffers: the step's inputs are copied in
(from pinned memory, without blocking), padded rows get slot -1 (the KV store skips them) and
seq_len 0 (decode attention returns zeros for them). The decode kernel's split count is fixed
per graph from max_model_len; each request still divides its own context among the splits.
"""
from __future__ import annotations

import bisect

import torch

from kvflow.model.attention.backend import AttentionMetadata
from kvflow.model.runner.h2d import host
from kvflow.model.runner.input_batch import StepInputs


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs (which is always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += range(16, max_num_seqs + 1, 16)
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    def __init__(self, runner, max_num_seqs: int, max_model_len: int) -> None:
        model, backend, dev = runner.model, runner.backend, runner.device
        self.sizes = capture_sizes(max_num_seqs)
        self.max_batch = n = self.sizes[-1]
        max_blocks = -(-max_model_len // runner.block_size)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.block_table = torch.zeros(n, max_blocks, dtype=torch.int32, device=dev)
        rows = torch.arange(n, device=dev)
        # A captured graph reads its inputs by address and owns none of them: every tensor it
        # reads is kept alive here with it (args), or replays would read freed, reused memory.
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, AttentionMetadata, torch.Tensor,
                                     tuple]] = {}
        pool = None
        # Largest first, so the smaller graphs fit in the memory pool the first one reserved.
        for b in reversed(self.sizes):
            meta = AttentionMetadata(num_tokens=b, slot_mapping=self.slots[:b],
                                     query_start_loc=list(range(b + 1)), seq_lens=[1] * b,
                                     block_table=self.block_table[:b], num_decodes=b,
                                     block_size=runner.block_size, num_blocks=runner.num_blocks)
            backend.bind_decode(meta, self.slots[:b], self.block_table[:b], self.seq_lens[:b],
                                max_model_len)
            args = (self.input_ids[:b], self.positions[:b], runner.kv_caches, backend, meta,
                    rows[:b])
            with torch.inference_mode():
                model(*args)            # warm-up: compiles the kernels outside the capture
                self._sync()
                graph, out = self._capture(lambda args=args: model(*args), pool)
            pool = graph.pool()
            self.graphs[b] = (graph, meta, out, args)
        self._sync()

    def _sync(self) -> None:
        if self.slots.device.type == "cuda":
            torch.cuda.synchronize()

    @staticmethod
    def _capture(fn, pool):
        """-> (graph, its output tensor). Tests on CPU replace this with an eager stand-in."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        return graph, out

    def can_run(self, st: StepInputs) -> bool:
        return (st.num_decodes == len(st.seq_lens) and len(st.seq_lens) <= self.max_batch
                and max(map(len, st.tables)) <= self.block_table.shape[1])

    def run(self, st: StepInputs) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode-only step (every row, sampled or not)."""
        n = len(st.input_ids)
        b = self.sizes[bisect.bisect_left(self.sizes, n)]
        graph, _, out, _ = self.graphs[b]

        def up(dst: torch.Tensor, data: list, dtype: torch.dtype) -> None:
            dst.copy_(host(data, dtype, dst.device), non_blocking=True)

        up(self.input_ids[:n], st.input_ids, torch.long)
        up(self.positions[:n], st.positions, torch.long)
        up(self.slots[:n], st.slots, torch.long)
        up(self.seq_lens[:n], st.seq_lens, torch.int32)
        width = max(map(len, st.tables))
        up(self.block_table[:n, :width], [t + [0] * (width - len(t)) for t in st.tables],
           torch.int32)
        if b > n:
            self.slots[n:b].fill_(-1)
            self.seq_lens[n:b].fill_(0)
        graph.replay()
        return out[:n]
