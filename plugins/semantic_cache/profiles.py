"""Profiles: what one prompt holds, read once per prompt, for the guards to compare (guards.py says the rule).

A prompt is reduced to a `Profile`: chat shorthand spelled out ("u" -> "you", "w/o" -> "without"), its word
tokens lowercased, contractions split ("don't" -> "do not"), possessives dropped, a tiny suffix stemmer applied
("boiling", "boiled", "boils" -> "boil"), common synonyms folded ("costly" -> "expensive", lexicon.py), stop
words and politeness or filler words ("please", "can you", "hey", "thanks") set aside; plus what it holds of
each kind the guards compare, normalised ("two" = "2", "kilograms" = "kg", "js" = "javascript", "1,000" = "1000").
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache

from plugins.semantic_cache import lexicon
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
    ORDER_MARKERS,
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
_PART_BREAK = re.compile(r"[.!?;:,()\n]")
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
    r"|(?<![\w=])=[A-Za-z][A-Za-z0-9.]*"  # a spreadsheet function, =SUMIF
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
    part: int = 0  # index of the stretch between commas, clause breaks and subordinating conjunctions


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
    passive: bool = False  # a passive verb with its agent ("be replaced by X"): its words' order reads reversed
    target_languages: frozenset[str] = frozenset()  # a language after "in" or "into": the one asked for
    owners: tuple[tuple[str, str], ...] = ()  # (what is owned, its owner): "roommate's insurance", "my debts"
    particles: frozenset[tuple[str, str]] = frozenset()  # a word and the particle after it: ("turn", "off")
    # Content stems in a noun phrase no preposition governs (a verb's arguments), each with its token's `part`.
    bare: tuple[tuple[str, int], ...] = ()
    clause_subjects: tuple[tuple[str, str], ...] = ()  # (conjunction, subject): "when Chelsea hosted ..."
    single: frozenset[str] = frozenset()  # what one thing is asked for of: "one tip", "a single example"
    asked: str = ""  # what the question asks for: "who", "when", "where", "why", "how", "how long", ..., "yes/no"
    agent: str = ""  # a passive's agent, the word after its "by" ("influenced by Wagner"), as its content stem


# A passive verb with its agent: a form of "be" or "get", a question's subject perhaps ("is the damage covered by
# X"), a participle ("-ed", "-en", or an irregular one) and "by": "can butter be replaced by oil" says what "can oil
# replace butter" says, its two things in the other order.
_PASSIVE = re.compile(
    r"\b(?:is|are|was|were|be|been|being|gets?|got|gotten)\s+"
    r"(?:(?:(?:the|a|an|my|your|his|her|its|our|their|this|that)\s+)?(?:\w+\s+){1,2})?"  # a question's subject
    r"(?:\w+ly\s+)?"
    r"(?:\w+(?:ed|en|wn|ne)|beat|bought|caught|made|paid|sold|taught|thought|told|held|kept|left|lost|led|sent|"
    r"spent|built|brought|found|won|hit|put|set|cut|run|sung|swung|struck|understood)\s+by\b"
)
_HYPHENATED_PREFIX = re.compile(r"\b(non|un|anti|dis)-(?=[a-z])", re.IGNORECASE)
# A one-letter language name ("C", "R") only where a language stands: "in C", "C code", not "vitamin C".
_LANGUAGE_BEFORE = frozenset(_words("in using with for to from into write learn"))
_LANGUAGE_AFTER = frozenset(
    _words("code program programs programming language function functions script library compiler pointer array")
)
# "How long", "how far", "how much": a question that leaves the answer's unit open matches one that names it.
OPEN_MEASURE = re.compile(r"\bhow (?:long|far|much|many|big|heavy|fast|tall|old|hot|cold|often)\b")
OPEN_MEASURES = frozenset(_words("long far much big heavy fast tall old hot cold often"))
_STEM_SYNONYM: dict[str, str] = {}
# A word pointing at a period from now: "this weekend" and "next weekend" are other days, "coming" is "next".
_DEICTIC = {"this": "this ", "next": "next ", "coming": "next ", "last": "last ", "past": "last ", "previous": "last "}


def canonical(s: str) -> str:
    """A content word's stem, a synonym folded into its group's first word ("costly" -> "expens")."""
    if not _STEM_SYNONYM:
        for word, canonical in lexicon.SYNONYM.items():
            _STEM_SYNONYM[stem(word)] = stem(canonical)
    return _STEM_SYNONYM.get(s, s)


def normal_text(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9+#]+", text.lower()))


def _tokens(text: str) -> list[Token]:
    tokens: list[Token] = []
    previous_end = 0
    clause = part = 0
    for match in _TOKEN.finditer(text):
        between = text[previous_end : match.start()]
        if _CLAUSE_BREAK.search(between):
            clause += 1
        if _PART_BREAK.search(between) or match.group().lower() in _SUBORDINATORS:
            part += 1
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
        tokens.append(Token(lower, raw[0].isupper(), acronym, start, clause, part))
        if lower == "free" and text[match.start() - 1 : match.start()] == "-":
            negation = True  # "gluten-free", "chemical-free": without
        if negation:
            tokens.append(Token("not", False, False, False, clause, part))
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


@dataclass
class _Reader:
    """The kinds found in one prompt's tokens, gathered in one pass (`profile`)."""

    tokens: list[Token]
    words: list[str]
    title_case: bool
    used: set[int]  # token positions taken by numbers written in words
    numbers: list[tuple[int, float]] = field(default_factory=list)
    dates: set[str] = field(default_factory=set)
    units: set[str] = field(default_factory=set)
    languages: set[str] = field(default_factory=set)
    target_languages: set[str] = field(default_factory=set)
    entities: set[str] = field(default_factory=set)
    scope: set[str] = field(default_factory=set)
    quantifiers: set[str] = field(default_factory=set)
    content: list[str] = field(default_factory=list)
    clauses: list[int] = field(default_factory=list)
    bare: dict[str, int] = field(default_factory=dict)
    negated: bool = False

    def read(self) -> None:
        after_number = False
        for i, token in enumerate(self.tokens):
            w = token.word
            before = self.words[i - 1] if i else ""
            if w in QUANTIFIERS:
                self.quantifiers.add({"every": "all", "each": "all", "no": "none"}.get(w, w))
            if w in PERIODS and before in ("each", "every", "per", "a", "an"):
                self.scope.add(PERIODS[w])  # "each day" is "daily"
                after_number = False
                continue
            numeric = self._numeric(i, w)
            if numeric is not None:
                after_number = numeric
                continue
            is_number, after_number = after_number, False
            if not self._named(i, token, before, is_number):
                self._word(i, token)

    def _keep(self, word: str, token: Token) -> None:
        self.content.append(word)
        self.clauses.append(token.clause)

    def _numeric(self, i: int, w: str) -> bool | None:
        """None when the token is no number; else whether a unit may follow it (a cardinal, not "10am")."""
        ordinal = _ORDINAL_DIGITS.match(w)
        if ordinal:
            self.numbers.append((i, -1000.0 - int(ordinal.group(1))))  # ordinals kept apart from cardinals
            return True
        if _NUMBER.fullmatch(w):
            value = float(w.replace(",", ""))
            self.numbers.append((i, value))
            if 1000 <= value <= 2100 and value.is_integer() and "," not in w:
                self.dates.add(str(int(value)))
            return True
        mixed = _DIGITS_THEN_LETTERS.match(w) if w[:1].isdigit() or w[:1] == "-" else None
        if mixed:  # 5kg, 10am, 3pm, 100ms
            self.numbers.append((i, float(mixed.group(1))))
            suffix = mixed.group(2)
            if suffix in ("am", "pm"):
                self.dates.add(suffix)
            elif suffix in UNITS:
                self.units.add(UNITS[suffix])
            return False
        if i in self.used:
            return True
        if w in ORDINALS and w not in ("first", "second", "last"):
            self.numbers.append((i, -1000.0 - ORDINALS[w]))
            return False
        return None

    def _named(self, i: int, token: Token, before: str, is_number: bool) -> bool:
        """Units, languages, dates, negations and relation markers: whether the token was one of them."""
        w = token.word
        if w in UNITS and (w not in _AMBIGUOUS_UNITS or is_number):
            self.units.add(UNITS[w])
            self._keep(UNITS[w], token)
            return True
        after = self.words[i + 1] if i + 1 < len(self.words) else ""
        # A capital names the language ("learn Ruby"), at a sentence's start too when compared ("Ruby vs Python").
        named = w not in _AMBIGUOUS_LANGUAGES or (
            token.capitalised and (not token.sentence_start or after in COORDINATORS)
        )
        if named and len(w) == 1:
            named = before in _LANGUAGE_BEFORE or after in _LANGUAGE_AFTER
        if w in LANGUAGES and named and not (w == "c" and is_number):  # "20 C" is a temperature
            self.languages.add(LANGUAGES[w])
            # "Say it in Spanish", "put it into Brazilian Portuguese": the language asked for; "into" says it
            # over an "in" of the same prompt ("written in German, into French"), which then names the source.
            at = i - 1 if before in ("in", "into") else i - 2
            if at >= 0 and self.words[at] in ("in", "into") and (at == i - 1 or self.tokens[i - 1].capitalised):
                self.target_languages.add(("into " if self.words[at] == "into" else "") + LANGUAGES[w])
            self._keep(LANGUAGES[w], token)
            return True
        if w in MONTHS and (w != "may" or token.capitalised):
            self.dates.add(f"month{MONTHS[w]}")
            return True
        if w in WEEKDAYS or w in DATE_WORDS or (w in _AMBIGUOUS_SEASONS and before in _SEASON_CUES):
            self.dates.add(_DEICTIC.get(before, "") + w)
            return True
        if w in PERIODS and before in _DEICTIC:
            self.dates.add(_DEICTIC[before] + w)  # "this week" / "next week": which one, not how often
            return True
        if w in NEGATIONS:
            self.negated = True
            return True
        if w == "to" and before in _INFINITIVE_TAKERS:
            return True  # "how to", "possible to bring": an infinitive, not a direction
        if w in ORDER_MARKERS:
            self._keep(f"<{_MARKER_SAME.get(w, w)}>", token)
            return True
        if w in COORDINATORS:
            self._keep(COORDINATOR_TAG, token)
            return True
        return w in STOP_WORDS or w in FILLER_WORDS

    def _word(self, i: int, token: Token) -> None:
        w = token.word
        s = stem(w)
        following = self.words[i + 1] if i + 1 < len(self.words) else ""
        if w in SCOPE_WORDS and not (w in ("each", "every") and following in PERIODS):
            self.scope.add(SCOPE_SYNONYMS.get(w, w))
        if (
            token.acronym
            or any(c.isdigit() for c in w)
            or (token.capitalised and not token.sentence_start and not self.title_case)
        ):
            self.entities.add(s)
        if _bare(self.words, i):
            self.bare[canonical(s)] = token.part
        self._keep(canonical(s), token)


def _runs(tokens: list[Token]) -> tuple[tuple[str, frozenset[str]], ...]:
    """Runs of two or more capitalised words: (their initials, their stems), "nyc" for New York City."""
    capitalised_run: list[str] = []
    runs: list[tuple[str, frozenset[str]]] = []
    for token in [*tokens, Token("", False, False, False, -1)]:
        if token.capitalised and token.word.isalpha() and token.word not in STOP_WORDS:
            capitalised_run.append(token.word)
            continue
        if len(capitalised_run) >= 2:
            runs.append(("".join(w[0] for w in capitalised_run), frozenset(stem(w) for w in capitalised_run)))
        capitalised_run = []
    return tuple(runs)


# An owner before what it owns: a possessive pronoun (any person: "my" and "your" ask alike) or a noun with "'s".
_OWNER = re.compile(r"\b(my|our|your|his|their|its|[a-z]+'s|[a-z]+s')\s+(?=([a-z]+))")
_NOT_OWNERS = frozenset(_words("it's that's what's there's here's who's where's how's let's he's she's when's why's"))


def _owners(lower_text: str) -> tuple[tuple[str, str], ...]:
    """Who owns what: ("insur", "roommate") for "my roommate's insurance", ("debt", "*") for "my debts"."""
    owners: list[tuple[str, str]] = []
    for match in _OWNER.finditer(lower_text.replace("\u2019", "'")):
        owner, owned = match.groups()
        if owner in _NOT_OWNERS or owned in STOP_WORDS:
            continue
        name = "*" if "'" not in owner else canonical(stem(owner.split("'")[0]))
        owners.append((canonical(stem(owned)), name))
    return tuple(owners)


# Particles of a phrasal verb that reverse it: "turn on" / "turn off", "log in" / "log out", "scale up" / "down".
_PARTICLES = frozenset(_words("on off in out up down"))


def _particles(words: list[str]) -> frozenset[tuple[str, str]]:
    return frozenset((w, words[i + 1]) for i, w in enumerate(words[:-1]) if words[i + 1] in _PARTICLES)


def _asked_for(languages: set[str]) -> frozenset[str]:
    into = {w[5:] for w in languages if w.startswith("into ")}
    return frozenset(into or languages)


def _numeric_word(w: str) -> bool:
    return w[:1].isdigit() or w in NUMBER_WORDS or w in MULTIPLIERS or w in ORDINALS


def profile(text: str) -> Profile:
    """Reduce a prompt to what the comparison needs (see the module's docstring and guards.py)."""
    text = lexicon.spell_out(text)
    told = lexicon.instructions(text.lower())
    text = lexicon.without_instructions(text, _numeric_word) if told else text
    text = _HYPHENATED_PREFIX.sub(r"\1", text)  # "non-toxic" is one word, "nontoxic", as "unsafe" is
    tokens = _tokens(text)
    words = [t.word for t in tokens]
    inner = [t for t in tokens if t.word[:1].isalpha() and len(t.word) > 3 and not t.sentence_start]
    # Title Case ("Best Way To Cook Rice") says nothing about names: capitals count only as acronyms there.
    title_case = len(inner) >= 3 and sum(t.capitalised for t in inner) >= 0.75 * len(inner)
    word_numbers, used = _numbers_from_words(words)
    reader = _Reader(tokens, words, title_case, used)
    reader.read()
    numbers = sorted([*reader.numbers, *word_numbers])
    quoted = tuple(normal_text(next(g for g in m.groups() if g is not None)) for m in _QUOTED.finditer(text))
    code = frozenset(m.group(1 if m.group(1) is not None else 0).strip().lower() for m in _CODE.finditer(text))
    normal = normal_text(text)
    passive = _PASSIVE.search(text.lower())
    return Profile(
        text=f" {normal} ",
        content=tuple(reader.content),
        clauses=tuple(reader.clauses),
        stems=frozenset(stem(w) for w in words),
        quoted=tuple(q for q in quoted if q),
        code=code,
        languages=frozenset(reader.languages),
        numbers=tuple(value for _, value in numbers if value != 1),
        dates=frozenset(reader.dates),
        units=frozenset(reader.units),
        negated=reader.negated,
        entities=frozenset(reader.entities),
        runs=_runs(tokens),
        scope=frozenset(reader.scope),
        quantifiers=frozenset(reader.quantifiers),
        words=frozenset(words),
        instructions=told,
        subject=_subject(tokens),
        passive=passive is not None,
        agent=_agent(text.lower(), passive),
        single=_single(words),
        asked=_asked(words),
        owners=_owners(text.lower()),
        particles=_particles(normal.split()),
        target_languages=_asked_for(reader.target_languages),
        bare=tuple(reader.bare.items()),
        clause_subjects=_clause_subjects(tokens),
    )


_PREPOSITIONS = frozenset(
    _words("""of in on at by for with about as into onto upon within out off to from than before after over towards
    toward against under between among through during without per via across behind beyond near around like unlike""")
)


def _bare(words: list[str], i: int) -> bool:
    """Whether the word at i heads a determined noun phrase that no preposition governs, as a verb's subject or
    object stands ("does the tenant owe the landlord"), not one that a preposition governs ("under the lease",
    "for the dog") nor a word without a determiner, which may as well be a verb ("rest", "traveling"): a
    determiner at most two content words before it, and no preposition before the determiner."""
    j = i - 1
    while j >= i - 3 and j >= 0 and words[j] not in STOP_WORDS and words[j] not in FILLER_WORDS:
        j -= 1  # the phrase's other content words ("sour" of "the sour cream")
    if j < 0 or words[j] not in _DETERMINERS:
        return False
    return j == 0 or words[j - 1] not in _PREPOSITIONS


_AGENT = re.compile(r"\s*(?:(?:the|a|an|my|your|his|her|its|our|their|this|that)\s+)?([a-z][a-z0-9]*)")


def _agent(lower_text: str, passive: re.Match[str] | None) -> str:
    """The passive's agent: the first word after its "by" and a determiner ("covered by the insurance")."""
    if passive is None:
        return ""
    found = _AGENT.match(lower_text, passive.end())
    return canonical(stem(found.group(1))) if found else ""


# Nouns that make "what" or "which" ask for a time, a place or a reason: "what year" is "when".
_ASKED_BY_NOUN = {
    **dict.fromkeys(_words("time year date day month century decade hour"), "when"),
    **dict.fromkeys(_words("place country city town state continent region address"), "where"),
    "reason": "why",
}
# Words that open a question answered yes or no: "Is the sky blue?" asks no reason; "Why is the sky blue?" does.
_YES_NO = frozenset(_words("is are was were am do does did can could should would will may might must shall has have"))


# What "how" asks the degree of ("how long", "how early"); before any other word it asks the way.
_DEGREES = OPEN_MEASURES | frozenset(_words("many early late soon deep wide high low thick large small strong well"))


def _asked(words: list[str]) -> str:
    """What the request asks for, read from its first question word: a person, a time, a place, a reason, a
    manner ("how do I ..."), or an amount or degree ("how many", "how long", "how often"); "yes/no" for a question
    that opens with a verb and holds no question word; "" for "what" and "which" that ask for any thing, and for a
    request that asks no question ("Explain tides"), which may be answered the same way. "When" and "where" ask
    only before a verb or "to" ("when does it open", "where to park"); before a subject they open a clause
    ("when traveling alone, how do I ...")."""
    for i, w in enumerate(words):
        after = words[i + 1] if i + 1 < len(words) else ""
        if w in ("who", "whom", "whose", "why"):
            return "why" if w == "why" else "who"
        if w in ("when", "where"):
            if after in _YES_NO or after == "to":
                return w
            continue
        if w == "how":
            if after == "come":
                return "why"
            if after in _DEGREES or (after.endswith("ly") and len(after) > 4):
                return "how much"  # "how many", "how long", "how often", "how frequently": an amount or a degree
            return "how"  # "how do I", "how to", "how vaccines work"
        if w in ("what", "which"):
            return _ASKED_BY_NOUN.get(after, "")
    return "yes/no" if words and words[0] in _YES_NO else ""


def _single(words: list[str]) -> frozenset[str]:
    """The content stems that "one" or "single" counts ("give me one tip", "one of the tips", "a single
    example"): one thing asked for, where "a tip" says nothing of how many."""
    found: set[str] = set()
    for i, w in enumerate(words):
        if w not in ("one", "single"):
            continue
        j = i + 1
        if j < len(words) and words[j] == "of":
            j += 1
        while j < len(words) and words[j] in _DETERMINERS:
            j += 1
        if j < len(words) and words[j] not in STOP_WORDS and words[j] not in FILLER_WORDS:
            found.add(canonical(stem(words[j])))
    return frozenset(found)


# Conjunctions that open a clause with a subject of its own: "when Chelsea hosted Liverpool", "if the tenant leaves".
_SUBORDINATORS = frozenset(
    _words("when whenever if after before while once because since unless until although though")
)


def _clause_subjects(tokens: list[Token]) -> tuple[tuple[str, str], ...]:
    """The subject of each clause a conjunction opens, by the conjunction: the first word after it and its
    determiners, unless that is a stop word ("when did ...": a question, whose subject `_subject` reads)."""
    found: list[tuple[str, str]] = []
    for i, token in enumerate(tokens):
        if token.word not in _SUBORDINATORS:
            continue
        j = i + 1
        while j < len(tokens) and tokens[j].word in _DETERMINERS:
            j += 1
        if j < len(tokens) and tokens[j].word not in STOP_WORDS and tokens[j].word not in FILLER_WORDS:
            word = tokens[j].word
            found.append((token.word, UNITS[word] if word in UNITS else canonical(stem(word))))
    return tuple(found)


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
        return UNITS[word] if word in UNITS else canonical(stem(word))
    return ""
