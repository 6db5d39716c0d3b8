"""The offline API (LLM.generate / LLM.chat) and LLMEngine on the tiny llama checkpoint: prompt
forms, vLLM output fields, per-prompt SamplingParams, stops, seeds, chat, input errors, and that no
KV block or request is left behind after any of it."""
import pytest
import torch

from kvflow import LLM, EngineArgs, LLMEngine, SamplingParams
from model_fixtures import IM_END_ID, IM_START_ID, hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT_IDS = [[271, 417, 328], [488, 492, 14, 499, 391, 3], [5, 100, 200, 300, 400, 500, 7]]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    # One intra-op thread: far faster for a tiny model on a busy 2-core box. The engine sets it
    # process-wide, so put the old value back afterwards.
    n = torch.get_num_threads()
    yield LLM(tiny_llama, dtype="float32", max_model_len=128, num_blocks=64, num_threads=1)
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _no_leaks(request):
    """Every test here ends with an idle engine: all blocks free, no request state anywhere."""
    yield
    if "llm" in request.fixturenames:
        assert_idle(request.getfixturevalue("llm").llm_engine)


def assert_idle(engine):
    s = engine.scheduler
    assert s.kv_cache_manager.block_pool.num_free_blocks == engine.scheduler_config.num_blocks
    assert not s.has_unfinished_requests() and engine.get_num_unfinished_requests() == 0
    assert s.requests == {} and s.running == [] and len(s.waiting) == 0
    assert s.kv_cache_manager.req_to_block_ids == {}
    assert engine.states == {} and engine.runner.generators == {} and engine.runner.requests == {}


def gen(llm, prompts, sp=GREEDY, **kw):
    return llm.generate(prompts, sp, use_tqdm=False, **kw)


# ---- prompt forms and output fields ------------------------------------------------------------
def test_output_fields_for_a_str_prompt(llm):
    (o,) = gen(llm, "The cat sees")
    tok = llm.get_tokenizer()
    assert isinstance(o.request_id, str)
    assert o.prompt == "The cat sees" and o.prompt_token_ids == tok.encode("The cat sees")
    assert o.finished is True and o.num_cached_tokens == 0
    (c,) = o.outputs
    assert c.index == 0 and len(c.token_ids) == 8 and all(isinstance(t, int) for t in c.token_ids)
    assert c.finish_reason == "length" and c.stop_reason is None
    assert isinstance(c.text, str) and tok.decode(o.prompt_token_ids + c.token_ids).startswith(
        o.prompt + c.text)


def test_every_prompt_form_gives_the_same_greedy_tokens(llm):
    tok = llm.get_tokenizer()
    text = "Hello, world! How are you?"
    ids = tok.encode(text)
    ref = gen(llm, text)[0].outputs[0].token_ids
    forms = [[text], ids, [ids], {"prompt": text}, {"prompt_token_ids": ids},
             [{"prompt_token_ids": ids}], (ids,), [tuple(ids)]]
    for form in forms:
        (o,) = gen(llm, form)
        assert o.outputs[0].token_ids == ref, form
        assert o.prompt_token_ids == ids
    assert gen(llm, {"prompt": text})[0].prompt == text
    assert gen(llm, ids)[0].prompt is None


def test_outputs_come_back_in_input_order(llm):
    tok = llm.get_tokenizer()
    prompts = ["A dog likes the river.", [9, 8, 7, 6, 5, 4, 3], {"prompt": "Number 7 plus 8"},
               "Hi", {"prompt_token_ids": [300] * 40}]
    outs = gen(llm, prompts)
    assert len(outs) == 5 and len({o.request_id for o in outs}) == 5
    exp_ids = [tok.encode(prompts[0]), prompts[1], tok.encode("Number 7 plus 8"), tok.encode("Hi"),
               [300] * 40]
    assert [o.prompt_token_ids for o in outs] == exp_ids
    assert [o.prompt for o in outs] == [prompts[0], None, "Number 7 plus 8", "Hi", None]
    # Each equals the same prompt run on its own.
    for p, o in zip(prompts, outs):
        assert gen(llm, p)[0].outputs[0].token_ids == o.outputs[0].token_ids


def test_a_list_of_sampling_params_is_honoured_per_prompt(llm):
    sps = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 5, 12)]
    outs = gen(llm, ["The cat", "The cat", "The cat"], sps)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 5, 12]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    long = outs[2].outputs[0].token_ids
    assert outs[0].outputs[0].token_ids == long[:1] and outs[1].outputs[0].token_ids == long[:5]


def test_greedy_matches_hf(llm, tiny_llama):
    outs = gen(llm, PROMPT_IDS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(tiny_llama, PROMPT_IDS, 12)


def test_prefix_cache_hit_is_reported(llm):
    p = list(range(50, 90))                 # 40 tokens: two full blocks of 16
    first = gen(llm, [p])[0]
    again = gen(llm, [p])[0]
    assert again.num_cached_tokens == 32
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_max_tokens_none_runs_to_max_model_len(llm):
    sp = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    a, b = gen(llm, [[7] * 100, [8] * 127], sp)
    assert len(a.outputs[0].token_ids) == 28 and len(b.outputs[0].token_ids) == 1
    assert a.outputs[0].finish_reason == b.outputs[0].finish_reason == "length"


def test_default_sampling_params_and_tqdm(llm):
    (o,) = llm.generate("The cat")          # vLLM defaults: temperature 1, max_tokens 16
    assert 1 <= len(o.outputs[0].token_ids) <= 16 and o.finished


# ---- stops -------------------------------------------------------------------------------------
def _pick_stop(text: str) -> str:
    for k in range(2, len(text) - 3):
        s = text[k:k + 3]
        if "\ufffd" not in s and s.isprintable() and s.strip():
            return s
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_string(llm):
    prompts = ["The cat sees", "A small bird"]
    free = gen(llm, prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    stops = [_pick_stop(o.outputs[0].text) for o in free]
    sps = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[s])
           for s in stops]
    for f, s, o in zip(free, stops, gen(llm, prompts, sps)):
        c, ftext = o.outputs[0], f.outputs[0].text
        assert (c.finish_reason, c.stop_reason) == ("stop", s)
        assert c.text == ftext[:ftext.index(s)]
        assert c.token_ids == f.outputs[0].token_ids[:len(c.token_ids)]
        assert len(c.token_ids) < 24


# Stop strings wait for min_tokens, like EOS and stop_token_ids (as in vLLM's v1 detokenizer).
def test_stop_string_waits_for_min_tokens(llm):
    free = gen(llm, "The cat sees", SamplingParams(temperature=0.0, max_tokens=24,
                                                   ignore_eos=True))[0].outputs[0]
    s = _pick_stop(free.text)
    sp = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24, ignore_eos=True, stop=[s])
    c = gen(llm, "The cat sees", sp)[0].outputs[0]
    assert len(c.token_ids) == 24 and c.token_ids == free.token_ids


def test_stop_token_id(llm):
    free = gen(llm, "The cat sees", SamplingParams(temperature=0.0, max_tokens=16,
                                                   ignore_eos=True))[0].outputs[0].token_ids
    j = next(j for j in range(3, 16) if free.index(free[j]) == j)
    t = free[j]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=[t, 511])
    c = gen(llm, "The cat sees", sp)[0].outputs[0]
    assert (c.finish_reason, c.stop_reason, c.token_ids) == ("stop", t, free[:j + 1])


def test_eos_stops_unless_ignore_eos(llm):
    prompts = [[i] for i in range(130, 170)]
    free = gen(llm, prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    hits = [(p, o.outputs[0].token_ids) for p, o in zip(prompts, free)
            if IM_END_ID in o.outputs[0].token_ids]
    if not hits:
        pytest.skip("no greedy continuation here reaches EOS")
    p, ids = hits[0]
    c = gen(llm, [p], SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0]
    assert c.token_ids == ids[:ids.index(IM_END_ID) + 1]
    assert (c.finish_reason, c.stop_reason) == ("stop", None)
    assert "<|im_end|>" not in c.text


# ---- seeds -------------------------------------------------------------------------------------
def test_same_seed_same_sample_different_seed_differs(llm):
    def run(seed, extra=()):
        sp = SamplingParams(temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True)
        other = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
        outs = gen(llm, ["The cat sees", *extra], [sp] + [other] * len(extra))
        return outs[0].outputs[0].token_ids

    a = run(7)
    assert run(7) == a
    assert run(7, extra=["Hello", "A dog likes"]) == a       # batch-independent
    assert run(8) != a
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    x, y = gen(llm, ["The cat", "The cat"], sp)              # same seed twice in one batch
    assert x.outputs[0].token_ids == y.outputs[0].token_ids


# ---- chat --------------------------------------------------------------------------------------
CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]


def test_chat_renders_chatml_and_accepts_one_or_many_conversations(llm):
    tok = llm.get_tokenizer()
    rendered = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n" \
               "<|im_start|>assistant\n"
    (one,) = llm.chat(CONV, GREEDY, use_tqdm=False)
    assert one.prompt_token_ids == tok.encode(rendered, add_special_tokens=False)
    assert one.prompt_token_ids[0] == IM_START_ID
    assert one.prompt == rendered and "<|im_start|>user" in one.prompt
    two = llm.chat([CONV, [{"role": "user", "content": "Hi"}]], GREEDY, use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == one.outputs[0].token_ids
    head = tok.encode("<|im_start|>user\nHi<|im_end|>", add_special_tokens=False)
    assert two[1].prompt_token_ids[:len(head)] == head


# ---- errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompts,sps,match", [
    ([], None, "empty"),
    ([[1, 2, 512]], None, "512"),
    ([1, 2, 512], None, "512"),
    ([[1, -1, 2]], None, "-1"),
    (3.5, None, "float"),
    ([3.5], None, "float"),
    ([[1, 2.5]], None, "2.5"),
    ({"text": "x"}, None, "prompt"),
    (["a", "b"], [GREEDY] * 3, "3 sampling_params for 2 prompts"),
    (["a", "b", "c"], [GREEDY], "1 sampling_params for 3 prompts"),
    ([list(range(1, 200))], None, "max_model_len"),
    ([[5] * 128], None, "max_model_len"),
    ([[]], None, "empty"),
    ("a", "not params", "SamplingParams"),
    # A str under "prompt_token_ids" is rejected, not tokenized as text.
    ({"prompt_token_ids": "The cat"}, None, "prompt_token_ids"),
])
def test_bad_inputs_raise_value_error(llm, prompts, sps, match):
    with pytest.raises(ValueError, match=match):
        gen(llm, prompts, sps)


def test_a_bad_prompt_after_good_ones_adds_nothing(llm):
    with pytest.raises(ValueError, match="512"):
        gen(llm, ["The cat", [1, 2, 3], [4, 512]])
    assert_idle(llm.llm_engine)
    assert len(gen(llm, ["The cat"])) == 1


def test_a_failing_step_aborts_the_batch(llm, monkeypatch):
    runner = llm.llm_engine.runner
    real, calls = runner.execute_model, []

    def flaky(so, grammar_bitmask=None):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return real(so, grammar_bitmask)

    monkeypatch.setattr(runner, "execute_model", flaky)
    with pytest.raises(RuntimeError, match="boom"):
        gen(llm, ["The cat", "A dog", [7] * 30])
    assert_idle(llm.llm_engine)
    monkeypatch.undo()
    assert len(gen(llm, ["The cat"])[0].outputs[0].token_ids) == 8


def test_chat_errors(llm):
    with pytest.raises(ValueError):
        llm.chat([], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"content": "no role"}], GREEDY, use_tqdm=False)


def test_unknown_engine_arg_is_a_type_error(tiny_llama):
    with pytest.raises(TypeError, match="no_such_arg"):
        LLM(tiny_llama, dtype="float32", no_such_arg=1)


@pytest.mark.parametrize("kw,name", [
    (dict(dtype="float64"), "dtype"), (dict(policy="lifo"), "policy"),
    pytest.param(dict(device="cuda"), "cuda", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="a GPU is present")),
    (dict(device="tpu"), "device"), (dict(attention_backend="flash"), "attention_backend"),
    (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization"),
    (dict(num_threads=0), "num_threads"), (dict(block_size=3.5), "block_size"),
    (dict(watermark=2.0), "watermark"), (dict(num_blocks=-1), "num_blocks"),
    (dict(max_model_len=9999), "max_model_len"), (dict(kv_cache_memory=0), "kv_cache_memory"),
    # Zero or negative sizes are errors naming the argument, never read as "derive it".
    (dict(block_size=0), "block_size"),
    (dict(block_size=-4), "block_size"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_model_len=-5), "max_model_len"),
    (dict(max_model_len=0), "max_model_len"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(seed="x"), "seed"),
    (dict(seed=1 << 64), "seed"),
])
def test_bad_engine_args_raise_value_error(tiny_llama, kw, name):
    with pytest.raises(ValueError, match=name):
        LLM(tiny_llama, **{"dtype": "float32", **kw})


# ---- LLMEngine directly ------------------------------------------------------------------------
def test_engine_step_loop_and_abort(tiny_llama):
    eng = LLMEngine(EngineArgs(model=tiny_llama, dtype="float32", num_blocks=32))
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    eng.add_request("a", [5, 6, 7, 8] * 5, sp)
    eng.add_request("b", "The cat sees", sp)
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("a", [1, 2], sp)
    seen = {"a": [], "b": []}
    for _ in range(4):
        for o in eng.step():
            seen[o.request_id].append(o)
    assert len(seen["a"]) >= 2 and not seen["a"][-1].finished
    assert eng.scheduler.kv_cache_manager.block_pool.num_free_blocks < 32
    eng.abort_request("a")
    assert "a" not in eng.scheduler.requests and eng.get_num_unfinished_requests() == 1
    n_a = len(seen["a"])
    while eng.has_unfinished_requests():
        for o in eng.step():
            seen[o.request_id].append(o)
    assert len(seen["a"]) == n_a                              # nothing more for the aborted one
    last = seen["b"][-1]
    assert last.finished and len(last.outputs[0].token_ids) == 20
    assert last.outputs[0].finish_reason == "length"
    assert [o.finished for o in seen["b"]].count(True) == 1
    assert eng.has_unfinished_requests() is False
    eng.abort_request(["a", "b", "never-existed"])            # harmless
    assert_idle(eng)
    eng.add_request("a", [5, 6, 7], sp)                       # the id is free again
    eng.abort_request("a")
    assert_idle(eng)


def test_generate_hands_every_prompt_to_the_scheduler_before_the_first_step(llm):
    engine, first = llm.llm_engine, []
    inner = engine.step

    def step():
        if not first:
            first.append(len(engine.scheduler.waiting) + len(engine.scheduler.running))
        return inner()

    engine.step = step
    try:
        llm.generate([{"prompt_token_ids": [5 + i, 9]} for i in range(30)],
                     SamplingParams(max_tokens=1), use_tqdm=False)
    finally:
        engine.step = inner
    assert first == [30]


# ---- min_tokens: EOS and stop tokens are never sampled below it (issue 12) ---------------------
def _favour(monkeypatch, llm, *tokens):
    """Make `tokens` the model's top choices, in that order, far ahead of the rest."""
    model = llm.llm_engine.runner.model
    real = model.compute_logits

    def biased(hidden):
        logits = real(hidden).clone()
        for k, t in enumerate(tokens):
            logits[:, t] += 1000.0 - 100.0 * k
        return logits
    monkeypatch.setattr(model, "compute_logits", biased)


@pytest.mark.parametrize("sp", [dict(temperature=0.0), dict(temperature=1.0, seed=5),
                                dict(temperature=1.0)], ids=["greedy", "seeded", "random"])
def test_below_min_tokens_eos_is_never_emitted_and_it_stops_on_eos_after(llm, monkeypatch, sp):
    _favour(monkeypatch, llm, IM_END_ID)
    c = gen(llm, "The cat", SamplingParams(**sp, max_tokens=12, min_tokens=5))[0].outputs[0]
    assert IM_END_ID not in c.token_ids[:5]
    assert c.token_ids[5] == IM_END_ID and len(c.token_ids) == 6
    assert (c.finish_reason, c.stop_reason) == ("stop", None)


def test_below_min_tokens_stop_token_ids_are_never_emitted_and_stop_after(llm, monkeypatch):
    _favour(monkeypatch, llm, 77, IM_END_ID, 78)
    sp = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=3, stop_token_ids=[77])
    c = gen(llm, ["The cat", [5, 6, 7]], sp)[1].outputs[0]
    assert c.token_ids == [78, 78, 78, 77]          # 77 and EOS banned for three tokens
    assert (c.finish_reason, c.stop_reason) == ("stop", 77)


def test_with_ignore_eos_min_tokens_does_not_ban_eos(llm, monkeypatch):
    # As in vLLM: with ignore_eos, EOS is an ordinary token, so min_tokens leaves it alone.
    _favour(monkeypatch, llm, IM_END_ID)
    sp = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=3, ignore_eos=True)
    assert gen(llm, "The cat", sp)[0].outputs[0].token_ids == [IM_END_ID] * 4


# ---- one request's failure is that request's alone (issue 12) ----------------------------------
def test_stop_token_ids_outside_the_vocab_are_a_value_error_naming_them(llm):
    with pytest.raises(ValueError, match="^stop_token_ids"):
        gen(llm, "The cat", SamplingParams(stop_token_ids=[5, 512]))


def test_a_seed_torch_rejects_fails_add_request_not_the_step(llm):
    sp = SamplingParams(temperature=1.0, seed=1)
    sp.seed = 1 << 64           # past validation (a mutated object), as a bug upstream might
    with pytest.raises(ValueError, match="^seed"):
        llm.llm_engine.add_request("x", "The cat", sp)
    assert len(gen(llm, "The cat")[0].outputs[0].token_ids) == 8


def _good_runs(llm):
    return [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)]


def test_a_request_whose_sampling_fails_ends_with_error_and_the_others_finish(llm):
    good = _good_runs(llm)
    want = [o.outputs[0].token_ids for o in gen(llm, ["The cat", "A dog"], good)]
    bad = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    eng = llm.llm_engine
    eng.add_request("bad", "Hello", bad)
    bad.top_k = "3"             # breaks the batched draw, before any seeded row draws
    outs = gen(llm, ["The cat", "A dog"], good)     # steps "bad" along with them
    assert [o.outputs[0].token_ids for o in outs] == want
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "length"]


def test_a_request_whose_generator_breaks_ends_with_error_and_the_others_finish(llm):
    eng = llm.llm_engine
    eng.add_request("bad", "Hello", SamplingParams(temperature=1.0, seed=3, max_tokens=8))
    eng.add_request("ok", "The cat", SamplingParams(temperature=1.0, seed=4, max_tokens=8,
                                                    ignore_eos=True))
    eng.runner.generators["bad"] = "not a generator"
    finals = {}
    while eng.has_unfinished_requests():
        finals.update({o.request_id: o for o in eng.step() if o.finished})
    c = finals["bad"].outputs[0]
    assert c.finish_reason == "error" and isinstance(c.error, Exception)
    assert finals["ok"].outputs[0].finish_reason == "length"


def test_a_request_whose_detokenizer_fails_ends_with_error_and_the_others_finish(llm):
    class Boom:
        text, stop_reason = "", None

        def update(self, ids):
            raise RuntimeError("detokenizer boom")

    eng = llm.llm_engine
    want = gen(llm, ["The cat"])[0].outputs[0].token_ids
    eng.add_request("bad", "Hello", GREEDY)
    eng.add_request("ok", "The cat", GREEDY)
    eng.states["bad"].detok = Boom()
    finals = {}
    while eng.has_unfinished_requests():
        finals.update({o.request_id: o for o in eng.step() if o.finished})
    c = finals["bad"].outputs[0]
    assert (c.finish_reason, str(c.error)) == ("error", "detokenizer boom")
    assert finals["ok"].outputs[0].token_ids == want
