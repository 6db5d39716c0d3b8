"""Structured outputs through xgrammar, judged on a random-weight tiny model: whatever it samples,
a JSON schema's output parses and validates, regexes and choices match, in the offline LLM and
through the server with the official `openai` client; bad grammars are refused by name; batches
mixing structured and plain requests, preemption, drafts and aborts leave the rest unchanged and
nothing behind."""
from __future__ import annotations

import json
import re

import jsonschema
import msgspec
import openai
import pytest
import torch

from helpers import make_sched, req
from kvflow import LLM, SamplingParams
from kvflow.engine.messages import EngineCoreRequest
from kvflow.model.sample.grammar import apply_grammar_bitmask
from kvflow import StructuredOutputsParams as SO
from server_helpers import running_server, wait_idle

# Enums, booleans, bounded integers, a small object and a short array: every value is bounded,
# so a random model's output always ends (free strings and integers could run past max_tokens).
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9,
                                                         "maximum": 9}, "y": {"type": "boolean"}},
                  "required": ["x", "y"], "additionalProperties": False},
    },
    "required": ["color", "ok", "tags", "point"],
    "additionalProperties": False,
}
PROMPTS = ["The cat sees", "Hello, world!", "Number 7 plus", "A small bird"]


def sampled(n: int, max_tokens: int = 120, **so) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens,
                           structured_outputs=SO(**so)) for i in range(n)]


def prompts(n: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] for i in range(n)]


def assert_valid(text: str, schema: dict = SCHEMA) -> None:
    jsonschema.validate(json.loads(text), schema)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    n = torch.get_num_threads()
    yield LLM(tiny_llama, dtype="float32", max_model_len=256, num_blocks=256, num_threads=1)
    torch.set_num_threads(n)


def core_of(llm):
    return llm.llm_engine.engine_core


@pytest.fixture(autouse=True)
def _nothing_left(request):
    """Every offline test ends with no request, block or grammar matcher held."""
    yield
    if "llm" in request.fixturenames:
        st = core_of(request.getfixturevalue("llm")).kv_state()
        assert st["unfinished"] == st["runner_requests"] == st["grammars"] == 0
        assert st["free_blocks"] == st["num_blocks"]


# ---- the offline LLM ---------------------------------------------------------------------------
def test_json_schema_output_always_validates(llm):
    outs = llm.generate(prompts(32), sampled(32, json=SCHEMA), use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        assert_valid(c.text)
    assert len({o.outputs[0].text for o in outs}) > 8     # sampled, not one answer


def test_a_schema_given_as_json_text_works_the_same(llm):
    a = llm.generate(prompts(4), sampled(4, json=SCHEMA), use_tqdm=False)
    b = llm.generate(prompts(4), sampled(4, json=json.dumps(SCHEMA)), use_tqdm=False)
    assert [o.outputs[0].text for o in a] == [o.outputs[0].text for o in b]


def test_json_object_outputs_parse_as_objects(llm):
    outs = [o.outputs[0] for o in llm.generate(prompts(16), sampled(16, json_object=True),
                                               use_tqdm=False)]
    done = [c for c in outs if c.finish_reason == "stop"]
    assert len(done) >= 4       # random free strings may run to max_tokens; ended ones parse
    assert all(isinstance(json.loads(c.text), dict) for c in done)
    assert all(c.text.startswith("{") for c in outs)


def test_regex_choice_and_grammar_outputs_match(llm):
    regex = r"[0-9]{2,4}-(yes|no)!"
    for c in (o.outputs[0] for o in llm.generate(prompts(8), sampled(8, regex=regex),
                                                 use_tqdm=False)):
        assert c.finish_reason == "stop" and re.fullmatch(regex, c.text), c.text
    choices = ["yes", "no", "maybe so", 'a "quoted" one']
    texts = [o.outputs[0].text for o in llm.generate(prompts(12), sampled(12, choice=choices),
                                                     use_tqdm=False)]
    assert set(texts) <= set(choices) and len(set(texts)) > 1
    ebnf = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | [0-9]'
    for o in llm.generate(prompts(8), sampled(8, grammar=ebnf), use_tqdm=False):
        assert re.fullmatch(r"\([a-c0-9](,[a-c0-9])*\)", o.outputs[0].text), o.outputs[0].text


def test_greedy_structured_output_repeats(llm):
    sp = SamplingParams(temperature=0, max_tokens=120, structured_outputs=SO(json=SCHEMA))
    a, b = (llm.generate(PROMPTS, sp, use_tqdm=False) for _ in range(2))
    assert [o.outputs[0].text for o in a] == [o.outputs[0].text for o in b]
    for o in a:
        assert_valid(o.outputs[0].text)


def test_plain_requests_are_unchanged_by_structured_ones_in_their_batch(llm):
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, plain, use_tqdm=False)]
    mixed = llm.generate(PROMPTS + prompts(8), [plain] * 4 + sampled(8, json=SCHEMA),
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:4]] == alone
    for o in mixed[4:]:
        assert_valid(o.outputs[0].text)


def test_a_request_ignoring_eos_still_ends_with_its_grammar(llm):
    sps = [SamplingParams(temperature=1.0, seed=i, max_tokens=50, ignore_eos=True,
                          structured_outputs=SO(choice=["yes", "no"])) for i in range(4)]
    for o in llm.generate(prompts(4), sps, use_tqdm=False):
        assert o.outputs[0].finish_reason == "stop" and o.outputs[0].text in ("yes", "no")


def test_min_tokens_past_the_grammars_end_stops_at_the_end(llm):
    """EOS is banned below min_tokens, yet the grammar allows nothing else: the request ends
    there, its output complete, rather than sampling outside the grammar."""
    sps = [SamplingParams(temperature=1.0, seed=i, max_tokens=50, min_tokens=20,
                          structured_outputs=SO(choice=["yes", "no"])) for i in range(4)]
    for o in llm.generate(prompts(4), sps, use_tqdm=False):
        assert o.outputs[0].finish_reason == "stop" and o.outputs[0].text in ("yes", "no")


def test_penalties_bias_and_logprobs_keep_to_the_grammar(llm):
    """Bias and penalties come after the mask: a disallowed token stays at -inf even when biased
    up; logprobs (after the mask, as in vLLM) are finite for every chosen token."""
    tok = llm.get_tokenizer()
    biased = {t: 100.0 for t in tok.encode("zebra quiet")}
    sps = [SamplingParams(temperature=1.0, seed=i, max_tokens=120, repetition_penalty=1.3,
                          presence_penalty=1.0, logit_bias=biased, logprobs=2,
                          structured_outputs=SO(json=SCHEMA)) for i in range(6)]
    for o in llm.generate(prompts(6), sps, use_tqdm=False):
        c = o.outputs[0]
        assert c.finish_reason == "stop"
        assert_valid(c.text)
        assert len(c.logprobs) == len(c.token_ids)
        assert all(lp[t].logprob > float("-inf") for lp, t in zip(c.logprobs, c.token_ids))


def test_allowed_token_ids_that_exclude_the_grammar_fail_that_request_alone(llm):
    tok = llm.get_tokenizer()
    sps = [SamplingParams(temperature=0, max_tokens=20, allowed_token_ids=tok.encode("xyz"),
                          structured_outputs=SO(choice=["yes", "no"])),
           SamplingParams(temperature=0, max_tokens=20, structured_outputs=SO(choice=["ok"]))]
    bad, good = llm.generate(PROMPTS[:2], sps, use_tqdm=False)
    assert bad.outputs[0].finish_reason == "error"
    assert "structured_outputs" in str(bad.outputs[0].error)
    assert good.outputs[0].text == "ok" and good.outputs[0].finish_reason == "stop"


def test_a_grammar_xgrammar_refuses_fails_that_request_alone(llm):
    sps = [SamplingParams(max_tokens=8, structured_outputs=SO(regex="a(b")),
           SamplingParams(temperature=0, max_tokens=8),
           SamplingParams(max_tokens=8, structured_outputs=SO(json={"type": "frob"}))]
    bad1, good, bad2 = llm.generate(PROMPTS[:3], sps, use_tqdm=False)
    assert good.outputs[0].finish_reason == "length"
    for o, field in ((bad1, "structured_outputs.regex"), (bad2, "structured_outputs.json")):
        assert o.outputs[0].finish_reason == "error"
        assert isinstance(o.outputs[0].error, ValueError) and field in str(o.outputs[0].error)


def test_aborted_structured_requests_leave_no_matcher_or_block(llm):
    engine = llm.llm_engine
    for i, sp in enumerate(sampled(6, json=SCHEMA)):
        engine.add_request(f"abort-{i}", PROMPTS[i % 4], sp)
    for _ in range(3):
        engine.step()
    assert core_of(llm).kv_state()["grammars"] == 6
    engine.abort_request([f"abort-{i}" for i in range(6)])
    st = core_of(llm).kv_state()
    assert st["grammars"] == 0 and st["free_blocks"] == st["num_blocks"]


def test_a_preempted_structured_request_still_validates(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", max_model_len=256, num_blocks=40, block_size=4,
              num_threads=1)
    outs = llm.generate(prompts(8), sampled(8, json=SCHEMA), use_tqdm=False)
    core = core_of(llm)
    assert core.scheduler.num_preemptions > 0
    for o in outs:
        assert o.outputs[0].finish_reason == "stop"
        assert_valid(o.outputs[0].text)
    assert core.kv_state()["grammars"] == 0


def test_structured_requests_beside_requests_verifying_drafts(tiny_llama):
    """The bitmask lands on the right logits rows when other requests own several (drafts)."""
    llm = LLM(tiny_llama, dtype="float32", max_model_len=256, num_threads=1,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                  "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    repeats = [{"prompt_token_ids": list(range(20, 44)) * 3}, {"prompt_token_ids": [7, 8] * 20}]
    alone = [o.outputs[0].token_ids for o in llm.generate(repeats, plain, use_tqdm=False)]
    mixed = llm.generate(repeats + prompts(6), [plain] * 2 + sampled(6, json=SCHEMA),
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone
    for o in mixed[2:]:
        assert_valid(o.outputs[0].text)
    assert core_of(llm).scheduler.spec_stats.num_drafts > 0


# ---- the pieces ---------------------------------------------------------------------------------
def test_only_structured_requests_that_sample_need_a_bitmask_row():
    s = make_sched(block_size=4, num_blocks=64, max_num_batched_tokens=11,
                   long_prefill_token_threshold=6)
    s.add_request(req("plain", 3))
    s.add_request(req("long", 12, structured_outputs=SO(regex="a+")))
    s.add_request(req("short", 2, structured_outputs=SO(regex="b+")))
    so = s.schedule()       # "long" gets a 6-token chunk of 12: it samples nothing yet
    assert so.num_scheduled_tokens == {"plain": 3, "long": 6, "short": 2}
    assert so.structured_output_request_ids == ["short"]
    s.update_from_output(so, {"plain": [1], "short": [1]})
    so = s.schedule()
    assert so.structured_output_request_ids == ["long", "short"]


def test_the_bitmask_masks_only_its_requests_rows_past_other_requests_drafts():
    class R:
        def __init__(self, rid):
            self.req_id = rid
    vocab = 100
    logits = torch.zeros(6, vocab)
    reqs, drafts = [R("d"), R("s1"), R("p"), R("s2")], [[5, 6], [], [], []]
    bitmask = torch.zeros(2, 4, dtype=torch.int32)      # s2 first: rows follow the ids
    bitmask[0, 0] = 1 << 3          # s2 may only produce token 3
    bitmask[1, 2] = 1 << 1          # s1 may only produce token 65
    apply_grammar_bitmask(logits, bitmask, ["s2", "s1"], reqs, drafts)
    finite = [torch.isfinite(row).nonzero().flatten().tolist() for row in logits]
    full = list(range(vocab))
    assert finite == [full, full, full, [65], full, [3]]


def test_structured_outputs_travel_to_an_engine_core_process_intact():
    sp = SamplingParams(structured_outputs=SO(json=SCHEMA))
    r = EngineCoreRequest("r", [1, 2], sp, 2, 0.0)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(r), type=EngineCoreRequest)
    assert back.sampling_params.structured_outputs == SO(json=SCHEMA)


# ---- the server, through the openai client ------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_llama):
    with running_server(tiny_llama) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(api_key="none", base_url=server.url + "/v1", max_retries=0,
                         timeout=60)


MSGS = [{"role": "user", "content": "Describe a point."}]
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA,
                                                          "strict": True}}


def test_chat_json_schema_validates_streamed_and_not(client, server):
    for seed in range(6):
        kw = dict(model="tiny", messages=MSGS, max_tokens=120, temperature=1.0, seed=seed,
                  response_format=RESPONSE_FORMAT)
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "stop"
        assert_valid(r.choices[0].message.content)
        chunks = list(client.chat.completions.create(**kw, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == r.choices[0].message.content
    assert wait_idle(server.llm)["grammars"] == 0


def test_completions_take_vllms_guided_fields(client):
    def text(extra, stream=False, seed=3):
        kw = dict(model="tiny", prompt="Hello", max_tokens=120, temperature=1.0, seed=seed,
                  extra_body=extra)
        if stream:
            return "".join(c.choices[0].text for c in client.completions.create(**kw,
                                                                              stream=True))
        return client.completions.create(**kw).choices[0].text
    assert_valid(text({"guided_json": SCHEMA}))
    assert_valid(text({"guided_json": SCHEMA}, stream=True))
    assert re.fullmatch(r"[0-9]{3}-[ab]", text({"guided_regex": r"[0-9]{3}-[ab]"}))
    assert text({"guided_choice": ["left", "right"]}) in ("left", "right")
    assert re.fullmatch(r"x+y", text({"guided_grammar": 'root ::= "x"+ "y"'}))
    assert_valid(text({"structured_outputs": {"json": SCHEMA}}))
    objects = [text({"response_format": {"type": "json_object"}}, seed=i) for i in range(4)]
    assert all(t.startswith("{") for t in objects)      # free strings may not end in time


def test_response_format_text_asks_for_nothing(client):
    kw = dict(model="tiny", messages=MSGS, max_tokens=10, temperature=0)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw, response_format={"type": "text"})
    assert a.choices[0].message.content == b.choices[0].message.content


BAD = [
    ({"guided_regex": "a(b"}, "guided_regex", "guided_regex cannot be compiled"),
    ({"guided_json": {"type": "frob"}}, "guided_json", "frob"),
    ({"guided_json": 5}, "guided_json", "guided_json must be"),
    ({"guided_choice": []}, "guided_choice", "guided_choice must be"),
    ({"guided_grammar": "root ::= nope"}, "guided_grammar", "nope"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs", "structured_outputs.regex"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs",
     "whitespace_pattern"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": {"type": 7}}}},
     "response_format", "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "response_format"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "cannot be combined"),
    ({"response_format": {"type": "json_object"}, "guided_json": {}}, "guided_json",
     "cannot be combined"),
]


@pytest.mark.parametrize("stream", [False, True])
def test_a_bad_structured_output_is_a_400_naming_the_field(client, server, stream):
    for extra, param, words in BAD:
        with pytest.raises(openai.BadRequestError) as e:
            r = client.completions.create(model="tiny", prompt="Hello", max_tokens=5,
                                          stream=stream, extra_body=extra)
            list(r) if stream else None
        assert e.value.body["param"] == param and words in e.value.body["message"], extra
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=20,
                                  extra_body={"guided_choice": ["still", "serving"]})
    assert r.choices[0].text in ("still", "serving")
    st = wait_idle(server.llm)
    assert st["grammars"] == st["unfinished"] == 0 and st["free_blocks"] == st["num_blocks"]


def test_an_engine_core_in_its_own_process_compiles_and_refuses_grammars(tiny_llama):
    """The grammar crosses the process boundary twice: the server's check (a utility call whose
    argument arrives as a plain dict) and the request itself (msgspec)."""
    with running_server(tiny_llama, multiprocess=True) as s:
        c = openai.OpenAI(api_key="none", base_url=s.url + "/v1", max_retries=0, timeout=60)
        r = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=120, seed=1,
                                      response_format=RESPONSE_FORMAT)
        assert_valid(r.choices[0].message.content)
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="tiny", prompt="Hi", max_tokens=5,
                                 extra_body={"guided_regex": "a(b"})
        assert e.value.body["param"] == "guided_regex"
        assert wait_idle(s.llm)["grammars"] == 0
