"""Speculative decoding under random load (hypothesis): the real Scheduler with a fake model.

The fake model is deterministic: the token after a prefix is a hash of the prefix, over a tiny
vocabulary (so n-grams repeat and drafts are often right). A fake executor verifies drafts the
way the runner does (greedy: accept the drafts that equal the model's token, then one more) and
writes a fake KV cache whose every slot holds a fingerprint of the prefix that produced it, the
drafts included. Drafts come from an oracle that knows the true continuation and corrupts it at
random, so some are accepted, some rejected, at every position.

Rules checked: each request's tokens are exactly those of the same run without drafts, under
chunked prefill, preemption, prefix-cache hits and aborts; every attended KV slot holds the
request's real prefix (a rejected draft's KV is never read); drafts never exceed the budget or
max_model_len; at the end every block is free.
"""
from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow import SamplingParams
from kvflow.core import Request, RequestStatus, Scheduler, SchedulerConfig
from kvflow.core.config import SpeculativeConfig

VOCAB = 4


def model_token(prefix_fp: int) -> int:
    return hash((prefix_fp, "next")) % VOCAB


def extend_fp(fp: int, pos: int, tok: int) -> int:
    return hash((fp, pos, tok))


class FakeEngine:
    def __init__(self, cfg: SchedulerConfig, k: int, seed: int) -> None:
        self.sched = Scheduler(cfg)
        self.bs = cfg.block_size
        self.k = k
        self.rng = random.Random(seed)
        self.kv: dict[int, int] = {}            # slot -> prefix fingerprint
        self.streams: dict[str, list[int]] = {}
        self.accepted = 0

    def fps(self, tokens: list[int]) -> list[int]:
        out, fp = [], -1
        for p, t in enumerate(tokens):
            fp = extend_fp(fp, p, t)
            out.append(fp)
        return out

    def add(self, rid: str, prompt: list[int], sp: SamplingParams, eos: int | None) -> None:
        self.sched.add_request(Request(rid, prompt, sp, eos_token_id=eos))
        self.streams[rid] = []

    def step(self) -> None:
        s = self.sched
        so = s.schedule()
        cfg = s.config
        assert so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        sampled = {}
        for rid, n in so.num_scheduled_tokens.items():
            req = s.requests[rid]
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            end = req.num_computed_tokens
            start = end - n
            real = req.all_token_ids
            assert end <= len(real) + len(drafts) and end <= cfg.max_model_len - 1
            if drafts:
                assert end == len(real) + len(drafts), "drafts must end the scheduled tokens"
            inputs = real + drafts
            fps = self.fps(inputs[:end])
            table = so.block_ids[rid]
            slot = lambda p: table[p // self.bs] * self.bs + p % self.bs     # noqa: E731
            for p in range(start):
                assert self.kv.get(slot(p)) == fps[p], f"{rid} reads bad KV at {p}"
            for p in range(start, end):
                self.kv[slot(p)] = fps[p]
            if end < len(real):
                continue
            toks = []
            for j in range(len(drafts) + 1):
                t = model_token(fps[len(real) - 1 + j])
                toks.append(t)
                if j == len(drafts) or drafts[j] != t:
                    break
            self.accepted += len(toks) - 1
            sampled[rid] = toks
        for o in s.update_from_output(so, sampled):
            self.streams[o.request_id] += o.new_token_ids
        self.propose()

    def propose(self) -> None:
        drafts = {}
        for req in self.sched.running:
            if not req.output_token_ids or req.num_computed_tokens != req.num_tokens - 1:
                continue
            n = self.rng.randint(0, self.k)
            fp = self.fps(req.all_token_ids)[-1]
            d = []
            for j in range(n):
                t = model_token(fp)
                if self.rng.random() < 0.25:
                    t = self.rng.randrange(VOCAB)
                d.append(t)
                fp = extend_fp(fp, req.num_tokens + j, t)
            drafts[req.request_id] = d
        self.sched.update_draft_token_ids(drafts)


def run(cfg: SchedulerConfig, reqs, aborts, k: int, seed: int) -> FakeEngine:
    eng = FakeEngine(cfg, k, seed)
    pending = list(reqs)
    step = 0
    while pending or eng.sched.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt, sp, eos = pending.pop(0)
            eng.add(rid, prompt, sp, eos)
        if step in aborts:
            eng.sched.finish_requests(aborts[step], RequestStatus.FINISHED_ABORTED)
        if eng.sched.has_unfinished_requests():
            eng.step()
        step += 1
        assert step < 5000, "no progress"
    kvm = eng.sched.kv_cache_manager
    assert kvm.num_free_blocks == cfg.num_blocks, "a block leaked"
    return eng


@st.composite
def workloads(draw):
    bs = draw(st.sampled_from([1, 2, 4]))
    cfg = SchedulerConfig(
        block_size=bs, num_blocks=draw(st.integers(12, 40)),
        max_num_batched_tokens=draw(st.integers(3, 24)), max_num_seqs=draw(st.integers(1, 4)),
        max_model_len=draw(st.integers(12, 40)), enable_prefix_caching=draw(st.booleans()),
        long_prefill_token_threshold=draw(st.integers(0, 6)),
        speculative_config=SpeculativeConfig(num_speculative_tokens=4))
    rng = random.Random(draw(st.integers(0, 2**16)))
    base = [rng.randrange(VOCAB) for _ in range(12)]
    reqs = []
    for i in range(draw(st.integers(1, 6))):
        n = rng.randint(1, min(12, cfg.max_model_len - 1))
        shared = rng.randint(0, n)
        prompt = base[:shared] + [rng.randrange(VOCAB) for _ in range(n - shared)]
        max_tokens = rng.randint(1, 16)
        if -(-min(n + max_tokens - 1, cfg.max_model_len) // bs) > cfg.num_blocks:
            continue
        eos = rng.choice([None, None, rng.randrange(VOCAB)])
        sp = SamplingParams(max_tokens=max_tokens, temperature=0,
                            min_tokens=min(max_tokens, rng.choice([0, 0, 3])),
                            stop_token_ids=rng.choice([[], [rng.randrange(VOCAB)]]))
        reqs.append((rng.randint(0, 6), f"r{i}", prompt, sp, eos))
    reqs.sort(key=lambda r: r[0])
    aborts = {}
    if reqs and draw(st.booleans()):
        aborts[rng.randint(1, 12)] = [rng.choice(reqs)[1]]
    return cfg, reqs, aborts


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.integers(0, 2**16))
def test_greedy_tokens_with_drafts_equal_those_without(w, seed):
    cfg, reqs, aborts = w
    with_drafts = run(cfg, reqs, aborts, k=4, seed=seed)
    plain = run(cfg, reqs, aborts, k=0, seed=seed)
    aborted = {rid for ids in aborts.values() for rid in ids}
    for rid, toks in plain.streams.items():
        if rid in aborted:      # aborted at the same step, but after a different number of tokens
            n = min(len(toks), len(with_drafts.streams[rid]))
            assert with_drafts.streams[rid][:n] == toks[:n]
        else:
            assert with_drafts.streams[rid] == toks, rid


def test_the_property_run_accepts_and_rejects_drafts():
    """The harness is not vacuous: over a fixed workload drafts are both accepted and cut."""
    cfg = SchedulerConfig(block_size=2, num_blocks=40, max_num_batched_tokens=16,
                          max_model_len=40, speculative_config=SpeculativeConfig())
    sp = SamplingParams(max_tokens=20, temperature=0)
    reqs = [(0, f"r{i}", [i % VOCAB, 1, 2, 3, 0, 1], sp, None) for i in range(3)]
    eng = run(cfg, reqs, {}, k=4, seed=1)
    st_ = eng.sched.spec_stats
    assert eng.accepted > 0 and st_.num_accepted_tokens == eng.accepted
    assert st_.num_draft_tokens > st_.num_accepted_tokens
    assert all(len(t) == 20 for t in eng.streams.values())
