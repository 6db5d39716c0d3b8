"""What the model runner keeps per request (CachedRequestState, vLLM's name) and the flattened
inputs of one step (StepInputs), built from the SchedulerOutput alone."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvflow.core.outputs import NewRequestData
from kvflow.model.sample.logits_processors import bad_word_bans
from kvflow.sampling_params import SamplingParams


@dataclass(slots=True)
class CachedRequestState:
    """What the runner knows of a request (vLLM's name): its tokens, including those it sampled
    itself, its block table and how far its KV is computed."""
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]                # the runner's own copy, extended step by step
    num_computed_tokens: int
    min_tokens_banned: list[int] | None     # EOS and stop token ids, masked below min_tokens
    bias: torch.Tensor | None = None        # static_bias(): allowed ids, bad words, logit_bias
    slot: int | None = None                 # its row in the runner's TokenCounts (penalties)

    @classmethod
    def from_new(cls, nr: NewRequestData) -> "CachedRequestState":
        sp = nr.sampling_params
        banned = set(sp.stop_token_ids)
        if nr.eos_token_id is not None and not sp.ignore_eos:
            banned.add(nr.eos_token_id)
        return cls(nr.req_id, nr.prompt_token_ids + nr.output_token_ids,
                   len(nr.prompt_token_ids), sp, list(nr.block_ids), nr.num_computed_tokens,
                   sorted(banned) or None)

    def banned(self, ahead: int = 0) -> list[int] | None:
        """Below min_tokens, EOS and the stop token ids may not be sampled at all (vLLM's
        MinTokensLogitsProcessor); the scheduler only declines to stop on them. ahead: the
        token `ahead` places after the next one (a row verifying drafts). Plus the last token
        of a multi-token bad word whose other tokens end the output."""
        sp = self.sampling_params
        n_out = len(self.token_ids) - self.num_prompt_tokens + ahead
        out = self.min_tokens_banned if n_out < sp.min_tokens else None
        if sp.bad_words_token_ids:
            bans = bad_word_bans(sp, self.token_ids[self.num_prompt_tokens:])
            if bans:
                out = (out or []) + bans
        return out


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
    sample_reqs: list[CachedRequestState]
    drafts: list[list[int]]             # per sample_req: the draft tokens it verifies
    # Rows scored for prompt_logprobs (after logits_rows in the logits), and per request
    # (state, the prompt tokens those rows predict).
    prompt_rows: list[int] = None
    prompt_reqs: list[tuple[CachedRequestState, list[int]]] = None

    @property
    def rows(self) -> list[int]:
        return self.logits_rows + self.prompt_rows if self.prompt_rows else self.logits_rows


def add_prompt_rows(st: StepInputs, req: CachedRequestState, start: int, end: int) -> None:
    """Rows of a prompt chunk [start, end) that predict prompt tokens: position q scores token
    q + 1. Only on the request's first pass over its prompt (a resumed request, holding sampled
    tokens, has reported them already)."""
    p = req.num_prompt_tokens
    if len(req.token_ids) != p or start + 1 >= p:
        return
    n = min(end, p - 1) - start
    first = st.query_start_loc[-1] - (end - start)
    if st.prompt_rows is None:
        st.prompt_rows, st.prompt_reqs = [], []
    st.prompt_rows.extend(range(first, first + n))
    st.prompt_reqs.append((req, req.token_ids[start + 1:start + 1 + n]))
