"""How long one engine step takes on a GPU: a roofline over what the SchedulerOutput asks for.

A step runs every scheduled token through the model once. Its time is modelled as

    t = step_overhead + host_per_request * num_requests
        + max(linear FLOPs / (peak_flops * mfu), streamed weight bytes / (bandwidth * mbu))
        + max(decode attention FLOPs / (peak * mfu),  decode KV bytes / (bandwidth * mbu))
        + max(prefill attention FLOPs / (peak * mfu), prefill KV bytes / (bandwidth * mbu))

- Linear layers (q/k/v/o, gate/up/down, LM head) cost 2 FLOPs per parameter per token, and
  stream every weight from HBM once per step whatever the batch: small batches are
  bandwidth-bound (decode), big ones compute-bound (prefill). The LM head runs on one position
  per scheduled request (vLLM computes logits only where it samples).
- A request verifying m draft tokens (SchedulerOutput.scheduled_spec_decode_tokens) runs as
  1 + m decode rows, as kvflow's runner does: row j attends to its own context (c - m + j keys)
  and reads that context's KV itself, so the KV of the shared context is read 1 + m times (a GPU
  kernel that reads it once per request would be cheaper), and all 1 + m rows get logits.
- Attention costs 4 * num_heads * head_dim FLOPs per layer per (query, key) pair (QK^T and PV)
  and reads each request's KV context once (plus writes the new tokens' K/V). Decodes are almost
  always bandwidth-bound; long prefill chunks are compute-bound, with the causal n^2/2 term.
  The two kinds get separate rooflines because one does not hide behind the other's bottleneck.
- Not modelled: activation traffic, kernel tails, tensor parallelism, sliding windows, MoE.

The constants below are assumptions, not measurements; `calibrate.py` fits them to measured
step times and reports the prediction error (BENCHMARKS.md has a CPU calibration run).
"""
from __future__ import annotations

from dataclasses import dataclass

from kvflow.sim.hardware import GPUSpec, ModelShape


@dataclass(slots=True)
class CostConstants:
    # Fraction of dense bf16 peak that GEMMs and attention reach. Assumption: large bf16 GEMMs on
    # H100/A100 typically reach 60-75% of peak; we take the low end because attention and the
    # small-M GEMMs of mixed batches do worse.
    mfu: float = 0.6
    # Fraction of HBM peak reached when streaming weights and KV. Assumption: bandwidth-bound
    # GEMV / paged-attention kernels typically reach 75-90% of peak on HBM GPUs.
    mbu: float = 0.8
    # Fixed cost of a step outside the kernels' roofline: launching the (CUDA-graph) forward,
    # sampling, preparing inputs, copying sampled ids back. Assumption, 1 ms: with the 5.6 ms
    # weight stream of Llama-3-8B on H100 this puts a batch-1 decode near 6.6 ms.
    step_overhead_s: float = 1.0e-3
    # Host time of schedule() + update_from_output() per scheduled request: kvflow's own
    # measurement, 1.28-1.52 us per running request on the 2-core dev VM (BENCHMARKS.md,
    # "Scheduler overhead"). A constant keeps replays deterministic; the simulator's
    # include_scheduler_time option uses the live measured time instead.
    host_s_per_request: float = 1.4e-6

    def __post_init__(self) -> None:
        for name in ("mfu", "mbu"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {v!r}")
        if self.step_overhead_s < 0 or self.host_s_per_request < 0:
            raise ValueError("overheads must be >= 0")


def step_totals(reqs) -> tuple[int, int, int, int, int, int]:
    """Sum a step's (new tokens, context length after the step) per request into what the
    roofline needs: (requests, tokens, decodes, decode context, prefill (query, key) pairs,
    prefill KV tokens read + written)."""
    nreq = ntok = ndec = dctx = pairs = pkv = 0
    for n, c in reqs:
        nreq += 1
        ntok += n
        if n == 1:
            ndec += 1
            dctx += c
        else:
            # Query i of the chunk (0-based) sees the c - n earlier tokens and i + 1 of its own.
            pairs += n * (c - n) + (n * (n + 1) >> 1)
            pkv += c + n
    return nreq, ntok, ndec, dctx, pairs, pkv


def spec_step_totals(reqs) -> tuple[int, int, int, int, int, int, int]:
    """step_totals over (new tokens, context after, draft tokens) triples, plus the LM-head rows.
    A request with drafts is n = 1 + drafts decode rows with contexts c - n + 1 .. c and n logit
    rows, never a prefill chunk."""
    nreq = ntok = ndec = dctx = pairs = pkv = lm = 0
    for n, c, m in reqs:
        nreq += 1
        ntok += n
        if m:
            ndec += n
            dctx += n * c - (n * (n - 1) >> 1)
            lm += n
        elif n == 1:
            ndec += 1
            dctx += c
            lm += 1
        else:
            pairs += n * (c - n) + (n * (n + 1) >> 1)
            pkv += c + n
            lm += 1
    return nreq, ntok, ndec, dctx, pairs, pkv, lm


class CostModel:
    """Predicts step durations for one model shape on one GPU. Per step: O(batch) integer sums,
    then a handful of float operations."""
    __slots__ = ("shape", "gpu", "constants", "t_weights", "t_token", "t_lm_head", "t_pair",
                 "t_kv", "overhead", "host_per_req")

    def __init__(self, shape: ModelShape, gpu: GPUSpec,
                 constants: CostConstants | None = None) -> None:
        c = constants if constants is not None else CostConstants()
        self.shape, self.gpu, self.constants = shape, gpu, c
        flops = gpu.peak_flops * c.mfu
        bw = gpu.mem_bandwidth * c.mbu
        self.t_weights = shape.step_weight_bytes / bw
        self.t_token = 2 * shape.layer_params / flops
        self.t_lm_head = 2 * shape.lm_head_params / flops
        self.t_pair = 4 * shape.num_layers * shape.num_heads * shape.head_dim / flops
        self.t_kv = shape.kv_bytes_per_token / bw
        self.overhead = c.step_overhead_s
        self.host_per_req = c.host_s_per_request

    def step_time(self, num_scheduled: dict[str, int], requests: dict, pad_decodes: int = 0,
                  pad_context: int = 0, spec_tokens: dict[str, list[int]] | None = None) -> float:
        """Duration of the step `num_scheduled` describes, read right after schedule() (which has
        already advanced each request's num_computed_tokens to the end of its new tokens).

        pad_decodes / pad_context: decode slots that run without producing anything useful
        (static batching's finished-but-padded sequences) and their summed context length.
        spec_tokens: SchedulerOutput.scheduled_spec_decode_tokens (requests verifying drafts).
        """
        if spec_tokens:
            get = spec_tokens.get
            *tot, lm = spec_step_totals(
                (n, requests[rid].num_computed_tokens, len(get(rid, ())))
                for rid, n in num_scheduled.items())
        else:
            tot = step_totals(
                (n, requests[rid].num_computed_tokens) for rid, n in num_scheduled.items())
            lm = None
        nreq, ntok, ndec, dctx, pairs, pkv = tot
        return self.time_from_totals(nreq + pad_decodes, ntok + pad_decodes, ndec + pad_decodes,
                                     dctx + pad_context, pairs, pkv,
                                     None if lm is None else lm + pad_decodes)

    def time_from_totals(self, num_reqs: int, num_tokens: int, num_decodes: int,
                         decode_context: int, prefill_pairs: int, prefill_kv_tokens: int,
                         lm_head_rows: int | None = None) -> float:
        """lm_head_rows: rows that get logits (default: one per request)."""
        lm = num_reqs if lm_head_rows is None else lm_head_rows
        lin = num_tokens * self.t_token + lm * self.t_lm_head
        if lin < self.t_weights:
            lin = self.t_weights
        t = self.overhead + self.host_per_req * num_reqs + lin
        return t + self.attention_time(num_decodes, decode_context, prefill_pairs,
                                       prefill_kv_tokens)

    def attention_time(self, num_decodes: int, decode_context: int, prefill_pairs: int,
                       prefill_kv_tokens: int) -> float:
        t = 0.0
        if num_decodes:
            # A decode's single query meets every key of its context once: pairs == context.
            a = decode_context * self.t_pair
            m = (decode_context + num_decodes) * self.t_kv
            t += a if a > m else m
        if prefill_pairs:
            a = prefill_pairs * self.t_pair
            m = prefill_kv_tokens * self.t_kv
            t += a if a > m else m
        return t

    def decode_step_time(self, batch: int, context: int) -> float:
        """A pure decode step of `batch` requests that each have `context` tokens in the cache
        (counting the one being decoded)."""
        return self.time_from_totals(batch, batch, batch, batch * context, 0, 0)

    def verify_step_time(self, context: int, num_drafts: int) -> float:
        """One request verifying num_drafts drafts after `context` tokens (counting the one being
        decoded): 1 + num_drafts decode rows and logit rows. num_drafts=0 is a plain decode."""
        n, c = num_drafts + 1, context + num_drafts
        return self.time_from_totals(1, n, n, n * c - n * (n - 1) // 2, 0, 0, n)

    def prefill_step_time(self, prompt: int, cached: int = 0) -> float:
        """One step that prefills `prompt - cached` tokens of a single request."""
        n = prompt - cached
        if n == 1:
            return self.decode_step_time(1, prompt)
        return self.time_from_totals(1, n, 0, 0, n * cached + n * (n + 1) // 2, prompt + n)

    def describe(self) -> dict:
        c, s, g = self.constants, self.shape, self.gpu
        return {"gpu": g.name, "gpu_source": g.source, "model": s.name,
                "params": s.num_params, "weight_bytes_per_step": s.step_weight_bytes,
                "kv_bytes_per_token": s.kv_bytes_per_token, "mfu": c.mfu, "mbu": c.mbu,
                "step_overhead_s": c.step_overhead_s, "host_s_per_request": c.host_s_per_request,
                "decode_step_ms_batch1_ctx1k": 1e3 * self.decode_step_time(1, 1024),
                "decode_step_ms_batch64_ctx1k": 1e3 * self.decode_step_time(64, 1024),
                "prefill_ms_2048": 1e3 * self.prefill_step_time(2048)}


class RowTableCostModel(CostModel):
    """A CostModel whose fixed + linear part is a measured table, not the roofline: `table` maps
    T to the seconds of one request's forward of T rows (piecewise linear in between, extended
    along the last two points past the end, flat below the first). For executors whose small-row
    GEMMs follow no roofline (kvflow's CPU runner: 3 rows measured slower than 5). Attention
    (roofline, on top of the table) and per-request host time beyond the first still apply; a
    step's T is its scheduled token count, whatever the mix of requests."""
    __slots__ = ("table",)

    def __init__(self, shape: ModelShape, gpu: GPUSpec, table: dict[int, float],
                 constants: CostConstants | None = None) -> None:
        super().__init__(shape, gpu, constants)
        if len(table) < 2 or min(table) < 1 or min(table.values()) <= 0:
            raise ValueError("table needs >= 2 points with rows >= 1 and seconds > 0")
        self.table = sorted(table.items())

    def rows_time(self, rows: int) -> float:
        pts = self.table
        if rows <= pts[0][0]:
            return pts[0][1]
        for (r0, s0), (r1, s1) in zip(pts, pts[1:]):
            if rows <= r1:
                break
        return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)

    def time_from_totals(self, num_reqs: int, num_tokens: int, num_decodes: int,
                         decode_context: int, prefill_pairs: int, prefill_kv_tokens: int,
                         lm_head_rows: int | None = None) -> float:
        t = self.rows_time(num_tokens) + self.host_per_req * max(0, num_reqs - 1)
        return t + self.attention_time(num_decodes, decode_context, prefill_pairs,
                                       prefill_kv_tokens)
