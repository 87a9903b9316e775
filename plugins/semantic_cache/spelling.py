"""Spelling: slips of the keyboard mended in the text the semantic cache embeds, so that a typo costs no hit.

A sentence embedding reads a misspelt word as other word pieces: "What's the drriving route from Berlin to
Munich?" scores 0.90 against its clean twin, "Which planet in the sollar system ..." 0.82, and a typo on top of a
paraphrase falls under the threshold (on the rule-made sets, half the typo pairs did). So the text sent to the
embedding model has each unknown lower-case word of five letters or more replaced by the most frequent English
word it is a slip of: one letter dropped, added or two letters swapped, with its first letter kept
(`lexicon.typo_of`, the guards' own test of a typo). Candidates come from pyspellchecker's English word
frequencies (PyPI, pure Python, its dictionary inside the wheel).

Only English is mended, and only a text that shows it is English: one that holds an English function word
("the", "what", "how", "is", ...; chosen as words no other common language writes alone). The English dictionary
would otherwise take "tiene" for a slip of "tine" and "viele" of "vile". A deployment whose traffic is not English
turns it off (`spelling: false`).

Only the embedding's input changes. The guards and the verifier read the text as the user wrote it, so a word
mended wrongly can cost a hit but cannot make one: "tuple" is no slip ("tulle" needs a letter changed, which is
not one), and names written with a capital, words with digits and short words are left alone. A name written in
lower case a slip away from a dictionary word is mended as one ("gmail" -> "gail"): that costs recall only.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

from plugins.semantic_cache.lexicon import typo_of
from plugins.semantic_cache.vocabulary import _words

_WORD = re.compile(r"\b[a-z]{5,}\b")
_ANY_WORD = re.compile(r"[a-z]+")
# English words that no other common language writes as a word of its own ("do", "i", "a", "in", "die", "la" are
# left out: Portuguese, Italian, German and Spanish have them).
_ENGLISH = frozenset(
    _words("""the what how why is are does can should my your with from for and to of you it this that which who when
    where there their have has was were will would could""")
)


class Speller:
    """Mends slips in a text; made once, at start-up (the dictionary takes ~0.1 s to load and ~29 MB to hold)."""

    def __init__(self) -> None:
        from spellchecker import SpellChecker

        self._checker: Any = SpellChecker(language="en", distance=1)
        self._known = self._checker.word_frequency.dictionary  # word -> count: a dict, read directly
        self.mend = lru_cache(maxsize=65536)(self._mend)  # a word once mended is a lookup after

    def fix(self, text: str) -> str:
        """The text with each slip mended; the same string when there is none (the common case)."""
        known = self._known
        if all(w in known for w in _WORD.findall(text)):
            return text
        if _ENGLISH.isdisjoint(_ANY_WORD.findall(text.lower())):
            return text  # not shown to be English
        return _WORD.sub(lambda m: m[0] if m[0] in known else self.mend(m[0]), text)

    def _mend(self, word: str) -> str:
        candidates = [c for c in self._checker.candidates(word) or () if c != word and typo_of(word, c)]
        if not candidates:
            return word
        known = self._known
        best: str = max(candidates, key=lambda c: (known.get(c, 0), c))
        return best
