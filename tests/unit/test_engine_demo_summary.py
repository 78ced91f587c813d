"""The real-engine demo's own judgement: what counts as an equal answer, a reply's tokens, its verdict."""

from __future__ import annotations

import pytest

from kvcr.cli import main
from kvcr.demo.engines import EngineSummary, Turn, first_words


def summary(texts, reference, remote=16, local=8, error=""):
    turns = [
        Turn(0, k, [1, 2, 3], text=text, cached_tokens=16, error=error if k == 0 else "")
        for k, text in enumerate(texts)
    ]
    pages = {"a": {"backup": 4, "local_restore": local, "remote_restore": remote, "served": 0}}
    return EngineSummary(turns, pages=pages, reference=list(reference))


def test_every_answer_equal_and_pages_from_local_kvcr_and_a_peer_is_ok():
    s = summary(["w1 w2", "w3"], ["w1 w2", "w3"])
    assert s.ok and not s.mismatched and s.saved_tokens == 32


def test_one_answer_that_differs_from_the_reference_fails_the_demo():
    s = summary(["w1 w2", "w3"], ["w1 w2", "w4"])
    assert [t.turn for t in s.mismatched] == [1] and not s.ok


def test_no_reference_or_no_peer_pages_or_a_lost_turn_is_not_ok():
    assert not summary(["w1"], []).ok  # not checked is not passed
    assert not summary(["w1"], ["w1"], remote=0).ok
    assert not summary(["w1"], ["w1"], local=0).ok  # the tier's story: pages from local kvcr DRAM too
    assert not summary(["", "w3"], ["", "w3"], error="HTTP 500").ok


def test_an_answer_is_quoted_by_its_first_words_on_one_line():
    assert first_words("The assert statement\nchecks a condition and raises AssertionError if it is false.", 5) == (
        "The assert statement checks a ..."
    )
    assert first_words("Yes.") == "Yes." and first_words("") == ""


def test_the_stand_in_options_are_refused_with_the_sglang_engine_the_default():
    for argv in (["demo", "--plot", "p.png"], ["demo", "--engine", "sglang", "--page-kib", "128"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert argv[-2] in str(exit_.value) and "--engine stand-in" in str(exit_.value)
