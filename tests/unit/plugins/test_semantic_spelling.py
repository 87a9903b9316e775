"""The semantic cache's typo mending: what it mends in the text embedded, and what it leaves as written."""

from __future__ import annotations

import pytest

from plugins.semantic_cache.spelling import Speller


@pytest.fixture(scope="module")
def speller() -> Speller:
    return Speller()


@pytest.mark.parametrize(
    ("written", "mended"),
    [
        ("What's the drriving rotue from Berlin to Munich?", "What's the driving route from Berlin to Munich?"),
        ("Which housepalnts are safe for cats?", "Which houseplants are safe for cats?"),
        ("how do i descale an esspresso machnie", "how do i descale an espresso machine"),
        ("Which planet in the sollar system is the largest?", "Which planet in the solar system is the largest?"),
    ],
)
def test_a_slip_is_mended(speller: Speller, written: str, mended: str) -> None:
    assert speller.fix(written) == mended


@pytest.mark.parametrize(
    "text",
    [
        "How do I convert csv into json with a tuple?",  # "json" -> "son", "tuple" -> "tulle" are no slips
        "How do I move contacts from Gmail to the Pixel?",  # "gmail" -> "mail" drops the first letter: no slip
        "What is the capital of Kazakhstan?",  # a name with a capital is the user's
        "Is my_variable_name too long for a column?",  # code
        "¿Cuántos habitantes tiene la ciudad de México?",  # not English: "tiene" is no slip of "tine"
        "Wie viele Einwohner hat die Stadt Berlin?",
        "What is the best way to learn?",  # nothing to mend: the same string back
    ],
)
def test_what_is_left_as_written(speller: Speller, text: str) -> None:
    assert speller.fix(text) == text


def test_the_slips_are_those_the_guards_call_typos() -> None:
    from plugins.semantic_cache.lexicon import typo_of
    from plugins.semantic_cache.spelling import _slips

    for word in ("driving", "route", "houseplants", "solar", "abcdefghijklmno"):
        slips = _slips(word)
        assert slips
        assert all(typo_of(word, s) for s in slips), word


def test_a_quoted_phrase_and_a_long_or_noisy_text_are_left_alone(speller: Speller) -> None:
    assert speller.fix('What does "carpe diem" mean?') == 'What does "carpe diem" mean?'  # not "care diem"
    assert speller.fix("What does `drriving` return in the code?") == "What does `drriving` return in the code?"
    noisy = "the qwrtyzx plmoknij uhbygvtf rdxesz aqwsde"  # more unknown words than a typo makes: no English
    assert speller.fix(noisy) == noisy
