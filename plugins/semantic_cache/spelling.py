"""Spelling: slips of the keyboard mended in the text the semantic cache embeds, so that a typo costs no hit.

A sentence embedding reads a misspelt word as other word pieces: "What's the drriving route from Berlin to
Munich?" scores 0.90 against its clean twin, "Which planet in the sollar system ..." 0.82, and a typo on top of a
paraphrase falls under the threshold (on the rule-made sets, half the typo pairs did). So the text sent to the
embedding model has each unknown lower-case word of five letters or more replaced by the most frequent English
word it is a slip of: one letter dropped, added or two letters swapped, with its first letter kept
(as `lexicon.typo_of`, the guards' own test of a typo, reads one). Candidates come from pyspellchecker's English word
frequencies (PyPI, pure Python, its dictionary inside the wheel).

Only English is mended, and only a text that shows it is English: one that holds an English function word
("the", "what", "how", "is", ...; chosen as words no other common language writes alone). The English dictionary
would otherwise take "tiene" for a slip of "tine" and "viele" of "vile". A deployment whose traffic is not English
turns it off (`spelling: false`).

Only the embedding's input changes: the guards and the verifier read the text as the user wrote it, and "tuple"
is no slip ("tulle" needs a letter changed), nor "json" ("son" drops the first letter). Left alone: words with a
capital, digits or fewer than five letters, words in double quotes or backticks (a quoted phrase is asked for
as written), words over 15 letters, and a text with more than 3 unknown words (jargon, another language, or
noise; it also bounds this step's cost: at most 3 words of at most 15 letters are looked up, under a
millisecond). What it can get wrong: a term written in lower case that is a slip away from a dictionary word is
read as that word ("gmail" -> "gail", "venmo" -> "venom"). Mostly that costs a hit; but the guards, too, take
such a pair for one word and its typo, so a request that differs from a cached one by that word alone ("Is
venmo ..." / "Is venom ...") is served the other's answer, where the embedding alone (0.60 here) would have
kept them apart. None of the bundled sets has such a pair; `spelling: false` closes it.
"""

from __future__ import annotations

import re
from functools import lru_cache

from plugins.semantic_cache.vocabulary import _words

_WORD = re.compile(r"\b[a-z]{5,15}\b")
_QUOTED = re.compile(r'"[^"\n]*"|\u201c[^\u201d\n]*\u201d|`[^`\n]*`')
_MOST_UNKNOWN = 3
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

        # Only its English word frequencies are used (word -> count, a dict): the slips are made here (_slips).
        self._known: dict[str, int] = SpellChecker(language="en", distance=1).word_frequency.dictionary
        self.mend = lru_cache(maxsize=4096)(self._mend)  # a word once looked at is a lookup after

    def fix(self, text: str) -> str:
        """The text with each slip mended; the same string when there is none (the common case)."""
        known = self._known
        unknown = sum(w not in known for w in _WORD.findall(text))
        if not unknown or unknown > _MOST_UNKNOWN:
            return text
        if _ENGLISH.isdisjoint(_ANY_WORD.findall(text.lower())):
            return text  # not shown to be English
        if '"' in text or "`" in text or "\u201c" in text:
            spans = [m.span() for m in _QUOTED.finditer(text)]
            return _WORD.sub(lambda m: m[0] if _within(m.start(), spans) else self._word(m[0]), text)
        return _WORD.sub(lambda m: self._word(m[0]), text)

    def _word(self, word: str) -> str:
        return word if word in self._known else self.mend(word)

    def _mend(self, word: str) -> str:
        """The most frequent known word that `word` is a slip of, or `word`. The slips are generated here, only
        of the shapes `lexicon.typo_of` accepts (pyspellchecker's own candidates also try every substitution and
        the first letter: 1.1 ms for a 15-letter word against 0.05 ms)."""
        known = self._known
        best, count = word, 0
        for candidate in _slips(word):
            n = known.get(candidate, 0)
            if n > count or (n == count and n and candidate > best):
                best, count = candidate, n
        return best


_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _slips(word: str) -> set[str]:
    """The words that `word` may be a slip of, its first letter kept: one letter added to it (so dropped from
    them), one letter dropped from it, or two neighbours swapped."""
    found = {word[:i] + word[i + 1 :] for i in range(1, len(word))}
    found.update(word[:i] + c + word[i:] for i in range(1, len(word) + 1) for c in _LETTERS)
    found.update(word[:i] + word[i + 1] + word[i] + word[i + 2 :] for i in range(1, len(word) - 1))
    found.discard(word)
    return found  # each is `word`'s slip as lexicon.typo_of reads one (a test holds them to it)


def _within(at: int, spans: list[tuple[int, int]]) -> bool:
    return any(start <= at < end for start, end in spans)
