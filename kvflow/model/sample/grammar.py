"""The runner's half of structured outputs: the engine core's grammar bitmask applied to the
logits rows of the requests it covers (disallowed tokens to -inf), before any sampling."""
from __future__ import annotations

import torch


def bitmask_rows(structured_ids: list[str], sample_reqs, drafts: list[list[int]]
                 ) -> tuple[list[int], list[int]]:
    """(logits rows, bitmask rows) to mask. Request i of sample_reqs owns len(drafts[i]) + 1
    consecutive logits rows; a structured request has no drafts (the proposer gives it none:
    each draft row would need the mask of the tokens before it), so it owns one row."""
    index = {rid: k for k, rid in enumerate(structured_ids)}
    rows, src, o = [], [], 0
    for r, d in zip(sample_reqs, drafts):
        k = index.get(r.req_id)
        if k is not None and not d:
            rows.append(o)
            src.append(k)
        o += len(d) + 1
    return rows, src


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                          structured_ids: list[str], sample_reqs, drafts: list[list[int]]) -> None:
    """Set the logits each structured request's grammar disallows to -inf, in place: the greedy
    argmax and every draw then keep to the grammar. bitmask row k belongs to structured_ids[k]
    (SchedulerOutput.structured_output_request_ids)."""
    rows, src = bitmask_rows(structured_ids, sample_reqs, drafts)
    if not rows:
        return
    import xgrammar as xgr      # only once a grammar exists (the core made the bitmask)
    if rows != src or bitmask.shape[0] != logits.shape[0]:
        # xgrammar's kernels index logits and bitmask by the same row: align the bitmask
        # (all-ones rows elsewhere; only `rows` are read).
        aligned = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
        aligned[rows] = bitmask[src]
        bitmask = aligned
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)
