"""Guards: a cheap rule that vetoes a semantic match when two prompts differ in something that changes the answer.

A sentence embedding scores look-alikes ("convert 5 km to miles" / "convert 50 km to miles", "... in Python" /
"... in Java", "convert X to Y" / "convert Y to X") as near as true paraphrases, so no threshold separates them.
What separates them is *what differs* between the two prompts. The rule:

1. Each prompt is reduced once to a `Profile`: chat shorthand spelled out ("u" -> "you", "w/o" -> "without"),
   its word tokens lowercased, contractions split ("don't" -> "do not"), possessives dropped, a tiny suffix
   stemmer applied ("boiling", "boiled", "boils" -> "boil"), common synonyms folded ("costly" -> "expensive",
   lexicon.py), and stop words and politeness or filler words ("please", "can you", "hey", "thanks") set
   aside; plus what it holds of each kind below, normalised ("two" = "2", "kilograms" = "kg", "js" =
   "javascript", "1,000" = "1000").
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
     named things in the other order around a relation ("did A beat B" / "did B win against A"), two kinds of
     one thing swapped ("brown rice ... white rice"); a mere reordering that moves a whole phrase ("in Python,
     how do I ..." / "how do I ... in Python"), an adjective ("the best way" / "which way ... is the best")
     or things joined by "and", "or", "vs" is not;
   - "scope": a scope word on one side only ("all", "every", "only", "total", "average", "recursively",
     "daily" = "each day", ...), different quantifiers on the two sides ("most cats" / "any cats"), or another
     length, depth or format instruction ("in one sentence", "in detail", "step by step", "in bullet points",
     "like I'm five", "with examples", "just the answer");
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
about 280 µs and the whole comparison about 70 µs, the relation-sides and roles rules being the dearest.
A store can keep each entry's profile beside its vector, so that a lookup profiles only the query, once,
whatever the number of candidates.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from plugins.semantic_cache import lexicon
from plugins.semantic_cache.roles import marker_swapped, roles_swapped
from plugins.semantic_cache.vocabulary import (
    _AMBIGUOUS_LANGUAGES,
    _AMBIGUOUS_SEASONS,
    _AMBIGUOUS_UNITS,
    _INFINITIVE_TAKERS,
    _MARKER_SAME,
    _SEASON_CUES,
    COORDINATOR_TAG,
    COORDINATORS,
    DATE_WORDS,
    FILLER_WORDS,
    LANGUAGES,
    MONTHS,
    MULTIPLIERS,
    NEGATIONS,
    NUMBER_WORDS,
    OPPOSITES,
    ORDER_MARKERS,
    ORDER_TAGS,
    ORDINALS,
    OTHER_NUMBERS,
    PERIODS,
    QUANTIFIERS,
    SCOPE_SYNONYMS,
    SCOPE_WORDS,
    STOP_WORDS,
    UNITS,
    WEEKDAYS,
    _words,
)

# --- tokens -------------------------------------------------------------------------------------------------

_TOKEN = re.compile(
    r"[$€£¥]"
    r"|-?\d+(?:,\d{3})*(?:\.\d+)?(?:st|nd|rd|th)?(?![\d])"
    r"|[A-Za-z][A-Za-z0-9]*(?:\+\+|#)?(?:['\u2019][A-Za-z]+)?"
    r"|°[CFcf]|%"
)
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")
_ORDINAL_DIGITS = re.compile(r"(\d+)(?:st|nd|rd|th)$")
_DIGITS_THEN_LETTERS = re.compile(r"^(\d+(?:\.\d+)?)([a-z°%]+)$")
_SENTENCE_BREAK = re.compile(r"[.!?:;\n]")
_CLAUSE_BREAK = re.compile(r"[.!?;\n]")
_QUOTED = re.compile(
    r'"([^"\n]{1,200})"'
    r"|\u201c([^\u201d\n]{1,200})\u201d"  # curly double quotes
    r"|(?<![\w'\u2019])['\u2018]([^'\u2019\u2018\n]{1,200})['\u2019](?!\w)"  # single quotes, not apostrophes
)
_CODE = re.compile(
    r"`([^`\n]+)`"  # backticked
    r"|(?<![\w.])[A-Za-z_][A-Za-z0-9]*_[A-Za-z0-9_]+"  # snake_case
    r"|(?<![\w.])[a-z]+[A-Z][A-Za-z0-9]*"  # camelCase
    r"|(?<![\w.])[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+(?:\(\))?"  # dotted (os.path.join, node.js)
    r"|(?<![\w.])[A-Za-z_]\w*\(\)"  # call()
    r"|(?<![\w-])--?[A-Za-z][\w-]*"  # --flag, -l
)
_ACRONYM = re.compile(r"^[A-Z][A-Z0-9&]+s?$")


@lru_cache(maxsize=16384)  # a vocabulary repeats: the stems of the words seen are kept
def stem(word: str) -> str:
    """A tiny suffix stemmer: the same stem for a word's common inflections (plural, -ing, -ed, -ly)."""
    w = word
    if len(w) > 4 and w.endswith("ies"):
        w = w[:-3] + "y"
    elif len(w) > 4 and w.endswith(("sses", "ches", "shes", "xes", "zes")):
        w = w[:-2]
    elif len(w) > 3 and w.endswith("s") and not w.endswith(("ss", "us", "is")):
        w = w[:-1]
    if len(w) > 5 and w.endswith("ing"):
        w = w[:-3]
    elif (len(w) > 4 and w.endswith("ed")) or (len(w) > 5 and w.endswith("ly")):
        w = w[:-2]
    if len(w) > 3 and w[-1] == w[-2] and w[-1] not in "aeiouls":
        w = w[:-1]  # running -> runn -> run
    if len(w) > 3 and w.endswith("e"):
        w = w[:-1]  # bake, baked, baking -> bak
    return w


@dataclass(frozen=True)
class Token:
    word: str  # lower case, contraction and possessive removed
    capitalised: bool  # starts with a capital (acronyms too)
    acronym: bool
    sentence_start: bool
    clause: int  # index of the sentence it is in


@dataclass(frozen=True)
class Profile:
    """What one prompt holds, for comparisons: computed once per prompt."""

    text: str  # lower case, words separated by single spaces (for "does the other contain this phrase")
    content: tuple[str, ...]  # content word stems in order (stop and filler words out), with order markers kept
    clauses: tuple[int, ...]  # the clause of each content entry
    stems: frozenset[str]  # every word's stem, stop words included
    quoted: tuple[str, ...]
    code: frozenset[str]
    languages: frozenset[str]
    numbers: tuple[float, ...]  # in order of appearance; 1 left out, as "one" and "a" are alike
    dates: frozenset[str]
    units: frozenset[str]
    negated: bool
    entities: frozenset[str]  # stems
    runs: tuple[
        tuple[str, frozenset[str]], ...
    ]  # runs of capitalised words: (initials, stems), "nyc" for New York City
    scope: frozenset[str]
    quantifiers: frozenset[str]
    words: frozenset[str] = frozenset()  # every word, lower case, as written (for affixes and antonyms)
    instructions: frozenset[str] = frozenset()  # kinds of length, depth or format instruction (lexicon.py)
    subject: str = ""  # the subject of a question ("does caffeine affect ..."), as its content stem, or ""


_HYPHENATED_PREFIX = re.compile(r"\b(non|un|anti|dis)-(?=[a-z])", re.IGNORECASE)
# A one-letter language name ("C", "R") only where a language stands: "in C", "C code", not "vitamin C".
_LANGUAGE_BEFORE = frozenset(_words("in using with for to from into write learn"))
_LANGUAGE_AFTER = frozenset(
    _words("code program programs programming language function functions script library compiler pointer array")
)
# "How long", "how far", "how much": a question that leaves the answer's unit open matches one that names it.
_OPEN_MEASURE = re.compile(r"\bhow (?:long|far|much|many|big|heavy|fast|tall|old|hot|cold|often)\b")
_OPEN_MEASURES = frozenset(_words("long far much big heavy fast tall old hot cold often"))
_STEM_SYNONYM: dict[str, str] = {}


def _canonical(s: str) -> str:
    """A content word's stem, a synonym folded into its group's first word ("costly" -> "expens")."""
    if not _STEM_SYNONYM:
        for word, canonical in lexicon.SYNONYM.items():
            _STEM_SYNONYM[stem(word)] = stem(canonical)
    return _STEM_SYNONYM.get(s, s)


def _normal_text(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9+#]+", text.lower()))


def _tokens(text: str) -> list[Token]:
    tokens: list[Token] = []
    previous_end = 0
    clause = 0
    for match in _TOKEN.finditer(text):
        between = text[previous_end : match.start()]
        if _CLAUSE_BREAK.search(between):
            clause += 1
        raw = match.group()
        start = not tokens or bool(_SENTENCE_BREAK.search(between))
        previous_end = match.end()
        lower = raw.lower().replace("\u2019", "'")
        negation = False
        if lower.endswith("n't"):
            negation = True
            lower = {"won't": "will", "can't": "can", "shan't": "shall"}.get(lower, lower[:-3])
        elif "'" in lower:
            lower = lower.split("'")[0]  # possessives and 're / 've / 'll / 'd / 'm
        acronym = bool(_ACRONYM.match(raw)) and raw not in ("I", "A")
        tokens.append(Token(lower, raw[0].isupper(), acronym, start, clause))
        if lower == "free" and text[match.start() - 1 : match.start()] == "-":
            negation = True  # "gluten-free", "chemical-free": without
        if negation:
            tokens.append(Token("not", False, False, False, clause))
    return tokens


def _numbers_from_words(words: list[str]) -> tuple[list[tuple[int, float]], set[int]]:
    """Numbers written in words ("twenty five", "two hundred", "a dozen") with their first token's position, and
    the token positions they used."""
    found: list[tuple[int, float]] = []
    used: set[int] = set()
    current: float | None = None
    begun = 0
    for i, w in enumerate(words):
        if w in NUMBER_WORDS:
            if current is None:
                begun = i
            current = (current or 0) + NUMBER_WORDS[w]
            used.add(i)
        elif w in MULTIPLIERS and (current is not None or (i > 0 and words[i - 1] in ("a", "one"))):
            if current is None:
                begun = i
            current = (current if current is not None else 1) * MULTIPLIERS[w]
            used.add(i)
        else:
            if current is not None:
                found.append((begun, current))
                current = None
            if w in OTHER_NUMBERS:
                found.append((i, OTHER_NUMBERS[w]))
                used.add(i)
    if current is not None:
        found.append((begun, current))
    return found, used


def profile(text: str) -> Profile:
    """Reduce a prompt to what the comparison needs (see the module's docstring)."""
    text = lexicon.spell_out(text)
    told = lexicon.instructions(text.lower())
    text = _HYPHENATED_PREFIX.sub(r"\1", text)  # "non-toxic" is one word, "nontoxic", as "unsafe" is
    tokens = _tokens(text)
    words = [t.word for t in tokens]
    inner = [t for t in tokens if t.word[:1].isalpha() and len(t.word) > 3 and not t.sentence_start]
    # Title Case ("Best Way To Cook Rice") says nothing about names: capitals count only as acronyms there.
    title_case = len(inner) >= 3 and sum(t.capitalised for t in inner) >= 0.75 * len(inner)

    numbers: list[tuple[int, float]] = []
    dates: set[str] = set()
    units: set[str] = set()
    languages: set[str] = set()
    entities: set[str] = set()
    scope: set[str] = set()
    content: list[str] = []
    clauses: list[int] = []
    quantifiers: set[str] = set()
    negated = False
    word_numbers, used = _numbers_from_words(words)
    after_number = False
    for i, token in enumerate(tokens):
        w = token.word
        is_number = after_number
        after_number = False
        before = words[i - 1] if i else ""
        if w in QUANTIFIERS:
            quantifiers.add({"every": "all", "each": "all", "no": "none"}.get(w, w))
        if w in PERIODS and before in ("each", "every", "per", "a", "an"):
            scope.add(PERIODS[w])  # "each day" is "daily"
            continue
        ordinal = _ORDINAL_DIGITS.match(w)
        mixed = _DIGITS_THEN_LETTERS.match(w) if w[:1].isdigit() or w[:1] == "-" else None
        if ordinal:
            numbers.append((i, -1000.0 - int(ordinal.group(1))))  # ordinals kept apart from cardinals
            after_number = True
            continue
        if _NUMBER.fullmatch(w):
            value = float(w.replace(",", ""))
            numbers.append((i, value))
            if 1000 <= value <= 2100 and value.is_integer() and "," not in w:
                dates.add(str(int(value)))
            after_number = True
            continue
        if mixed:  # 5kg, 10am, 3pm, 100ms
            numbers.append((i, float(mixed.group(1))))
            suffix = mixed.group(2)
            if suffix in ("am", "pm"):
                dates.add(suffix)
            elif suffix in UNITS:
                units.add(UNITS[suffix])
            continue
        if i in used:
            after_number = True
            continue
        if w in ORDINALS and w not in ("first", "second", "last"):
            numbers.append((i, -1000.0 - ORDINALS[w]))
            continue
        if w in UNITS and (w not in _AMBIGUOUS_UNITS or is_number):
            units.add(UNITS[w])
            content.append(UNITS[w])
            clauses.append(token.clause)
            continue
        named = w not in _AMBIGUOUS_LANGUAGES or (token.capitalised and not token.sentence_start)
        if named and len(w) == 1:
            after = words[i + 1] if i + 1 < len(words) else ""
            named = before in _LANGUAGE_BEFORE or after in _LANGUAGE_AFTER
        if w in LANGUAGES and named and not (w == "c" and is_number):  # "20 C" is a temperature
            languages.add(LANGUAGES[w])
            content.append(LANGUAGES[w])
            clauses.append(token.clause)
            continue
        if w in MONTHS and (w != "may" or token.capitalised):
            dates.add(f"month{MONTHS[w]}")
            continue
        if w in WEEKDAYS or w in DATE_WORDS or (w in _AMBIGUOUS_SEASONS and before in _SEASON_CUES):
            dates.add(w)
            continue
        if w in NEGATIONS:
            negated = True
            continue
        if w == "to" and before in _INFINITIVE_TAKERS:
            continue  # "how to", "possible to bring": an infinitive, not a direction
        if w in ORDER_MARKERS:
            content.append(f"<{_MARKER_SAME.get(w, w)}>")
            clauses.append(token.clause)
            continue
        if w in COORDINATORS:
            content.append(COORDINATOR_TAG)
            clauses.append(token.clause)
            continue
        if w in STOP_WORDS or w in FILLER_WORDS:
            continue
        s = stem(w)
        if w in SCOPE_WORDS and not (w in ("each", "every") and i + 1 < len(words) and words[i + 1] in PERIODS):
            scope.add(SCOPE_SYNONYMS.get(w, w))
        if (
            token.acronym
            or any(c.isdigit() for c in w)
            or (token.capitalised and not token.sentence_start and not title_case)
        ):
            entities.add(s)
        content.append(_canonical(s))
        clauses.append(token.clause)

    numbers.extend(word_numbers)
    numbers.sort()
    capitalised_run: list[str] = []
    runs: list[tuple[str, frozenset[str]]] = []
    for token in [*tokens, Token("", False, False, False, -1)]:
        if token.capitalised and token.word.isalpha() and token.word not in STOP_WORDS:
            capitalised_run.append(token.word)
            continue
        if len(capitalised_run) >= 2:
            runs.append(("".join(w[0] for w in capitalised_run), frozenset(stem(w) for w in capitalised_run)))
        capitalised_run = []

    quoted = tuple(_normal_text(next(g for g in m.groups() if g is not None)) for m in _QUOTED.finditer(text))
    code = frozenset(m.group(1 if m.group(1) is not None else 0).strip().lower() for m in _CODE.finditer(text))
    return Profile(
        text=f" {_normal_text(text)} ",
        content=tuple(content),
        clauses=tuple(clauses),
        stems=frozenset(stem(w) for w in words),
        quoted=tuple(q for q in quoted if q),
        code=code,
        languages=frozenset(languages),
        numbers=tuple(value for _, value in numbers if value != 1),
        dates=frozenset(dates),
        units=frozenset(units),
        negated=negated,
        entities=frozenset(entities),
        runs=tuple(runs),
        scope=frozenset(scope),
        quantifiers=frozenset(quantifiers),
        words=frozenset(words),
        instructions=told,
        subject=_subject(tokens),
    )


# Auxiliaries that put a subject before a verb ("does X affect Y", "can X lead to Y"); "is" is left out, as
# "what is the meaning of X" has no subject-verb order to read.
_AUXILIARIES = frozenset(_words("do does did can could will would should"))
_DETERMINERS = frozenset(_words("a an the my your his her their our its this that these those some any"))


def _subject(tokens: list[Token]) -> str:
    """The subject of a question: the first word after its first auxiliary ("How does caffeine affect sleep?",
    "What effect does sleep have on caffeine?") or what "how many" counts ("how many cups are in a gallon"),
    unless a pronoun is there."""
    for i, token in enumerate(tokens):
        counted = token.word in ("many", "much") and i > 0 and tokens[i - 1].word == "how"
        if token.word not in _AUXILIARIES and not counted:
            continue
        j = i + 1
        while j < len(tokens) and tokens[j].word in _DETERMINERS:
            j += 1
        if j >= len(tokens) or tokens[j].word in STOP_WORDS or tokens[j].word in FILLER_WORDS:
            return ""
        word = tokens[j].word
        return UNITS[word] if word in UNITS else _canonical(stem(word))
    return ""


def _quoted_missing(a: Profile, b: Profile) -> bool:
    return any(f" {q} " not in b.text for q in a.quoted)


def _code_missing(a: Profile, b: Profile) -> bool:
    return any(c not in b.code and f" {_normal_text(c)} " not in b.text for c in a.code)


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
    if {x, y} & _OPEN_MEASURES and {x, y} & set(UNITS.values()):
        return False  # "how long" / "how many hours": the unit the other leaves open
    if _same_name(x, y) or _agent(x, y) or _agent(y, x) or any(lexicon.typo_of(w, r) for w in (x, y) for r in _FRAMING):
        return False
    return bool(set(a.content) & set(b.content) - ORDER_TAGS - {COORDINATOR_TAG})


# A verb framing the request, or a quantifier (compared by the scope rule): not what the request is about.
_FRAMING = frozenset(stem(w) for w in lexicon.REQUEST_VERBS | QUANTIFIERS)


def _agent(x: str, y: str) -> bool:
    """ "speaker" / "speak", "driver" / "drive": a doer named after the deed."""
    return x in (y + "er", y + "r", y + "or")


def _units_differ(a: Profile, b: Profile) -> bool:
    if a.units == b.units:
        return False
    # "How long is the flight?" / "How many hours is the flight?": a unit named against an open measure.
    if not a.units and _OPEN_MEASURE.search(a.text):
        return False
    return not (not b.units and _OPEN_MEASURE.search(b.text))


def _affixed(a: Profile, b: Profile) -> bool:
    return lexicon.affix_negated(a.words - b.words, b.words) or lexicon.affix_negated(b.words - a.words, a.words)


def _antonyms(a: Profile, b: Profile) -> bool:
    return lexicon.opposed(a.words - b.words, b.words - a.words)


def _numbers_reordered(a: Profile, b: Profile) -> bool:
    return len(a.numbers) > 1 and a.numbers != b.numbers and sorted(a.numbers) == sorted(b.numbers)


def _scoped(a: Profile, b: Profile) -> bool:
    return a.scope != b.scope or bool(a.quantifiers and b.quantifiers and a.quantifiers != b.quantifiers)


Check = Callable[[Profile, Profile], bool]
# The rules in the order they are tried: (the rule's name, the kind of difference it reports, the check).
CHECKS: tuple[tuple[str, str, Check], ...] = (
    ("quoted", "quoted", lambda a, b: _quoted_missing(a, b) or _quoted_missing(b, a)),
    ("code", "code", lambda a, b: _code_missing(a, b) or _code_missing(b, a)),
    ("language", "language", lambda a, b: a.languages != b.languages),
    ("date", "date", lambda a, b: a.dates != b.dates),
    ("number", "number", lambda a, b: set(a.numbers) != set(b.numbers)),
    ("unit", "unit", _units_differ),
    ("negation", "negation", lambda a, b: a.negated != b.negated),
    ("affix", "negation", _affixed),
    ("entity", "entity", _entities_differ),
    ("direction word", "order", _opposed),
    ("antonym", "antonym", _antonyms),
    ("numbers reordered", "order", _numbers_reordered),
    ("relation sides", "order", lambda a, b: marker_swapped(a, b) or marker_swapped(b, a)),
    ("roles", "order", roles_swapped),
    ("scope word", "scope", _scoped),
    ("instruction", "scope", lambda a, b: a.instructions != b.instructions),
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
