"""A multi-turn, shared-prefix workload: many users, a few long system prompts, conversations.

Each of `num_users` users is tied to one of `num_system_prompts` system prompts (user u to
u % num_system_prompts: every system prompt equally popular) and holds a conversation of `turns`
turns. Turn k's prompt is the user's system prompt, then every earlier turn's question and
answer, then a new question; its output length is the answer's length. Questions are fresh
token ids (never seen before, so they share nothing); an answer is the simulator's sampled
token (SAMPLED_TOKEN) repeated, because those are the tokens the simulated replica generated
and cached: the next turn's prompt hits the blocks of the previous answer exactly as a real
client that sends the model's reply back would.

Arrivals are open-loop: users start their conversations as a Poisson process
(`session_rate` per second), and turn k+1 arrives an exponential think time (mean
`think_time` s, plus `min_gap` s) after turn k *arrived*, whether or not turn k has finished in
the simulation. With think times well above the end-to-end latency (seconds here, tens of
seconds of think time) almost every turn arrives after its predecessor finished; the few that
do not simply miss the cache of the answer still being generated. A closed loop (arrive after
the previous turn finishes) would make arrivals depend on the policy under test.

Prompts are built on demand from the stored pieces (a few thousand tokens each), so a workload
of 10,000 turns holds its questions, not 10,000 full prompts. Everything is drawn from one seeded
generator: the same arguments give the same workload.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvflow.sim.simulator import SAMPLED_TOKEN
from kvflow.sim.workload import Workload

_SYSTEM_BASE = 1_000_000        # system prompt ids: 1e6 + 100,003 * s + position
_QUESTION_BASE = 1 << 26        # question ids: unique across the whole workload


@dataclass(frozen=True, slots=True)
class Turn:
    user: int
    turn: int           # 0-based


class ConversationPrompts:
    """Lazy prompts: prompts[i] is request i's token ids (a new list each time)."""
    __slots__ = ("system", "user_system", "questions", "answers", "turns")

    def __init__(self, system: list[list[int]], user_system: list[int],
                 questions: list[list[list[int]]], answers: list[list[int]],
                 turns: list[Turn]) -> None:
        self.system, self.user_system = system, user_system
        self.questions, self.answers = questions, answers     # per user, per turn
        self.turns = turns                                    # per request, arrival order

    def __len__(self) -> int:
        return len(self.turns)

    def __getitem__(self, i: int) -> list[int]:
        tr = self.turns[i]
        u = tr.user
        ids = list(self.system[self.user_system[u]])
        qs, ans = self.questions[u], self.answers[u]
        for j in range(tr.turn):
            ids += qs[j]
            ids.extend([SAMPLED_TOKEN] * ans[j])
        ids += qs[tr.turn]
        return ids


def _lengths(rng: np.random.Generator, mean: float, size, lo: int, hi_factor: float) -> np.ndarray:
    """Lognormal lengths (sigma 0.5) with the given mean, clipped to [lo, hi_factor * mean]."""
    sigma = 0.5
    x = rng.lognormal(np.log(mean) - sigma * sigma / 2, sigma, size)
    return np.clip(np.rint(x), lo, max(lo, hi_factor * mean)).astype(np.int64)


def multi_turn(num_users: int = 64, num_system_prompts: int = 4, system_prompt_len: int = 2048,
               turns: int = 6, question_len: int = 128, answer_len: int = 256,
               session_rate: float = 1.0, think_time: float = 20.0, min_gap: float = 2.0,
               seed: int = 0) -> Workload:
    """The workload of the module docstring. Lengths: system prompts uniform in 0.75x-1.25x
    `system_prompt_len` (one draw per prompt); questions and answers lognormal (sigma 0.5)
    around their means, clipped to [8, 2x mean] so the last turn fits an 8k context with the
    defaults (at most 2,560 + 6 x 256 + 5 x 512 prompt tokens + 512 output)."""
    if min(num_users, num_system_prompts, system_prompt_len, turns, question_len,
           answer_len) < 1:
        raise ValueError("users, system prompts, turns and lengths must all be >= 1")
    if session_rate <= 0 or think_time < 0 or min_gap < 0:
        raise ValueError("session_rate must be > 0, think_time and min_gap >= 0")
    rng = np.random.default_rng(seed)
    sys_lens = np.rint(rng.uniform(0.75, 1.25, num_system_prompts) * system_prompt_len)
    system = [[_SYSTEM_BASE + 100_003 * s + p for p in range(max(1, int(n)))]
              for s, n in enumerate(sys_lens)]
    user_system = [u % num_system_prompts for u in range(num_users)]
    q_lens = _lengths(rng, question_len, (num_users, turns), 8, 2.0)
    a_lens = _lengths(rng, answer_len, (num_users, turns), 8, 2.0)
    starts = np.cumsum(rng.exponential(1.0 / session_rate, num_users))
    starts -= starts[0]
    gaps = min_gap + rng.exponential(think_time, (num_users, turns))
    gaps[:, 0] = 0.0
    arrive = starts[:, None] + np.cumsum(gaps, axis=1)

    nxt = _QUESTION_BASE
    questions = []
    for u in range(num_users):
        qs = []
        for k in range(turns):
            n = int(q_lens[u, k])
            qs.append(list(range(nxt, nxt + n)))
            nxt += n
        questions.append(qs)
    answers = a_lens.tolist()

    order = np.argsort(arrive, axis=None, kind="stable")
    users, ks = np.unravel_index(order, arrive.shape)
    turn_list = [Turn(int(u), int(k)) for u, k in zip(users, ks)]
    prompt_lens = np.array([len(system[user_system[t.user]])
                            + int(q_lens[t.user, :t.turn + 1].sum())
                            + int(a_lens[t.user, :t.turn].sum()) for t in turn_list],
                           dtype=np.int64)
    out_lens = np.array([a_lens[t.user, t.turn] for t in turn_list], dtype=np.int64)
    prompts = ConversationPrompts(system, user_system, questions, answers, turn_list)
    name = (f"multi-turn-{num_users}u-{num_system_prompts}sys-{turns}t")
    return Workload(name, arrive.ravel()[order].astype(np.float64), prompt_lens, out_lens,
                    prompts=prompts)
