"""Incremental detokenization and stop strings (tide/engine/text_stream.py)."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tide.engine.text_stream import StopMatcher, TextStream


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tk = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(["<|im_end|>"])
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>")


def test_split_multibyte_characters_are_never_emitted_half(tok: PreTrainedTokenizerFast) -> None:
    text = "añb 한국어 ok 🙂!"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # the byte tokens really split characters
    ts = TextStream(tok)
    deltas = [ts.push([i]) for i in ids] + [ts.flush()]
    assert "".join(deltas) == text == ts.text
    assert all("\ufffd" not in d for d in deltas)


def test_special_tokens_are_skipped(tok: PreTrainedTokenizerFast) -> None:
    ts = TextStream(tok)
    out = ts.push(tok.encode("hi", add_special_tokens=False) + [tok.eos_token_id]) + ts.flush()
    assert out == "hi"


def test_truncated_character_at_the_end_is_flushed(tok: PreTrainedTokenizerFast) -> None:
    ids = tok.encode("a한", add_special_tokens=False)[:-1]
    ts = TextStream(tok)
    assert ts.push(ids) == ""  # held until the character completes, or the stream ends
    assert ts.flush() == "a\ufffd"


def test_stop_string_spanning_pushes_is_cut_and_never_leaked() -> None:
    m = StopMatcher(["STOP", "xyz"])
    released = [m.push(p) for p in ["hello S", "T", "O", "rest"]]
    assert released == ["hello ", "", "", "STOrest"] and not m.stopped  # "STOr" is no stop
    assert m.flush() == ""
    m = StopMatcher(["STOP", "xyz"])
    released = [m.push(p) for p in ["hello S", "TO", "P and more"]]
    assert released == ["hello ", "", ""] and m.stopped
    assert m.push("later") == "" and m.flush() == ""


def test_earliest_stop_string_wins() -> None:
    m = StopMatcher(["cd", "b"])
    assert m.push("abcd") == "a" and m.stopped


def test_held_back_prefix_is_released_when_it_cannot_match() -> None:
    m = StopMatcher(["abc"])
    assert m.push("xab") == "x"
    assert m.push("d") == "abd"


def test_text_stream_with_stop_strings(tok: PreTrainedTokenizerFast) -> None:
    ids = tok.encode("one two three four", add_special_tokens=False)
    ts = TextStream(tok, ["three"])
    out = "".join(ts.push([i]) for i in ids) + ts.flush()
    assert out == "one two " and ts.stopped
