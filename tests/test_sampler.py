"""kvflow.model.sample.sampler.Sampler on hand-made logits (no model): greedy, temperature, top-k,
top-p, the sampled distribution, per-request seeds and batch-composition independence."""
import pytest
import torch

from kvflow import SamplingParams
from kvflow.model.sample.sampler import Sampler

V = 8
# Distinct values, not sorted, so that a sort/scatter mix-up shows.
BASE = torch.tensor([0.3, 2.0, -1.0, 1.2, 0.0, 1.7, -0.5, 0.9])
ORDER = BASE.argsort(descending=True).tolist()     # token ids from most to least likely


def rand_logits(n: int, v: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * 3


def sample(logits, params, generators=None, seed=0, **kw):
    if generators is None:
        generators = [None] * len(params)
    return Sampler(seed=seed)(logits, params, generators, **kw)


def rows(n: int) -> torch.Tensor:
    return BASE.repeat(n, 1)


# ---- greedy-equivalents ------------------------------------------------------------------------
def test_all_greedy_rows_are_argmax():
    logits = rand_logits(16)
    out = sample(logits, [SamplingParams(temperature=0.0)] * 16)
    assert out == logits.argmax(-1).tolist()
    assert all(isinstance(t, int) for t in out)


def test_temperature_with_top_k_1_is_argmax():
    logits = rand_logits(64, seed=1)
    for temp in (0.5, 1.0, 5.0):
        out = sample(logits, [SamplingParams(temperature=temp, top_k=1)] * 64)
        assert out == logits.argmax(-1).tolist(), temp


def test_tiny_top_p_is_argmax():
    logits = rand_logits(64, seed=2)
    out = sample(logits, [SamplingParams(temperature=1.0, top_p=1e-6)] * 64)
    assert out == logits.argmax(-1).tolist()


def test_top_k_covering_the_vocab_is_no_restriction():
    n = 2000
    out = sample(rows(n), [SamplingParams(temperature=1.0, top_k=V)] * n)
    assert set(out) == set(range(V))


# ---- restrictions ------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [2, 3, 5])
def test_top_k_only_yields_the_k_largest(k):
    n = 3000
    out = sample(rows(n), [SamplingParams(temperature=2.0, top_k=k)] * n)
    # At a high temperature every allowed token shows up, and nothing else.
    assert set(out) == set(ORDER[:k])


def _nucleus(probs: torch.Tensor, p: float) -> set[int]:
    """Smallest set of most likely tokens whose mass reaches p."""
    vals, idx = probs.sort(descending=True)
    keep, mass = set(), 0.0
    for v, i in zip(vals.tolist(), idx.tolist()):
        keep.add(i)
        mass += v
        if mass >= p:
            break
    return keep


@pytest.mark.parametrize("p", [0.3, 0.6, 0.85])
def test_top_p_only_yields_the_nucleus(p):
    n = 3000
    out = sample(rows(n), [SamplingParams(temperature=1.0, top_p=p)] * n)
    assert set(out) == _nucleus(BASE.softmax(-1), p)


def test_top_k_and_top_p_together():
    n = 3000
    # top_k=4 keeps 4 tokens; top_p is then taken over their renormalized mass.
    out = sample(rows(n), [SamplingParams(temperature=1.0, top_k=4, top_p=0.7)] * n)
    top4 = torch.full((V,), float("-inf"))
    top4[ORDER[:4]] = BASE[ORDER[:4]]
    assert set(out) == _nucleus(top4.softmax(-1), 0.7)
    assert set(out) <= set(ORDER[:4])


def test_rows_with_different_top_k_in_one_batch():
    n = 1500
    params = [SamplingParams(temperature=2.0, top_k=1)] * n + \
             [SamplingParams(temperature=2.0, top_k=3)] * n + [SamplingParams(temperature=2.0)] * n
    out = sample(rows(3 * n), params)
    assert set(out[:n]) == {ORDER[0]}
    assert set(out[n:2 * n]) == set(ORDER[:3])
    assert set(out[2 * n:]) == set(range(V))


# ---- the distribution --------------------------------------------------------------------------
@pytest.mark.parametrize("temp", [1.0, 0.5])
def test_empirical_frequencies_match_softmax(temp):
    n = 4000
    out = torch.tensor(sample(rows(n), [SamplingParams(temperature=temp)] * n))
    freq = torch.bincount(out, minlength=V).float() / n
    expected = (BASE / temp).softmax(-1)
    assert (freq - expected).abs().max().item() < 0.03, (freq, expected)


def test_unseeded_rows_are_not_all_the_same():
    out = sample(rows(200), [SamplingParams(temperature=1.0)] * 200)
    assert len(set(out)) > 2


# ---- per-request seeds -------------------------------------------------------------------------
def _seeded_sequence(seed: int, batch_for_step, steps: int = 30) -> list[int]:
    """Sample `steps` tokens for one seeded row (row 0), each step in a batch of other rows."""
    sampler = Sampler(seed=123)
    g = torch.Generator().manual_seed(seed)
    seq = []
    for s in range(steps):
        others = batch_for_step(s)
        logits = torch.cat([rand_logits(1, V, seed=1000 + s), others[0]])
        params = [SamplingParams(temperature=1.0, seed=seed)] + others[1]
        gens = [g] + others[2]
        seq.append(sampler(logits, params, gens)[0])
    return seq


def _alone(s):
    return torch.empty(0, V), [], []


def _crowded(s):
    n = 1 + s % 5
    params = [SamplingParams(temperature=0.7 + 0.1 * i, top_k=i % 3, seed=None if i % 2 else 9)
              for i in range(n)]
    gens = [None if p.seed is None else torch.Generator().manual_seed(77 + i)
            for i, p in enumerate(params)]
    return rand_logits(n, V, seed=s), params, gens


def test_same_seed_same_sequence_regardless_of_batch():
    alone = _seeded_sequence(5, _alone)
    assert alone == _seeded_sequence(5, _alone)
    assert alone == _seeded_sequence(5, _crowded)
    assert len(set(alone)) > 1      # it really samples


def test_seeded_row_position_in_batch_does_not_matter():
    logits = rows(4)
    g1, g2 = torch.Generator().manual_seed(42), torch.Generator().manual_seed(42)
    sp = SamplingParams(temperature=1.0, seed=42)
    other = SamplingParams(temperature=1.0)
    a = [Sampler(0)(logits, [sp, other, other, other], [g1, None, None, None])[0]
         for _ in range(20)]
    b = [Sampler(1)(logits, [other, other, other, sp], [None, None, None, g2])[3]
         for _ in range(20)]
    assert a == b


def test_different_seeds_differ():
    assert _seeded_sequence(5, _alone) != _seeded_sequence(6, _alone)


def test_sampler_seed_makes_unseeded_rows_reproducible():
    params = [SamplingParams(temperature=1.0)] * 50
    assert sample(rows(50), params, seed=3) == sample(rows(50), params, seed=3)
    assert sample(rows(50), params, seed=3) != sample(rows(50), params, seed=4)


# ---- mixed batches -----------------------------------------------------------------------------
def test_mixed_greedy_and_sampled_rows():
    n = 600
    logits = rand_logits(2 * n, V, seed=7)
    params = []
    for i in range(2 * n):
        params.append(SamplingParams(temperature=0.0) if i % 2 == 0
                      else SamplingParams(temperature=1.0, top_k=2))
    out = sample(logits, params)
    am = logits.argmax(-1).tolist()
    top2 = logits.topk(2, dim=-1).indices.tolist()
    assert [out[i] for i in range(0, 2 * n, 2)] == am[0::2]
    assert all(out[i] in top2[i] for i in range(1, 2 * n, 2))
    # The sampled rows are not secretly greedy.
    assert any(out[i] != am[i] for i in range(1, 2 * n, 2))


def test_greedy_row_ignores_its_top_k_top_p_and_a_high_temperature_neighbour():
    logits = rand_logits(3, V, seed=8)
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5),
              SamplingParams(temperature=100.0),
              SamplingParams(temperature=0.0, seed=4)]
    for _ in range(20):
        out = sample(logits, params, [None, None, torch.Generator().manual_seed(4)])
        assert out[0] == logits[0].argmax().item() and out[2] == logits[2].argmax().item()


def test_tiny_temperature_is_argmax_and_minus_inf_tokens_are_never_drawn():
    logits = rand_logits(32, V, seed=9)
    assert sample(logits, [SamplingParams(temperature=1e-6)] * 32) == logits.argmax(-1).tolist()
    masked = rows(1500)
    masked[:, ORDER[0]] = float("-inf")     # the best token is forbidden
    for sp in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=3),
               SamplingParams(temperature=1.0, top_p=0.9)):
        assert ORDER[0] not in set(sample(masked, [sp] * 1500)), sp


def test_a_temperature_below_1e_5_is_greedy_even_between_near_ties():
    # 1e-6 apart: at temperature 5e-6 a real draw would pick the runner-up ~45% of the time.
    logits = torch.tensor([[1.0, 1.0 + 1e-6, -3.0]]).repeat(200, 1)
    params = [SamplingParams(temperature=5e-6, seed=i) for i in range(200)]
    gens = [torch.Generator().manual_seed(i) for i in range(200)]
    assert sample(logits, params, gens) == [1] * 200
    mixed = params[:100] + [SamplingParams(temperature=1.0)] * 100    # not the all-greedy path
    assert sample(logits, mixed, gens[:100] + [None] * 100)[:100] == [1] * 100


# ---- min_tokens: EOS and stop tokens banned below it (vLLM's MinTokensLogitsProcessor) -----------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_banned_tokens_are_never_drawn_on_any_path(dtype):
    logits = rows(300).to(dtype)
    logits[:, ORDER[1]] += 50                  # ORDER[1] is now far ahead: every path picks it
    ban = [ORDER[1], ORDER[2]]
    greedy = SamplingParams(temperature=0)
    all_greedy = sample(logits, [greedy] * 300, None, banned=[ban] * 150 + [None] * 150)
    assert all_greedy == [ORDER[0]] * 150 + [ORDER[1]] * 150       # the argmax kernel's path
    params = [greedy, SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, seed=3),
              SamplingParams(temperature=2.0, top_k=3), SamplingParams(temperature=1.0, top_p=0.9)]
    params = params * 60
    gens = [torch.Generator().manual_seed(3) if p.seed is not None else None for p in params]
    got = sample(logits, params, gens, banned=[ban] * 300)
    assert not set(got) & set(ban)
    assert got[0] == ORDER[0]
    assert sample(logits, params, gens, banned=[None] * 300) == [ORDER[1]] * 300
