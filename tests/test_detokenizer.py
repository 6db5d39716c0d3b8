"""IncrementalDetokenizer with the tiny trained byte-level BPE tokenizer: token-by-token text equals
a one-shot decode (multi-byte characters included), and stop strings cut the text."""
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer

from kvflow.engine.detokenizer import IncrementalDetokenizer
from kvflow.engine.tokenizer import Tokenizer
from model_fixtures import IM_END_ID, IM_START_ID

TEXTS = [
    "The cat sees the red house.",
    "Hello, world! How are you?",
    "café ü 日本 🙂",
    "Number 7 plus 8 is 15. naïve résumé — 😀👍🏽 中文字符 Ωμέγα",
    "🙂🙂🙂",
    "  two  spaces\nand a newline\ttab",
]


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir) -> Tokenizer:
    hf = HFTokenizer.from_file(str(Path(tiny_tokenizer_dir) / "tokenizer.json"))
    return Tokenizer(hf, eos_token_id=IM_END_ID)


def feed(tok, gen_ids, prompt_ids=(), stop=(), chunk=1):
    """Feed `gen_ids` `chunk` at a time; returns (detok, index of the update that stopped)."""
    d = IncrementalDetokenizer(tok, list(prompt_ids), list(stop))
    for i in range(0, len(gen_ids), chunk):
        if d.update(gen_ids[i:i + chunk]):
            return d, i // chunk
    return d, None


# ---- text --------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_equals_decode(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text      # the tokenizer round-trips these
    d, stopped = feed(tok, ids)
    assert stopped is None and d.stop_reason is None
    assert d.text == tok.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [2, 3, 1000])
def test_chunks_of_tokens_give_the_same_text(tok, text, chunk):
    ids = tok.encode(text)
    assert feed(tok, ids, chunk=chunk)[0].text == text


@pytest.mark.parametrize("text", TEXTS)
def test_text_is_never_a_broken_character_along_the_way(tok, text):
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, [], [])
    for t in ids:
        d.update([t])
        assert "\ufffd" not in d.text
        assert text.startswith(d.text)


@pytest.mark.parametrize("prompt,gen", [("The cat sees", " the red house."),
                                        ("Hello, world!", " How are you? 日本 🙂"),
                                        ("café", " ü and more café")])
def test_with_a_prompt_only_the_generated_text_comes_out(tok, prompt, gen):
    p = tok.encode(prompt)
    g = tok.encode(gen)
    d, _ = feed(tok, g, prompt_ids=p)
    assert d.text == tok.decode(g) == gen
    assert tok.decode(p + g) == prompt + d.text


def test_special_tokens_are_skipped(tok):
    ids = tok.encode("The cat") + [IM_END_ID, IM_START_ID] + tok.encode(" sees 日本")
    d, _ = feed(tok, ids)
    assert d.text == tok.decode(ids) == "The cat sees 日本"


# ---- stop strings ------------------------------------------------------------------------------
def test_stop_string_cuts_the_text_before_it(tok):
    ids = tok.encode("The cat sees the red house.")
    d, at = feed(tok, ids, stop=["red"])
    assert d.text == "The cat sees the "
    assert d.stop_reason == "red"
    assert at == 4                  # stopped on the token ' red', not later


def test_stop_string_spanning_two_tokens(tok):
    ids = tok.encode("The cat sees the red house.")
    pieces = [tok.decode([i]) for i in ids]
    assert pieces[1:3] == [" cat", " sees"]     # so "t s" straddles tokens 1 and 2
    d, at = feed(tok, ids, stop=["t s"])
    assert (d.text, d.stop_reason, at) == ("The ca", "t s", 2)


def test_stop_string_spanning_many_byte_tokens(tok):
    ids = tok.encode("café ü 日本 🙂 end")
    d, at = feed(tok, ids, stop=["日本"])
    assert (d.text, d.stop_reason) == ("café ü ", "日本")
    d, _ = feed(tok, ids, stop=["🙂"])
    assert (d.text, d.stop_reason) == ("café ü 日本 ", "🙂")
    d, _ = feed(tok, ids, stop=["é"])
    assert (d.text, d.stop_reason) == ("caf", "é")


def test_stop_string_at_the_very_start(tok):
    ids = tok.encode("The cat sees")
    d, at = feed(tok, ids, stop=["The"])
    assert (d.text, d.stop_reason, at) == ("", "The", 0)


def test_earliest_stop_string_wins_within_one_piece(tok):
    ids = tok.encode("The cat sees")
    # Both appear in the piece " cat"; "ca" starts first although it is listed second.
    d, at = feed(tok, ids, stop=["at", "ca"])
    assert (d.text, d.stop_reason, at) == ("The ", "ca", 1)


def test_earliest_stop_string_wins_when_one_straddles(tok):
    ids = tok.encode("The cat sees the red house.")
    d, _ = feed(tok, ids, stop=["sees", "t se"])
    assert (d.text, d.stop_reason) == ("The ca", "t se")


def test_earliest_stop_string_wins_with_many_tokens_in_one_update(tok):
    ids = tok.encode("The cat sees the red house.")
    d, _ = feed(tok, ids, stop=["house", "red", "sees"], chunk=len(ids))
    assert (d.text, d.stop_reason) == ("The cat ", "sees")


def test_stop_string_in_the_prompt_does_not_trigger(tok):
    p = tok.encode("The cat sees the red house.")
    g = tok.encode(" A dog likes the river.")
    d, at = feed(tok, g, prompt_ids=p, stop=["red", "cat", "house."])
    assert at is None and d.stop_reason is None
    assert d.text == " A dog likes the river."
    # ... but the same string generated later does.
    g2 = tok.encode(" A red dog.")
    d, at = feed(tok, g2, prompt_ids=p, stop=["red", "cat"])
    assert (d.text, d.stop_reason) == (" A ", "red")


def test_stop_string_that_never_appears(tok):
    ids = tok.encode("Hello, world! How are you?")
    d, at = feed(tok, ids, stop=["xyz", "日本"])
    assert at is None and d.stop_reason is None and d.text == "Hello, world! How are you?"
