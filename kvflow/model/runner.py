"""The model runner: one SchedulerOutput in, one forward pass over the flattened batch, one sampled
token per request whose scheduled tokens reach the end of its sequence."""
from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from kvflow.core.outputs import SchedulerOutput
from kvflow.core.request import Request
from kvflow.model.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend
from kvflow.model.config import ModelConfig
from kvflow.model.sampler import Sampler
from kvflow.sampling_params import short_repr


def num_blocks_for_memory(cfg: ModelConfig, dtype: torch.dtype, block_size: int,
                          kv_cache_memory: int) -> int:
    per_block = cfg.kv_bytes_per_token(torch.tensor([], dtype=dtype).element_size()) * block_size
    n = int(kv_cache_memory) // per_block
    if n < 1:
        raise ValueError(f"kv_cache_memory={kv_cache_memory} bytes holds no KV block "
                         f"({per_block} bytes per block of {block_size} tokens)")
    return n


def _zeros(shape: tuple, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Zeroed KV memory. Zeros, not garbage: a NaN in an unused slot would survive the attention
    mask (NaN + -inf). On CPU an anonymous mmap maps zero pages lazily, so gigabytes cost nothing
    until touched (torch.zeros writes them all, ~0.4 s per GiB). It is a shared mapping with
    4 KiB pages on purpose: measured on the dev VM, private memory with MADV_HUGEPAGE made the
    first touch much dearer (the decode step in which 256 requests each open a block: 54 ms ->
    144 ms, 2 MiB pages zeroed and compacted on demand; the headline run 4,560 -> 4,130 tok/s)."""
    if device != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype).view(shape)


def _banned(req: Request) -> list[int] | None:
    """Below min_tokens, EOS and the stop token ids may not be sampled at all (vLLM's
    MinTokensLogitsProcessor); the scheduler only declines to stop on them."""
    if req.num_output_tokens >= req.min_tokens:
        return None
    ids = set(req.stop_token_set or ())
    if req.stop_eos is not None:
        ids.add(req.stop_eos)
    return sorted(ids) or None


@dataclass(slots=True)
class StepInputs:
    input_ids: list[int]
    positions: list[int]
    slots: list[int]                    # flat KV slot of each token
    query_start_loc: list[int]
    seq_lens: list[int]
    tables: list[list[int]]             # each request's block ids
    num_decodes: int
    logits_rows: list[int]              # rows whose logits are sampled
    sample_reqs: list[Request]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, dtype: torch.dtype,
                 block_size: int, num_blocks: int, backend: AttentionBackend | None = None,
                 seed: int = 0, device: str = "cpu") -> None:
        self.model, self.cfg, self.dtype, self.device = model, cfg, dtype, device
        self.block_size, self.num_blocks = block_size, num_blocks
        self.backend = backend or TorchAttentionBackend()
        # One allocation for all layers: [layers, K/V, blocks, block_size, kv_heads, head_dim].
        shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_cache = _zeros(shape, dtype, device)
        self.kv_caches = list(self.kv_cache.unbind(0))
        self.sampler = Sampler(seed)
        self.generators: dict[str, torch.Generator] = {}
        self.failed: dict[str, Exception] = {}      # requests whose draw raised, by id

    def add_request(self, req: Request) -> None:
        """Seed the request's generator now: a seed torch rejects fails add_request (a
        ValueError naming seed), never a step."""
        sp = req.sampling_params
        if sp.seed is None or sp.greedy:
            return
        try:
            self.generators[req.request_id] = torch.Generator().manual_seed(sp.seed)
        except (RuntimeError, ValueError, TypeError, OverflowError) as e:
            raise ValueError(f"seed {short_repr(sp.seed)} cannot seed a torch.Generator "
                             f"({e})") from None

    def _generator(self, req: Request) -> torch.Generator | None:
        sp = req.sampling_params
        if sp.seed is None or sp.greedy:
            return None
        g = self.generators.get(req.request_id)
        if g is None:       # a request that did not come through add_request (tests)
            self.add_request(req)
            g = self.generators[req.request_id]
        return g

    def release(self, request_ids) -> None:
        for rid in request_ids:
            self.generators.pop(rid, None)

    def take_failed(self) -> dict[str, Exception]:
        failed, self.failed = self.failed, {}
        return failed

    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> dict[str, list[int]]:
        """One token per request. If the batched draw raises, each row is drawn alone, so that
        only the requests at fault fail (they go to self.failed, for the engine to finish).
        Bad parameters raise before any seeded row draws; only a broken generator could leave
        the seeded rows before it one draw further (not snapshotted: ~2 us a row every step)."""
        try:
            tokens = self._draw(logits, reqs)
        except Exception:
            return self._sample_rows(logits, reqs)
        return {r.request_id: [t] for r, t in zip(reqs, tokens)}

    def _draw(self, logits: torch.Tensor, reqs: list[Request]) -> list[int]:
        return self.sampler(logits, [r.sampling_params for r in reqs],
                            [self._generator(r) for r in reqs], [_banned(r) for r in reqs])

    def _sample_rows(self, logits: torch.Tensor, reqs: list[Request]) -> dict[str, list[int]]:
        out, errors = {}, {}
        for i, r in enumerate(reqs):
            try:
                out[r.request_id] = self._draw(logits[i:i + 1], [r])
            except Exception as e:
                errors[r.request_id] = e
        if len(errors) == len(reqs) > 1:    # every row fails: the sampler, not a request
            raise next(iter(errors.values()))
        self.failed.update(errors)
        return out

    def gather_inputs(self, so: SchedulerOutput, requests: dict[str, Request]) -> StepInputs:
        """The step's flat inputs as Python lists, decodes (one query token) first: the attention
        backend batches them as one group."""
        bs = self.block_size
        items = so.num_scheduled_tokens.items()
        order = [rid for rid, n in items if n == 1] + [rid for rid, n in items if n != 1]
        st = StepInputs([], [], [], [0], [], [], sum(1 for _, n in items if n == 1), [], [])
        input_ids, positions, slots, qsl = st.input_ids, st.positions, st.slots, st.query_start_loc
        for rid in order:
            req = requests[rid]
            n = so.num_scheduled_tokens[rid]
            end = req.num_computed_tokens     # already advanced by schedule()
            start = end - n
            table = so.block_ids[rid]
            if n == 1:
                input_ids.append(req.all_token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                input_ids.extend(req.all_token_ids[start:end])
                pos = range(start, end)
                positions.extend(pos)
                slots.extend([table[p // bs] * bs + p % bs for p in pos])
            qsl.append(qsl[-1] + n)
            st.seq_lens.append(end)
            st.tables.append(table)
            if end == len(req.all_token_ids):
                st.logits_rows.append(qsl[-1] - 1)
                st.sample_reqs.append(req)
        return st

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput,
                      requests: dict[str, Request]) -> dict[str, list[int]]:
        if so.total_num_scheduled_tokens == 0:
            return {}
        st = self.gather_inputs(so, requests)
        tables, input_ids, logits_rows, sample_reqs = (st.tables, st.input_ids, st.logits_rows,
                                                       st.sample_reqs)
        width = max(len(t) for t in tables)
        block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        meta = AttentionMetadata(num_tokens=len(input_ids),
                                 slot_mapping=torch.tensor(st.slots, dtype=torch.long),
                                 query_start_loc=st.query_start_loc, seq_lens=st.seq_lens,
                                 block_table=block_table, num_decodes=st.num_decodes,
                                 block_size=self.block_size, num_blocks=self.num_blocks)
        self.backend.prepare(meta)
        if not sample_reqs:
            logits_rows = [len(input_ids) - 1]      # run the layers (they write KV); skip nothing
        hidden = self.model(torch.tensor(input_ids, dtype=torch.long),
                            torch.tensor(st.positions, dtype=torch.long), self.kv_caches,
                            self.backend, meta, torch.tensor(logits_rows, dtype=torch.long))
        if not sample_reqs:
            return {}
        # Model-dtype logits: the sampler takes the argmax of greedy rows before any upcast
        # (exact: bf16 -> float32 preserves order) and upcasts only when it samples.
        return self.sample(self.model.compute_logits(hidden), sample_reqs)

    @torch.inference_mode()
    def forward_logits(self, token_ids: list[int]) -> torch.Tensor:
        """All-position logits of one prompt run through the paged path (blocks 0..n-1); for
        tests and debugging, not for serving."""
        bs, n = self.block_size, len(token_ids)
        nb = -(-n // bs)
        if nb > self.num_blocks:
            raise ValueError(f"{n} tokens need {nb} blocks; the cache has {self.num_blocks}")
        meta = AttentionMetadata(num_tokens=n, slot_mapping=torch.arange(n),
                                 query_start_loc=[0, n], seq_lens=[n],
                                 block_table=torch.arange(nb)[None, :], num_decodes=int(n == 1),
                                 block_size=bs, num_blocks=self.num_blocks)
        self.backend.prepare(meta)
        dev = self.device
        hidden = self.model(torch.tensor(token_ids, device=dev), torch.arange(n, device=dev),
                            self.kv_caches, self.backend, meta, torch.arange(n, device=dev))
        return self.model.compute_logits(hidden).float()
