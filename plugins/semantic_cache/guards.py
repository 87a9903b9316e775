"""Guards: a cheap rule that vetoes a semantic match when two prompts differ in something that changes the answer.

A sentence embedding scores look-alikes ("convert 5 km to miles" / "convert 50 km to miles", "... in Python" /
"... in Java", "convert X to Y" / "convert Y to X") as near as true paraphrases, so no threshold separates them.
What separates them is *what differs* between the two prompts. The rule:

1. Each prompt is reduced once to a `Profile` (profiles.py): its words stemmed, synonyms and shorthand folded,
   stop and filler words set aside, plus what it holds of each kind below, normalised ("two" = "2").
2. Two profiles are compared kind by kind, and the first kind in which they differ is the verdict:
   - "quoted": a quoted string of one ("...", “...”, '...') whose words do not appear in the other;
   - "code": a code identifier of one (backticked, snake_case, camelCase, dotted, `call()`, `--flag`) absent
     from the other;
   - "language": a programming or natural language name ("for Python" / "for Java", "in French" / "in German");
   - "date": a differing year, month, weekday, season, time of day or relative day ("today" / "tomorrow");
   - "number": a differing number, digits or words, ordinals included, or the same numbers in another order;
   - "unit": a differing unit of measure, time or currency ("cups" / "grams", "USD" / "EUR", "°C" / "°F");
   - "negation": a negation ("not", "never", "no", "without", "n't", "unable", ...) on one side only, or a
     word negated by a prefix ("unhealthy" / "healthy", "non-toxic", "illegal", "dishonest", "irregular");
   - "entity": a named entity (a word capitalised in either prompt other than at a sentence's start, an
     acronym, a word mixing letters and digits) present in one and absent from the other; an acronym matching
     the initials of a run of capitalised words in the other ("NYC" / "New York City"), a typo of it or its
     adjective ("Europe" / "European") is not a difference;
   - "antonym": a word on one side only whose opposite is on the other side only, degrees folded by the
     spelling rules ("largest" / "smallest", "cheapest" / "most expensive", "strengths" / "weaknesses");
   - "order": a direction word on one side only ("before" / "after", "encode" / "decode", ...), or two things
     trading roles: the words on the two sides of a relation marker changing sides ("X to Y" / "Y into X",
     "A than B" / "B than A", "X instead of Y" / "Y for X"), the subject of a question becoming its object
     ("does X affect Y" / "what effect does Y have on X", "how many X are in a Y" / "how many Y ... X"), two
     named things in the other order around a relation ("did A beat B" / "did B win against A"), two things in
     the other order around one verb or that verb's noun ("can X replace Y" / "is Y a good replacement for
     X"), the source of one the target of the other whichever of "from" and "to" says it ("from X to Y" / "to
     X from Y"), two kinds of one thing swapped ("brown rice ... white rice"); a mere reordering that moves a
     whole phrase ("in Python, how do I ..." / "how do I ... in Python"), an adjective ("the best way" / "which
     way ... is the best"), a passive with its agent ("can Y be replaced by X") or things joined by "and",
     "or", "vs" is not;
   - "scope": a scope word on one side only ("all", "every", "only", "total", "average", "recursively",
     "daily" = "each day", ...), different quantifiers on the two sides ("most cats" / "any cats"), or another
     length, depth or format instruction ("in one sentence", "in detail", "step by step", "in bullet points",
     "like I'm five", "with examples", "just the answer", a further task joined on: "... and explain why", a
     sentence after the request that shapes its answer: "Include the equation."), compared as kinds of
     instruction, a format with the form it asks for (a table is not a list): its own words ("in a single
     sentence", "only") count for no other rule, its numbers still do; or words appended to the other request
     that hold content ("... with code", "... for an expert audience"; not "... to me, please");
   - "substitution" (strict mode, the default): the same request with exactly one content word swapped for
     another ("sugar" / "flour", "dogs" / "cats", "car loan" / "student loan"). Look-alikes are mostly made so,
     and true paraphrases seldom differ by one content word alone; the rule costs the recall of those that do
     ("What causes thunder?" / "Why does thunder happen?"), which `strict=False` gives back. A typo, a synonym,
     an agent noun ("speaker" / "speak"), a verb that only frames the request ("convert X" / "change X") or
     a unit named against an open measure ("how long" / "how many hours") is not a substitution.
   Any other difference (synonyms, fillers, word order, question words) is left to the similarity threshold.

Cost: no model and no I/O. A profile is a few regular-expression passes and a loop over the words; a
comparison of two profiles is a handful of set operations, the rules in order (`CHECKS`), stopping at the first
that vetoes. `sluice cache evaluate` prints each rule's time per check: on a shared 2-core machine a profile took
130 to 240 µs and the whole comparison about 70 µs, the affix, relation-sides and roles rules the dearest.
A store can keep each entry's profile beside its vector, so that a lookup profiles only the query, once,
whatever the number of candidates.
"""

from __future__ import annotations

from collections.abc import Callable
from difflib import SequenceMatcher

from plugins.semantic_cache import lexicon
from plugins.semantic_cache.profiles import (
    OPEN_MEASURE,
    OPEN_MEASURES,
    Profile,
    canonical,
    normal_text,
    stem,
)
from plugins.semantic_cache.profiles import profile as profile
from plugins.semantic_cache.roles import ends_crossed, marker_swapped, roles_swapped
from plugins.semantic_cache.vocabulary import COORDINATOR_TAG, OPPOSITES, ORDER_TAGS, QUANTIFIERS, UNITS

__all__ = ["CHECKS", "SUBSTITUTION", "Check", "Profile", "compare", "profile", "stem", "veto"]


def _quoted_missing(a: Profile, b: Profile) -> bool:
    return any(f" {q} " not in b.text for q in a.quoted)


def _code_missing(a: Profile, b: Profile) -> bool:
    return any(c not in b.code and f" {normal_text(c)} " not in b.text for c in a.code)


def _expanded(a: Profile, b: Profile) -> set[str]:
    """Stems explained by an acronym of one spelled out in the other ("NYC" / "New York City"): both sides."""
    explained: set[str] = set()
    for acronym in a.entities:
        for initials, words in b.runs:
            if acronym in (initials, initials + "s"):
                explained |= {acronym, *words}
    return explained


_DEMONYM_ENDINGS = ("n", "an", "ian", "ean", "ese", "ish", "i")


def _same_name(x: str, y: str) -> bool:
    """Whether two stems name the same thing: a typo of it, or its adjective ("europ" / "european")."""
    if lexicon.typo_of(x, y):
        return True
    short, long = (x, y) if len(x) < len(y) else (y, x)
    return len(short) >= 4 and long.startswith(short) and long[len(short) :] in _DEMONYM_ENDINGS


def _entities_differ(a: Profile, b: Profile) -> bool:
    # A word capitalised in one prompt names the same thing in the other, where it may be written in lower case.
    differing = (a.stems ^ b.stems) & (a.entities | b.entities)
    differing -= _expanded(a, b) | _expanded(b, a)
    for x in differing:
        other = b.stems - a.stems if x in a.stems else a.stems - b.stems
        if not any(_same_name(x, y) for y in other):
            return True
    return False


_OPPOSITE_STEMS: dict[str, set[str]] = {}
for _one, _other in OPPOSITES:
    _OPPOSITE_STEMS.setdefault(stem(_one), set()).add(stem(_other))
    _OPPOSITE_STEMS.setdefault(stem(_other), set()).add(stem(_one))


def _opposed(a: Profile, b: Profile) -> bool:
    """Whether one prompt has a word whose opposite only the other has ("before" / "after")."""
    only_a = a.stems - b.stems
    only_b = b.stems - a.stems
    return any(_OPPOSITE_STEMS.get(w, set()) & only_b for w in only_a)


def _substituted(a: Profile, b: Profile) -> bool:
    """Whether the prompts are one request with one content word swapped for another ("sugar" / "flour").

    Not a swap: a typo ("trian" / "train"), a synonym (folded when profiled) or another verb framing the request
    ("convert X" / "change X")."""
    only_a = {w for w in a.content if w[0] != "<" and w not in _FRAMING} - set(b.content)
    only_b = {w for w in b.content if w[0] != "<" and w not in _FRAMING} - set(a.content)
    if len(only_a) != 1 or len(only_b) != 1:
        return False
    (x,) = only_a
    (y,) = only_b
    if {x, y} & OPEN_MEASURES and {x, y} & set(UNITS.values()):
        return False  # "how long" / "how many hours": the unit the other leaves open
    if _same_name(x, y) or _agent(x, y) or _agent(y, x) or any(lexicon.typo_of(w, r) for w in (x, y) for r in _FRAMING):
        return False
    if _slipped(_written(a.words - b.words, x), _written(b.words - a.words, y)):
        return False  # "working" / "wrking": a slip of the written word that its stem no longer shows
    return bool(set(a.content) & set(b.content) - ORDER_TAGS - {COORDINATOR_TAG}) and _one_edit(a, b)


def _written(words: frozenset[str], content_word: str) -> list[str]:
    """The words as written that a content word was read from."""
    return [w for w in words if canonical(stem(w)) == content_word]


def _slipped(written_a: list[str], written_b: list[str]) -> bool:
    return any(lexicon.typo_of(u, v) for u in written_a for v in written_b)


# A verb framing the request, or a quantifier (compared by the scope rule): not what the request is about.
_FRAMING = frozenset(stem(w) for w in lexicon.REQUEST_VERBS | QUANTIFIERS)


def _agent(x: str, y: str) -> bool:
    """ "speaker" / "speak", "driver" / "drive": a doer named after the deed."""
    return x in (y + "er", y + "r", y + "or")


def _units_differ(a: Profile, b: Profile) -> bool:
    if a.units == b.units:
        return False
    # "How long is the flight?" / "How many hours is the flight?": the units of one side only, named against an
    # open measure of the other, answer it; not when they are an amount given ("how much caffeine is in a shot"
    # / "... in a liter"), which the other side does not ask for.
    for one, other in ((a, b), (b, a)):
        if one.units <= other.units and OPEN_MEASURE.search(one.text):
            return bool(_given_units(other) & (other.units - one.units))
    return True


_AMOUNT_WORDS = frozenset(("a", "an", "one", "per", "each", "every"))


def _given_units(p: Profile) -> set[str]:
    """The units of a prompt that come as an amount: after a number, "a", "one" or "per" ("in a liter")."""
    words = p.text.split()
    return {
        UNITS[w]
        for i, w in enumerate(words)
        if w in UNITS and i > 0 and (words[i - 1] in _AMOUNT_WORDS or words[i - 1][0].isdigit())
    }


def _affixed(a: Profile, b: Profile) -> bool:
    return lexicon.affix_negated(a.words - b.words, b.words) or lexicon.affix_negated(b.words - a.words, a.words)


_PARTICLES = {"on": "off", "off": "on", "in": "out", "out": "in", "up": "down", "down": "up"}


def _particle_reversed(a: Profile, b: Profile) -> bool:
    """Whether one word takes a particle on one side and the opposite particle on the other ("how do I turn off
    autocorrect" / "how do I turn on autocorrect"), whatever else either side holds."""
    pa, pb = a.particles, b.particles
    return any((w, _PARTICLES[p]) in pb - pa for w, p in pa - pb)


_INVERTING = frozenset(("least", "less"))  # "least expensive" is "cheapest": the scale turned round
_DEGREE = _INVERTING | {"most", "more"}


def _antonyms(a: Profile, b: Profile) -> bool:
    only_a, only_b = a.words - b.words, b.words - a.words
    if bool(only_a & _INVERTING) != bool(only_b & _INVERTING) and lexicon.opposed(only_a - _DEGREE, only_b - _DEGREE):
        return False  # "the cheapest way" / "the least expensive way": opposites that one side turns round agree
    return lexicon.opposed(only_a, only_b)


# Digits that chat shorthand writes for words: "tips 2 sleep better", "a game 4 a party".
_DIGIT_WORDS = {2.0: "to", 4.0: "for"}


def _numbers_differ(a: Profile, b: Profile) -> bool:
    """A number of one side missing from the other; not a "2" or "4" that stands for a "to" or "for" that only the
    other side writes ("tips 2 sleep better" / "tips to sleep better")."""
    numbers_a, numbers_b = set(a.numbers), set(b.numbers)
    if numbers_a == numbers_b:
        return False
    return not (_as_words(a, b, numbers_a - numbers_b) and _as_words(b, a, numbers_b - numbers_a))


def _as_words(x: Profile, y: Profile, only_x: set[float]) -> bool:
    for n in only_x:
        word = _DIGIT_WORDS.get(n)
        if word is None or word not in y.words or word in x.words:
            return False
    return True


def _numbers_reordered(a: Profile, b: Profile) -> bool:
    return len(a.numbers) > 1 and a.numbers != b.numbers and sorted(a.numbers) == sorted(b.numbers)


def _owners_differ(a: Profile, b: Profile) -> bool:
    """Whether one thing has another owner on each side, one of them named ("my roommate's insurance covers my
    belongings" / "my insurance covers my roommate's belongings"): whose it is changes the answer. Any pronoun is
    the asker's, "my" and "your" alike, so only a named owner against another owner counts."""
    owners_b = dict(b.owners)
    for owned, owner in a.owners:
        other = owners_b.get(owned)
        if other is not None and other != owner and ("*" in (owner, other) or not _same_name(owner, other)):
            return True
    return False


def _languages_differ(a: Profile, b: Profile) -> bool:
    """Another language, or the same two with the other asked for ("in Spanish if I speak English" / "as a
    Spanish speaker, ... in English")."""
    if a.languages != b.languages:
        return True
    return bool(a.target_languages and b.target_languages and a.target_languages != b.target_languages)


def _one_edit(a: Profile, b: Profile) -> bool:
    """Whether the two prompts read the same but for one place where a word or two were replaced ("How do I make
    green tea?" / "How do I make black tea?"), articles aside. A paraphrase recasts the rest as well ("Where does
    X come from?" / "What is the origin of X?"): its one differing content word is then no swap."""
    x = [w for w in a.text.split() if w not in _ARTICLES]
    y = [w for w in b.text.split() if w not in _ARTICLES]
    edits = [op for op in SequenceMatcher(None, x, y, autojunk=False).get_opcodes() if op[0] != "equal"]
    if len(edits) != 1:
        return False
    kind, i1, i2, j1, j2 = edits[0]
    return kind == "replace" and i2 - i1 <= 2 and j2 - j1 <= 2


_ARTICLES = frozenset(("a", "an", "the"))


def _added(a: Profile, b: Profile) -> bool:
    """Whether one request is the other with words appended that hold content ("Explain recursion." / "Explain
    recursion with code.", "... for an expert audience", "...? Short and sweet."): a tail asks for another
    audience, another form of answer or a narrower topic. Courtesies ("... to me", "... please") hold none, and a
    paraphrase recasts the request rather than extending it."""
    x = [w for w in a.text.split() if w not in _ARTICLES]
    y = [w for w in b.text.split() if w not in _ARTICLES]
    if len(x) > len(y):
        x, y, b = y, x, a
    if len(x) == len(y) or not x or y[: len(x)] != x:
        return False
    return any(stem(w) in b.content and stem(w) not in _FRAMING for w in y[len(x) :])


def _scoped(a: Profile, b: Profile) -> bool:
    return a.scope != b.scope or bool(a.quantifiers and b.quantifiers and a.quantifiers != b.quantifiers)


def _asked_differ(a: Profile, b: Profile) -> bool:
    """Each asks for another kind of answer: "When was the tower built?" / "Where was the tower built?", "Why is
    the sky blue?" / "Is the sky blue?", "How do I boil an egg?" / "How long do I boil an egg?". "What" and a
    request without a question word ask for anything; a yes/no question may be answered with the way ("Is there a
    way to X?" / "How do I X?"). Which amount or degree ("how long" / "how far") is the other rules' to tell."""
    x, y = a.asked, b.asked
    return x != y and bool(x) and bool(y) and {x, y} != {"yes/no", "how"}


def _one_of_many(a: Profile, b: Profile) -> bool:
    """One thing asked for on one side, the same things in the plural on the other: "Give me one tip for a
    speech" / "Give me tips for a speech" ("one" is no number for the number rule, as "a" is not)."""
    for x in a.single - b.single:
        if any(w != x and w.endswith("s") and canonical(stem(w)) == x for w in b.words):
            return True
    return False


Check = Callable[[Profile, Profile], bool]
# The rules in the order they are tried: (the rule's name, the kind of difference it reports, the check).
CHECKS: tuple[tuple[str, str, Check], ...] = (
    ("quoted", "quoted", lambda a, b: _quoted_missing(a, b) or _quoted_missing(b, a)),
    ("code", "code", lambda a, b: _code_missing(a, b) or _code_missing(b, a)),
    ("language", "language", _languages_differ),
    ("date", "date", lambda a, b: a.dates != b.dates),
    ("number", "number", _numbers_differ),
    ("one of many", "number", lambda a, b: _one_of_many(a, b) or _one_of_many(b, a)),
    ("unit", "unit", _units_differ),
    ("negation", "negation", lambda a, b: a.negated != b.negated),
    ("question", "question", _asked_differ),
    ("affix", "negation", _affixed),
    ("entity", "entity", _entities_differ),
    ("direction word", "order", lambda a, b: _opposed(a, b) or _particle_reversed(a, b)),
    ("antonym", "antonym", _antonyms),
    ("numbers reordered", "order", _numbers_reordered),
    ("relation sides", "order", lambda a, b: marker_swapped(a, b) or marker_swapped(b, a)),
    ("source and target", "order", ends_crossed),
    ("roles", "order", roles_swapped),
    ("owners", "order", _owners_differ),
    ("scope word", "scope", _scoped),
    ("instruction", "scope", lambda a, b: a.instructions != b.instructions),
    ("added words", "scope", _added),
)
SUBSTITUTION: tuple[str, str, Check] = ("substitution", "substitution", _substituted)


def compare(a: Profile, b: Profile, strict: bool = True) -> str | None:
    """The first kind in which two profiles differ (see the module's docstring), or None when nothing vetoes.

    `strict` adds the last rule, "substitution"; without it only the named kinds veto.
    """
    for _, kind, check in CHECKS:
        if check(a, b):
            return kind
    if strict and _substituted(a, b):
        return "substitution"
    return None


def veto(query: str, cached: str, strict: bool = True) -> str | None:
    """None when nothing vetoes matching `query` to the entry stored for `cached`, else the kind of difference."""
    return compare(profile(query), profile(cached), strict)
