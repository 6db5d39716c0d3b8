"""Parallel sampling (SamplingParams.n > 1), as in vLLM V1: the frontend fans a parent request
out into n child requests and folds their outputs back into one RequestOutput.

The engine core never sees a parent: it schedules n independent requests with the same prompt.
They reach the core in one batch, so the scheduler admits them in the same step; the first
child's full prompt blocks are put in the prefix cache when that step is scheduled and the
other children take them as prefix-cache hits (block reference counts), so the prompt's KV is
computed and stored once. Each child owns only its last, partial prompt block and its output.

Child ids are f"{index}_{parent id}" and a seeded parent gives child i the seed + i (both as
vLLM), so the n samples differ but a seeded request repeats. Only the first child computes
prompt_logprobs, so that even then the others share its prompt blocks.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import msgspec

from kvflow.engine.messages import EngineCoreRequest
from kvflow.engine.outputs import CompletionOutput, RequestOutput
from kvflow.sampling_params import SEED_MAX, SamplingParams


def child_request_id(index: int, request_id: str) -> str:
    return f"{index}_{request_id}"


def child_sampling_params(sp: SamplingParams, index: int) -> SamplingParams:
    seed = sp.seed
    if seed is not None:
        seed += index
        if seed > SEED_MAX:     # wrap modulo 2**64, as torch does: still a valid seed
            seed -= 1 << 64
    # Only the first child scores the prompt: a request with prompt_logprobs reads nothing from
    # the prefix cache (its logits are needed), so the others could not share its blocks.
    prompt_logprobs = sp.prompt_logprobs if index == 0 else None
    return dataclasses.replace(sp, n=1, seed=seed, prompt_logprobs=prompt_logprobs)


def check_n(n, max_num_seqs: int) -> None:
    """The server's bound on n: all of one request's children fit in one running batch, so
    a single request cannot queue more work than the engine runs at once."""
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= max_num_seqs:
        raise ValueError(f"n must be an int in [1, {max_num_seqs}] (max_num_seqs), got {n!r}")


class ParentRequest:
    """One request with n > 1: its children's ids, and the latest output of each child."""

    def __init__(self, request: EngineCoreRequest, prompt: str | None) -> None:
        self.request_id = request.request_id
        self.sampling_params = request.sampling_params
        self.prompt, self.prompt_token_ids = prompt, request.prompt_token_ids
        n = self.sampling_params.n
        self.child_ids = [child_request_id(i, self.request_id) for i in range(n)]
        self._index = {cid: i for i, cid in enumerate(self.child_ids)}
        self.pending = set(self.child_ids)      # children not finished yet
        self.outputs = [CompletionOutput(i, "", []) for i in range(n)]
        self.num_cached_tokens = 0
        self.prompt_logprobs = None     # the first child's (see child_sampling_params)

    @property
    def n(self) -> int:
        return len(self.child_ids)

    def child_requests(self, request: EngineCoreRequest) -> list[EngineCoreRequest]:
        """The n requests the core runs instead of `request` (the parent)."""
        sp = self.sampling_params
        return [msgspec.structs.replace(request, request_id=cid,
                                        sampling_params=child_sampling_params(sp, i))
                for i, cid in enumerate(self.child_ids)]

    @property
    def finished(self) -> bool:
        return not self.pending

    def add_output(self, child: RequestOutput) -> RequestOutput:
        """Fold one child's (cumulative) output in; returns the parent's cumulative output:
        all n completions as of now, finished once every child is."""
        i = self._index[child.request_id]
        self.outputs[i] = dataclasses.replace(child.outputs[0], index=i)
        if i == 0:      # what the prompt found cached when the parent arrived
            self.num_cached_tokens = child.num_cached_tokens
        if child.prompt_logprobs is not None:
            self.prompt_logprobs = child.prompt_logprobs
        if child.finished:
            self.pending.discard(child.request_id)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             list(self.outputs), self.finished, self.num_cached_tokens,
                             self.prompt_logprobs)


class ParentRequests:
    """The frontend's parents, by their own id and by each child's id."""

    def __init__(self) -> None:
        self.parents: dict[str, ParentRequest] = {}
        self.by_child: dict[str, ParentRequest] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.parents

    def fan_out(self, prompt: str | None, request: EngineCoreRequest
                ) -> tuple[ParentRequest | None, list[EngineCoreRequest]]:
        """(the parent or None, the requests for the core); registers nothing (see add)."""
        if request.sampling_params.n == 1:
            return None, [request]
        parent = ParentRequest(request, prompt)
        return parent, parent.child_requests(request)

    def add(self, parent: ParentRequest) -> None:
        self.parents[parent.request_id] = parent
        for cid in parent.child_ids:
            self.by_child[cid] = parent

    def remove(self, parent: ParentRequest) -> None:
        self.parents.pop(parent.request_id, None)
        for cid in parent.child_ids:
            self.by_child.pop(cid, None)

    def expand(self, request_ids: Iterable[str]) -> list[str]:
        """Request ids with each parent's replaced by its children's (what the core knows)."""
        out: list[str] = []
        for rid in request_ids:
            parent = self.parents.get(rid)
            out.extend(parent.child_ids if parent is not None else (rid,))
        return out

    def abort(self, request_ids: Iterable[str]) -> list[str]:
        """expand(), forgetting the parents named: the ids the core must abort."""
        ids = list(request_ids)
        out = self.expand(ids)
        for rid in ids:
            parent = self.parents.get(rid)
            if parent is not None:
                self.remove(parent)
        return out

    def to_parent(self, out: RequestOutput) -> RequestOutput:
        """A child's output as its parent's (dropping the parent once it has finished);
        any other request's output unchanged."""
        parent = self.by_child.get(out.request_id)
        if parent is None:
            return out
        agg = parent.add_output(out)
        if agg.finished:
            self.remove(parent)
        return agg

    def process(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """One step's outputs with children folded into their parents: one output per parent
        (its newest, which is cumulative), in the order of each parent's first child."""
        res: list[RequestOutput] = []
        slot: dict[str, int] = {}
        for o in outputs:
            o = self.to_parent(o)
            if o.request_id in slot:
                res[slot[o.request_id]] = o
            else:
                slot[o.request_id] = len(res)
                res.append(o)
        return res
