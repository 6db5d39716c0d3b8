"""The model runner: one SchedulerOutput in, one forward pass over the flattened batch, one sampled
token per request whose scheduled tokens reach the end of its sequence.

The runner keeps its own state per request (CachedRequestState), built and updated from the
SchedulerOutput alone, so that the scheduler's Request objects could live in another process."""
from __future__ import annotations

import logging

import torch

from kvflow.core.outputs import (EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput, NewRequestData,
                                 RequestFailure, SchedulerOutput)
from kvflow.model.attention.backend import (AttentionBackend, AttentionMetadata,
                                            TorchAttentionBackend)
from kvflow.model.config import ModelConfig
from kvflow.model.runner.h2d import upload
from kvflow.model.runner.input_batch import CachedRequestState, StepInputs, add_prompt_rows
from kvflow.model.runner.kv_cache import zeroed_kv_cache
from kvflow.model.sample.grammar import apply_grammar_bitmask
from kvflow.model.sample.logits_processors import TokenCounts, static_bias
from kvflow.model.sample.logprobs import LogprobEntry, token_logprobs
from kvflow.model.sample.sampler import Sampler
from kvflow.sampling_params import SamplingParams, short_repr


_NONE: list[int] = []     # no drafts (shared, never mutated)

logger = logging.getLogger(__name__)


class ModelRunner:
    # The CPU kernels index the cache with int64 block ids; the Triton kernels read int32.
    block_table_dtype = torch.long

    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, dtype: torch.dtype,
                 block_size: int, num_blocks: int, backend: AttentionBackend | None = None,
                 seed: int = 0, device: str = "cpu", num_kv_heads: int | None = None) -> None:
        """num_kv_heads: the KV heads this process caches (under tensor parallelism, its
        share; default cfg's)."""
        self.model, self.cfg, self.dtype, self.device = model, cfg, dtype, device
        # False on a tensor-parallel worker: it computes logits only for the gather that rank 0
        # reads (compute_logits is a collective), and rank 0 alone scores and samples.
        self.samples = True
        self._device = torch.device(device)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.backend = backend or TorchAttentionBackend()
        # One allocation for all layers: [layers, K/V, blocks, block_size, kv_heads, head_dim].
        shape = (cfg.num_layers, 2, num_blocks, block_size, num_kv_heads or cfg.num_kv_heads,
                 cfg.head_dim)
        self.kv_cache = zeroed_kv_cache(shape, dtype, device)
        self.kv_caches = list(self.kv_cache.unbind(0))
        self.sampler = Sampler(seed, device)
        self.token_counts = TokenCounts(cfg.vocab_size, self._device)
        # This step's sampled-token logprobs and failures, by request (the step's output).
        self.logprobs: dict[str, list[LogprobEntry]] = {}
        self.failed: dict[str, RequestFailure] = {}
        # Prompt logprobs gathered over a request's prefill chunks, sent with its first token.
        self.prompt_logprobs: dict[str, list[LogprobEntry]] = {}
        self.requests: dict[str, CachedRequestState] = {}
        self.generators: dict[str, torch.Generator] = {}    # by request id, made at first draw
        # Requests whose draw raised, until the engine's finished_req_ids names them: a step
        # scheduled while theirs was in flight (async scheduling) skips them.
        self.failed_ids: set[str] = set()

    @staticmethod
    def check_sampling_params(sp: SamplingParams) -> None:
        """A seed torch rejects fails add_request (a ValueError naming seed), never a step."""
        if sp.seed is None or sp.greedy:
            return
        try:
            torch.Generator().manual_seed(sp.seed)
        except (RuntimeError, ValueError, TypeError, OverflowError) as e:
            raise ValueError(f"seed {short_repr(sp.seed)} cannot seed a torch.Generator "
                             f"({e})") from None

    def _generator(self, req: CachedRequestState) -> torch.Generator | None:
        """Made at the request's first draw; it outlives a preemption, so a resumed request
        draws on from where it stopped, as if it had never been preempted."""
        sp = req.sampling_params
        if sp.seed is None or sp.greedy:
            return None
        g = self.generators.get(req.req_id)
        if g is None:
            self.check_sampling_params(sp)
            g = self.generators[req.req_id] = torch.Generator().manual_seed(sp.seed)
        return g

    def release(self, request_ids) -> None:
        """Forget finished requests now (the next SchedulerOutput's finished_req_ids would)."""
        for rid in request_ids:
            self._drop(rid)
            self.generators.pop(rid, None)
            self.failed_ids.discard(rid)

    def _drop(self, rid: str) -> None:
        st = self.requests.pop(rid, None)
        if st is not None and st.slot is not None:
            self.token_counts.release(st.slot)
            st.slot = None
        self.prompt_logprobs.pop(rid, None)

    def _add_state(self, nr: NewRequestData) -> CachedRequestState:
        st = CachedRequestState.from_new(nr)
        sp = st.sampling_params
        bias = static_bias(sp, self.cfg.vocab_size)
        st.bias = bias.to(self._device) if bias is not None else None
        if sp.has_penalties:
            st.slot = self.token_counts.add(nr.prompt_token_ids, nr.output_token_ids)
        return st

    def update_states(self, so: SchedulerOutput) -> None:
        """Apply the message to the runner's own request states (vLLM's _update_states)."""
        reqs = self.requests
        if so.finished_req_ids:     # first: a finished id may come back as a new request
            self.release(so.finished_req_ids)
        for rid in so.preempted_req_ids:    # resumed later as a new request, sent in full
            self._drop(rid)
        for nr in so.scheduled_new_reqs:
            self._drop(nr.req_id)
            self.failed_ids.discard(nr.req_id)
            reqs[nr.req_id] = self._add_state(nr)
        c = so.scheduled_cached_reqs
        failed = self.failed_ids
        for rid, toks, computed in zip(c.req_ids, c.new_token_ids, c.num_computed_tokens):
            if rid in failed:
                continue
            st = reqs[rid]
            if toks:
                st.token_ids.extend(toks)
            st.num_computed_tokens = computed
        for rid, blocks in c.new_block_ids.items():
            if rid not in failed:
                reqs[rid].block_ids.extend(blocks)

    def fail(self, rid: str, err: Exception) -> None:
        """Request rid's draw raised: it is finished with an error (by the engine, from the
        step's output); until then, steps already scheduled skip it."""
        self.failed[rid] = RequestFailure(
            str(err) if isinstance(err, ValueError) else f"{type(err).__name__}: {err}",
            isinstance(err, ValueError))
        self.skip_failed((rid,))

    def skip_failed(self, request_ids) -> None:
        """Forget these failed requests' states; steps already scheduled skip them."""
        for rid in request_ids:
            self._drop(rid)
            self.failed_ids.add(rid)

    def sample(self, logits: torch.Tensor, reqs: list[CachedRequestState],
               drafts: list[list[int]] | None = None) -> dict[str, list[int]]:
        """One token per request; with drafts (request i owning len(drafts[i]) + 1 logits rows),
        its accepted drafts plus one. If the batched draw raises, each request is drawn alone,
        so that only the requests at fault fail (the step's output names them, for the engine
        to finish). Bad parameters raise before any seeded row draws; only a broken generator could
        leave the seeded rows before it one draw further (not snapshotted: ~2 us a row every
        step). Sampled tokens are appended to their request's state: the scheduler never resends
        them."""
        drafts = drafts or [_NONE] * len(reqs)
        try:
            results = self._draw(logits, reqs, drafts)
        except Exception:
            results = self._draw_each(logits, reqs, drafts)
        out = {}
        for r, toks in zip(reqs, results):
            if toks is not None:
                r.token_ids.extend(toks)
                out[r.req_id] = toks
        self._after_draw(logits, reqs, drafts, results)
        return out

    def _draw(self, logits: torch.Tensor, reqs: list[CachedRequestState],
              drafts: list[list[int]]) -> list[list[int]]:
        params = [r.sampling_params for r in reqs]
        gens = [self._generator(r) for r in reqs]
        logits = self._process(logits, reqs, drafts)
        if not any(drafts):
            return [[t] for t in self.sampler(logits, params, gens, [r.banned() for r in reqs])]
        banned = [r.banned(j) for r, d in zip(reqs, drafts) for j in range(len(d) + 1)]
        return self.sampler.verify(logits, params, gens, drafts, banned)

    def _process(self, logits: torch.Tensor, reqs: list[CachedRequestState],
                 drafts: list[list[int]]) -> torch.Tensor:
        """A float32 copy of logits with the static biases and penalties applied, or logits
        itself when no request asks for either."""
        if all(r.bias is None and r.slot is None for r in reqs):
            return logits
        logits = logits.to(torch.float32, copy=True)    # the raw logits give the logprobs
        bias_rows, biases, pen_rows, slots, params, o = [], [], [], [], [], 0
        for r, d in zip(reqs, drafts):
            if r.bias is not None:
                bias_rows += range(o, o + len(d) + 1)
                biases += [r.bias] * (len(d) + 1)
            if r.slot is not None:      # no drafts: penalties need the history (needs_history)
                pen_rows.append(o)
                slots.append(r.slot)
                params.append(r.sampling_params)
            o += len(d) + 1
        if bias_rows:
            logits[torch.tensor(bias_rows, device=logits.device)] += torch.stack(biases)
        if pen_rows:
            self.token_counts.apply(logits, pen_rows, slots, params)
        return logits

    def _after_draw(self, logits: torch.Tensor, reqs: list[CachedRequestState],
                    drafts: list[list[int]], results: list[list[int] | None]) -> None:
        """Count the tokens of requests with penalties; logprobs of those asking for them."""
        slots, toks, lp_rows, lp_toks, lp_k, lp_reqs, o = [], [], [], [], [], [], 0
        for r, d, res in zip(reqs, drafts, results):
            if res is not None:
                if r.slot is not None:
                    slots += [r.slot] * len(res)
                    toks += res
                k = r.sampling_params.logprobs
                if k is not None:
                    lp_rows += range(o, o + len(res))
                    lp_toks += res
                    lp_k += [k] * len(res)
                    lp_reqs.append((r.req_id, len(res)))
            o += len(d) + 1
        self.token_counts.record(slots, toks)
        if lp_rows:
            entries = token_logprobs(logits[torch.tensor(lp_rows, device=logits.device)],
                                     lp_toks, lp_k)
            o = 0
            for rid, n in lp_reqs:
                self.logprobs[rid] = entries[o:o + n]
                o += n

    def _score_prompts(self, logits: torch.Tensor, st: StepInputs) -> None:
        """Prompt logprobs of this step's prompt rows (logits: those rows only), kept until
        the request samples its first token."""
        entries = token_logprobs(logits, [t for _, ts in st.prompt_reqs for t in ts],
                                 [r.sampling_params.prompt_logprobs
                                  for r, ts in st.prompt_reqs for _ in ts])
        o = 0
        for r, ts in st.prompt_reqs:
            self.prompt_logprobs.setdefault(r.req_id, []).extend(entries[o:o + len(ts)])
            o += len(ts)

    def _draw_each(self, logits: torch.Tensor, reqs: list[CachedRequestState],
                   drafts: list[list[int]]) -> list[list[int] | None]:
        results, errors, o = [], {}, 0
        for r, d in zip(reqs, drafts):
            try:
                results.append(self._draw(logits[o:o + len(d) + 1], [r], [d])[0])
            except Exception as e:
                errors[r.req_id] = e
                results.append(None)
            o += len(d) + 1
        if len(errors) == len(reqs) > 1:    # every request fails: the sampler, not a request
            raise next(iter(errors.values()))
        for rid, e in errors.items():
            logger.error("request %s failed: %r", rid, e, exc_info=e)
            self.fail(rid, e)
        return results

    def gather_inputs(self, so: SchedulerOutput) -> StepInputs:
        """The step's flat inputs as Python lists, decodes (one query token) first: the attention
        backend batches them as one group. A request verifying drafts joins them as one decode
        row per token, each row's context ending at its own position (the attention is causal
        that way, through the decode kernels). Call update_states(so) first."""
        bs = self.block_size
        spec = so.scheduled_spec_decode_tokens
        items = so.num_scheduled_tokens.items()
        if self.failed_ids:
            items = [(rid, n) for rid, n in items if rid not in self.failed_ids]
        order = [rid for rid, n in items if n == 1 or rid in spec]
        num_decodes = len(order) + sum(len(d) for d in spec.values())
        order += [rid for rid, n in items if n != 1 and rid not in spec]
        st = StepInputs([], [], [], [0], [], [], num_decodes, [], [], [])
        input_ids, positions, slots, qsl = st.input_ids, st.positions, st.slots, st.query_start_loc
        seq_lens, tables, reqs = st.seq_lens, st.tables, self.requests
        for rid in order:
            req = reqs[rid]
            n = so.num_scheduled_tokens[rid]
            start = req.num_computed_tokens
            req.num_computed_tokens = end = start + n
            table = req.block_ids
            drafts = spec.get(rid, _NONE)
            num_tokens = len(req.token_ids)
            if len(table) * bs < end or end > num_tokens + len(drafts) or (
                    drafts and end != num_tokens + len(drafts)):
                raise RuntimeError(f"request {rid!r}: the runner's state ({len(table)} blocks, "
                                   f"{len(req.token_ids)} tokens) cannot run tokens "
                                   f"[{start}, {end}): a SchedulerOutput was lost")
            if n == 1:
                input_ids.append(req.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
                qsl.append(qsl[-1] + 1)
                seq_lens.append(end)
                tables.append(table)
            elif drafts:
                input_ids.extend(req.token_ids[start:])
                input_ids.extend(drafts)
                for p in range(start, end):
                    positions.append(p)
                    slots.append(table[p // bs] * bs + p % bs)
                    qsl.append(qsl[-1] + 1)
                    seq_lens.append(p + 1)
                    tables.append(table)
            else:
                input_ids.extend(req.token_ids[start:end])
                pos = range(start, end)
                positions.extend(pos)
                slots.extend([table[p // bs] * bs + p % bs for p in pos])
                qsl.append(qsl[-1] + n)
                seq_lens.append(end)
                tables.append(table)
            if end == num_tokens + len(drafts):
                st.logits_rows.extend(range(qsl[-1] - 1 - len(drafts), qsl[-1]))
                st.sample_reqs.append(req)
                st.drafts.append(drafts)
            if req.sampling_params.prompt_logprobs is not None:
                add_prompt_rows(st, req, start, end)
        return st

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput, grammar_bitmask: torch.Tensor | None = None
                      ) -> ModelRunnerOutput:
        """Run one step. grammar_bitmask: the rows of so.structured_output_request_ids (the
        engine core's grammars), or None."""
        self.update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        st = self.gather_inputs(so)
        if not st.input_ids:        # every scheduled request failed in a step still in flight
            return EMPTY_MODEL_RUNNER_OUTPUT
        hidden = self._forward(st)
        if st.prompt_rows:
            prompt_logits = self.model.compute_logits(hidden[len(st.logits_rows):])
            if self.samples:
                self._score_prompts(prompt_logits, st)
        if not st.sample_reqs:
            return EMPTY_MODEL_RUNNER_OUTPUT
        # Model-dtype logits: the sampler takes the argmax of greedy rows before any upcast
        # (exact: bf16 -> float32 preserves order) and upcasts only when it samples.
        logits = self.model.compute_logits(hidden[:len(st.logits_rows)] if st.prompt_rows
                                           else hidden)
        if not self.samples:
            return EMPTY_MODEL_RUNNER_OUTPUT
        if grammar_bitmask is not None:
            apply_grammar_bitmask(logits, grammar_bitmask, so.structured_output_request_ids,
                                  st.sample_reqs, st.drafts)
        sampled = self.sample(logits, st.sample_reqs, st.drafts)
        return self._output(sampled)

    def _output(self, sampled: dict[str, list[int]]) -> ModelRunnerOutput:
        """The step's answer; the per-step logprobs and failures move into it."""
        lps, self.logprobs = self.logprobs, {}
        failed, self.failed = self.failed, {}
        prompt = self.prompt_logprobs
        prompt = {rid: prompt.pop(rid) for rid in sampled if rid in prompt} if prompt else {}
        return ModelRunnerOutput.from_sampled(sampled, logprobs=lps or None,
                                              prompt_logprobs_dict=prompt, failed=failed)

    def _upload(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        """Host data as a tensor on the runner's device (on a GPU: from pinned memory, without
        blocking, so the next step's inputs can be built while this one computes)."""
        return upload(data, dtype, self._device)

    def _forward(self, st: StepInputs) -> torch.Tensor:
        """The hidden states of st.logits_rows (of the last row when no request samples: the
        layers still write its KV). The device hook: CudaModelRunner replays CUDA graphs."""
        n = len(st.input_ids)
        width = max(len(t) for t in st.tables)
        block_table = [t + [0] * (width - len(t)) for t in st.tables]
        meta = AttentionMetadata(num_tokens=n, slot_mapping=self._upload(st.slots, torch.long),
                                 query_start_loc=st.query_start_loc, seq_lens=st.seq_lens,
                                 block_table=self._upload(block_table, self.block_table_dtype),
                                 num_decodes=st.num_decodes, block_size=self.block_size,
                                 num_blocks=self.num_blocks)
        self.backend.prepare(meta)
        rows = st.rows or [n - 1]
        return self.model(self._upload(st.input_ids, torch.long),
                          self._upload(st.positions, torch.long), self.kv_caches, self.backend,
                          meta, self._upload(rows, torch.long))

    @torch.inference_mode()
    def forward_logits(self, token_ids: list[int]) -> torch.Tensor:
        """All-position logits of one prompt run through the paged path (blocks 0..n-1); for
        tests and debugging, not for serving."""
        if getattr(self.model, "tp", None) is not None:
            # rank 0 alone would wait in the first all-reduce for workers that never join it
            raise NotImplementedError("forward_logits (a test helper) runs without the "
                                      "workers: not under tensor parallelism")
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
