"""Word knowledge for the guards that is English, not any pair set: antonyms with their inflections, negating
prefixes, length and scope instructions, common synonyms, chat shorthand and typo tolerance.

The lists are general (the commonest antonym and synonym pairs of everyday English, as a thesaurus gives them),
written without looking at the pairs they are measured on; the rules around them (inflections, affixes,
one-letter typos) follow from the language, so that a word never listed still behaves like its listed forms.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from functools import lru_cache


def _words(text: str) -> list[str]:
    return text.split()


# -- antonyms: base forms; comparatives and superlatives follow by rule ("rich" / "poor" -> "richest" / "poorest")
_ANTONYMS = _words("""good/bad cheap/expensive cheap/costly easy/difficult easy/hard safe/dangerous safe/unsafe
rich/poor young/old new/old large/small big/small big/little great/small tall/short long/short high/low hot/cold
warm/cold wet/dry heavy/light deep/shallow thick/thin wide/narrow strong/weak fast/slow quick/slow early/late happy/sad
loud/quiet full/empty common/rare popular/unpopular clean/dirty light/dark soft/hard sweet/bitter simple/complex
simple/complicated near/far close/far open/closed public/private internal/external urban/rural modern/ancient
natural/artificial healthy/unhealthy fresh/stale raw/cooked alive/dead male/female smooth/rough tight/loose
sharp/dull bright/dim polite/rude true/false correct/wrong right/wrong legal/illegal possible/impossible
success/failure succeed/fail strength/weakness advantage/disadvantage benefit/drawback benefit/risk pro/con
profit/loss win/lose gain/lose love/hate like/dislike friend/enemy ally/enemy buy/sell lend/borrow give/take
increase/decrease increase/reduce rise/fall grow/shrink expand/contract appear/disappear arrive/depart
accept/reject accept/refuse allow/forbid allow/prevent include/exclude add/remove add/subtract attack/defend
import/export enter/exit push/pull open/close start/stop start/finish begin/end first/last top/bottom
front/back inside/outside above/below over/under before/after up/down left/right north/south east/west
maximum/minimum max/min most/least more/less many/few best/worst better/worse highest/lowest
beginner/advanced beginner/expert amateur/professional cause/prevent cause/cure encrypt/decrypt
encode/decode compress/decompress upload/download send/receive ascending/descending positive/negative
optimist/pessimist optimistic/pessimistic dominant/recessive acid/base acidic/alkaline summer/winter
day/night morning/evening sunrise/sunset""")
# Comparatives and superlatives that no rule makes.
_IRREGULAR = {"better": "good", "best": "good", "worse": "bad", "worst": "bad", "less": "little", "least": "little"}


def _degrees(adjective: str) -> set[str]:
    """The adjective, its comparative and its superlative by the spelling rules (big -> bigger, biggest)."""
    forms = {adjective}
    if len(adjective) < 3 or not adjective.isalpha():
        return forms
    if adjective.endswith("y") and adjective[-2] not in "aeiou":
        stem = adjective[:-1] + "i"
    elif adjective.endswith("e"):
        stem = adjective[:-1]
    elif (
        len(adjective) <= 4
        and adjective[-1] not in "aeiouwxy"
        and adjective[-2] in "aeiou"
        and adjective[-3] not in "aeiou"
    ):
        stem = adjective + adjective[-1]  # big -> bigg-er
    else:
        stem = adjective
    forms |= {stem + "er", stem + "est"}
    return forms


def _lemma_table() -> tuple[dict[str, str], dict[str, frozenset[str]]]:
    lemma: dict[str, str] = {}
    opposite: dict[str, set[str]] = {}
    for pair in _ANTONYMS:
        one, other = pair.split("/")
        for word in (one, other):
            for form in _degrees(word):
                lemma.setdefault(form, word)
        opposite.setdefault(one, set()).add(other)
        opposite.setdefault(other, set()).add(one)
    lemma.update(_IRREGULAR)
    return lemma, {w: frozenset(o) for w, o in opposite.items()}


LEMMA, OPPOSITE = _lemma_table()


# Adverbs in -ly whose sense left their adjective's: "hardly" is not "hard", "shortly" not "short".
_ADVERBS_OF_OTHER_SENSE = frozenset(_words("hardly nearly shortly lately barely fairly highly justly"))


def lemma(word: str) -> str:
    """The base form of an adjective or word of the antonym list ("poorest" -> "poor", "weaknesses" ->
    "weakness"), else the word."""
    if word in LEMMA:
        return LEMMA[word]
    if word.endswith("ly") and word not in _ADVERBS_OF_OTHER_SENSE:  # "quietly" / "louder": the same scale
        base = word[:-3] + "y" if word.endswith("ily") else word[:-2]
        if base in LEMMA:
            return LEMMA[base]
    for plural in ("es", "s"):
        if word.endswith(plural) and word[: -len(plural)] in LEMMA:
            return LEMMA[word[: -len(plural)]]
    return word


def opposed(only_a: AbstractSet[str], only_b: AbstractSet[str]) -> bool:
    """Whether a word on one side only has its opposite on the other side only (degrees folded: "cheapest" /
    "most expensive", "largest" / "smallest")."""
    lemmas_b = {lemma(w) for w in only_b}
    return any(OPPOSITE.get(lemma(w), frozenset()) & lemmas_b for w in only_a)


# -- negation by a prefix: "unhealthy", "non-toxic", "illegal", "dishonest", "irregular", "impossible"
NEGATING_PREFIXES = ("non", "un", "in", "im", "il", "ir", "dis", "anti")


def affix_negated(only_a: AbstractSet[str], words_b: AbstractSet[str]) -> bool:
    """Whether a word of one side is a word of the other with a negating prefix ("unsafe" / "safe")."""
    for w in only_a:
        for prefix in NEGATING_PREFIXES:
            rest = w[len(prefix) :]
            if w.startswith(prefix) and len(rest) >= 4 and rest in words_b:
                return True
    return False


# -- length, depth and format instructions: a request with one asks for another answer than one without
_INSTRUCTIONS = {
    "brief": r"briefly|brief|concise(?:ly)?|keep it short|short (?:answer|version|summary|explanation)|in short"
    r"|succinct(?:ly)?|quick summary|tl;?dr"
    r"|(?:in|to|within|into|using|under) (?:a|one|1|two|2|three|3|few|a few|a couple of|\d+)(?: single| short| brief)?"
    r" (?:words?|sentences?|lines?)"
    r"|one[- ]liner|the gist|at a high level"
    r"|(?:under|fewer than|less than|at most|max(?:imum)?) \w+ words|in a nutshell"
    r"|(?:write|draft|compose|give|tell|make|create)(?: me| us)? an? (?:very |really )?(?:short|brief|shorter)",
    "detail": r"in (?:great |full |more |much )?detail|detailed|thorough(?:ly)?|in depth|in-depth|at length"
    r"|comprehensive(?:ly)?|elaborate|exhaustive(?:ly)?|long answer|full explanation|everything about"
    r"|(?:write|draft|compose|give|tell|make|create)(?: me| us)? an? (?:very |really )?(?:long|lengthy|longer)",
    "steps": r"step[- ]by[- ]step|walk me through|(?P<unit>[a-z]+) by (?P=unit)",  # "chapter by chapter"
    "examples": r"with (?:an |some |a few )?examples?",
    "simple": r"like i'?m (?:five|5|a child|a kid)|eli5|simple terms|for (?:a )?(?:beginners?|kids?|children)"
    r"|layman'?s? terms|plain (?:english|language)",
    "answer_only": r"(?:just|only) (?:the|give|tell|say|a|an)|short answer|no explanation|without (?:any )?explanation"
    r"|nothing else|one word answer|yes or no",
    "explained": r"(?:with|and) (?:an |a full |the )?(?:explanation|reasoning|proof|working)|show (?:your|the) work"
    r"|explain why|and why",
    "format": r"bullet(?:ed)? (?:points?|list)|bullets|numbered list|in a table|as a table|as a list"
    r"|(?:in|to|within|into|as) (?:a|one|single|two|three|\d+) (?:short |brief |single )?paragraphs?"
    r"|in json|as json|in markdown|an essay|a poem|a haiku|a tweet|a limerick"
    r"|as an? (?:outline|checklist|story|song|letter|email|script|dialogue|faq)",
    # A further task joined to the request ("... and explain the grammar"), or a sentence after it that shapes the
    # answer ("... ? Include the equation."): the answer to the request alone does not carry it.
    "added": r"(?:and|then|also|plus) (?:also |then )?(?:explain|describe|list|include|give|compare|summari[sz]e"
    r"|define|discuss|mention|suggest|recommend|tell me|show me)"
    r"|[.?!] (?:please )?(?:include|keep it|answer|limit|focus|avoid|respond|reply|format|cite|add|use only|use no)",
}
# The form a format instruction asks for, by the first of its words found here: a table is not a list, nor a haiku
# a poem of any kind, so "format" is compared with its form.
FORMS = {"bullet": "bullets", "bullets": "bullets", "bulleted": "bullets", "numbered": "numbered", "table": "table",
         "list": "list", "paragraph": "paragraph", "paragraphs": "paragraph", "json": "json", "markdown": "markdown",
         "essay": "essay", "poem": "poem", "haiku": "haiku", "tweet": "tweet", "limerick": "limerick",
         "outline": "outline", "checklist": "checklist", "story": "story", "song": "song", "letter": "letter",
         "email": "email", "script": "script", "dialogue": "dialogue", "faq": "faq"}  # fmt: skip
_INSTRUCTION = re.compile("|".join(f"(?P<{k}>\\b(?:{v})\\b)" for k, v in _INSTRUCTIONS.items()))


def instructions(lower_text: str) -> frozenset[str]:
    """The kinds of length, depth or format instruction a lower-cased prompt holds (a format with its form)."""
    found = set()
    for m in _INSTRUCTION.finditer(lower_text):
        kind = m.lastgroup
        if kind == "format":
            kind += ":" + next((FORMS[w] for w in m.group().split() if w in FORMS), "")
        if kind:
            found.add(kind)
    return frozenset(found)


def without_instructions(text: str, kept: Callable[[str], bool]) -> str:
    """The prompt with its length, depth and format instructions taken out but for the words `kept` keeps (the
    numbers: "in 3 sentences" / "in 5 sentences" differ): their other words ("a single sentence", "only") are
    the instruction rule's to compare, not the scope or the substitution rule's."""
    spans = [m.span() for m in _INSTRUCTION.finditer(text.lower())]
    for start, end in reversed(spans):
        numbers = " ".join(w for w in text[start:end].split() if kept(w.lower()))
        text = f"{text[:start]} {numbers} {text[end:]}"
    return text


# -- synonyms: one canonical word a group, compared after stemming
_SYNONYMS = _words("""big=large huge=enormous small=little=tiny fast=quick=rapid expensive=costly=pricey=pricy
cheap=inexpensive method=way=technique=approach kid=child=children buy=purchase begin=start end=finish help=assist
use=utilize=utilise need=require cause=lead affect=effect=impact=influence show=display car=automobile photo=picture
movie=film error=mistake fix=repair often=frequently shop=store doctor=physician sick=ill answer=reply=response
issue=problem pick=choose=select obtain=get job=occupation trip=journey home=house sofa=couch
smart=intelligent=clever begin=commence stop=quit talk=speak correct=right maybe=perhaps enough=sufficient
allow=permit=let try=attempt hard=difficult simple=easy""")


def _synonym_table() -> dict[str, str]:
    table: dict[str, str] = {}
    for group in _SYNONYMS:
        words = group.split("=")
        for w in words:
            table.setdefault(w, words[0])
    return table


SYNONYM = _synonym_table()
# Verbs that frame a request rather than say what it is about: "convert X" / "change X", "list X" / "name X".
REQUEST_VERBS = frozenset(
    _words("""convert change switch turn list name give suggest recommend find write draft compose explain describe
    summarize summarise outline clarify define tell show provide share offer teach walk""")
)

# -- chat shorthand, spelled out before the words are read: "u" is "you", "w/o" is "without"
_SHORTHAND = {
    "u": "you",
    "ur": "your",
    "r": "are",
    "pls": "please",
    "plz": "please",
    "thx": "thanks",
    "whats": "what is",
    "hows": "how is",
    "wheres": "where is",
    "whos": "who is",
    "ppl": "people",
    "bc": "because",
    "cuz": "because",
    "abt": "about",
    "smth": "something",
    "rly": "really",
    "tmrw": "tomorrow",
    "tmr": "tomorrow",
    "msg": "message",
    "info": "information",
    "dont": "do not",
    "doesnt": "does not",
    "cant": "cannot",
    "wont": "will not",
    "isnt": "is not",
    "im": "i am",
    "ive": "i have",
    "b4": "before",
    "2day": "today",
    "w/o": "without",
    "w/": "with",
}
# "how 2 tune", "what 2 wear": a "2" between a word that takes an infinitive and a word is "to".
_TWO_AS_TO = re.compile(
    r"\b(how|what|where|when|who|which|want|need|going|have|has|got|able|ought|used|try) 2 (?=[a-z])", re.IGNORECASE
)
_SHORT = re.compile(r"(?<![\w/])(w/o|w/|[a-z0-9]+)(?![\w/'])", re.IGNORECASE)


def spell_out(text: str) -> str:
    """The prompt with chat shorthand spelled out ("can u help w/o a car" -> "can you help without a car")."""
    text = _TWO_AS_TO.sub(r"\1 to ", text)
    if not _SHORT.search(text):
        return text

    def one(m: re.Match[str]) -> str:
        word = m.group(1)
        full = _SHORTHAND.get(word.lower())
        return full if full is not None and (word.islower() or word.lower() in ("w/", "w/o")) else word

    return _SHORT.sub(one, text)


@lru_cache(maxsize=16384)
def typo_of(a: str, b: str) -> bool:
    """Whether two words of five letters or more differ by one letter dropped, added or two letters swapped
    ("trian" / "train", "chage" / "change"): a slip of the keyboard, not another word."""
    if a == b or min(len(a), len(b)) < 4 or max(len(a), len(b)) < 5 or a[0] != b[0]:
        return False
    if len(a) == len(b):
        diff = [i for i in range(len(a)) if a[i] != b[i]]
        return len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]]
    if abs(len(a) - len(b)) != 1:
        return False
    short, long = (a, b) if len(a) < len(b) else (b, a)
    i = 0
    while i < len(short) and short[i] == long[i]:
        i += 1
    return short[i:] == long[i + 1 :]
