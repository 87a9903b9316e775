"""Roles: whether two prompts name the same things in exchanged roles ("X to Y" / "Y into X", "does X affect Y" /
"what effect does Y have on X", "did A beat B" / "did B win against A"), read from their profiles' content
words in order, with relation markers and "and"/"or" kept as tags (profiles.py makes the profiles).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from plugins.semantic_cache import lexicon
from plugins.semantic_cache.profiles import canonical, stem
from plugins.semantic_cache.vocabulary import COORDINATOR_TAG

if TYPE_CHECKING:
    from plugins.semantic_cache.profiles import Profile

Arguments = tuple[tuple[str, ...], tuple[str, ...]]


def _arguments(content: tuple[str, ...], clauses: tuple[int, ...], window: int = 4) -> dict[str, list[Arguments]]:
    """For each relation marker, per occurrence: the content words before it and after it, nearest first, up to
    the next marker or the clause's end: the two things the relation joins ("New York" <to> "Los Angeles")."""
    found: dict[str, list[Arguments]] = {}
    for i, word in enumerate(content):
        if word[0] != "<" or word == COORDINATOR_TAG:
            continue
        sides: list[list[str]] = [[], []]
        for side, step in ((0, -1), (1, 1)):
            j = i + step
            while 0 <= j < len(content) and clauses[j] == clauses[i] and len(sides[side]) < window:
                if content[j][0] != "<":  # other markers are passed over: "better for health than X"
                    sides[side].append(content[j])
                elif content[j] == word:
                    break  # up to the next occurrence of the same marker
                j += step
        found.setdefault(word, []).append((tuple(sides[0]), tuple(sides[1])))
    return found


def _crossed(
    left_a: tuple[str, ...], right_a: tuple[str, ...], left_b: tuple[str, ...], right_b: tuple[str, ...]
) -> bool:
    """Whether a word of each side went to the other side; adjectives move freely ("the best way to learn" /
    "which way of learning ... is the best") and do not count."""
    went_right = {w for w in (set(left_a) & set(right_b)) - set(left_b) - set(right_a) if not _adjective(w)}
    went_left = {w for w in (set(right_a) & set(left_b)) - set(right_b) - set(left_a) if not _adjective(w)}
    return bool(went_right and went_left)


def marker_swapped(a: Profile, b: Profile) -> bool:
    """Whether the things on the two sides of a shared relation marker changed sides ("X to Y" / "Y into X").

    A side runs to the clause's end or the next occurrence of the same marker, passing over other markers
    ("better for your health than X"), at most four content words, nearest first."""
    args_b = _arguments(b.content, b.clauses)
    for marker, occurrences in _arguments(a.content, a.clauses).items():
        others = args_b.get(marker)
        if not others:
            continue
        for left_a, right_a in occurrences:
            if not left_a or not right_a:
                continue
            if any(_crossed(left_a, right_a, left_b, right_b) for left_b, right_b in others):
                return True
    return False


def _side(content: tuple[str, ...], clauses: tuple[int, ...], i: int, step: int, window: int) -> list[str]:
    """The content words next to a marker on one side, up to another marker or tag or the clause's end."""
    found: list[str] = []
    j = i + step
    while 0 <= j < len(content) and clauses[j] == clauses[i] and content[j][0] != "<" and len(found) < window:
        if not _adjective(content[j]):
            found.append(content[j])
        j += step
    return found


# Verbs of exchange, as written (some are stop words, absent from the content).
_TRADE_VERBS = frozenset(
    ["get", "gets", "got", "buy", "buys", "sell", "sells", "trade", "swap", "exchange", "pay", "receive"]
)


def _traded(a: Profile) -> bool:
    """Whether a "for" may say what is given in exchange: the prompt has a verb of exchange ("get X for Y")."""
    return bool(_TRADE_VERBS & a.words)


def _ends(a: Profile) -> tuple[set[str], set[str]]:
    """What a prompt names as the source and as the target of a movement or a change: the words after "from" and
    after "to" ("into", "towards"); with only one of the two in a clause, the words before it are the other end
    ("convert X to Y": X the source; "get Y from X": Y the target)."""
    sources: set[str] = set()
    targets: set[str] = set()
    for i, w in enumerate(a.content):
        if w == "<for>" and _traded(a):
            w = "<from>"  # "how many yen do I get for my pounds": what is given for the other is its source
        if w not in ("<from>", "<to>"):
            continue
        here, there = (sources, targets) if w == "<from>" else (targets, sources)
        here.update(_side(a.content, a.clauses, i, 1, 3))
        other = "<to>" if w == "<from>" else "<from>"
        if not any(m == other and c == a.clauses[i] for m, c in zip(a.content, a.clauses, strict=True)):
            there.update(_side(a.content, a.clauses, i, -1, 2))
    return sources - targets, targets - sources


def ends_crossed(a: Profile, b: Profile) -> bool:
    """Whether the source of one is the target of the other and the other way round, whichever words say so:
    "from Tokyo to Sydney" / "to Tokyo from Sydney", "Celsius to Fahrenheit" / "Celsius from Fahrenheit"."""
    if "<from>" not in a.content and "<from>" not in b.content:
        return False  # "X to Y" against "Y to X" is the relation sides' rule
    sources_a, targets_a = _ends(a)
    sources_b, targets_b = _ends(b)
    return bool(sources_a & targets_b) and bool(targets_a & sources_b)


def _positions(content: tuple[str, ...]) -> dict[str, int]:
    """The position of each content word that occurs once (markers and repeated words left out)."""
    seen: dict[str, int] = {}
    repeated: set[str] = set()
    for i, w in enumerate(content):
        if w[0] == "<":
            continue
        if w in seen:
            repeated.add(w)
        seen[w] = i
    return {w: i for w, i in seen.items() if w not in repeated}


def _between(content: tuple[str, ...], i: int, j: int) -> list[str]:
    return list(content[min(i, j) + 1 : max(i, j)])


def roles_swapped(a: Profile, b: Profile) -> bool:
    """Whether two things trade places around the same relation, whatever word says it.

    - Around a verb or other word left in place: "Does caffeine cause sleep?" / "Can sleep lead to caffeine?"
      (the same content words, "cause" = "lead", stand between them on both sides).
    - Named things (capitalised, acronyms) in the other order, with a word between them on both sides and no
      "and", "or" or "vs": "Did France beat Argentina?" / "Did Argentina win against France?".
    - Two kinds of one thing in the other order: "brown rice instead of white rice" / "white rice for brown
      rice" (the same word after each)."""
    if _blocks_exchanged(a.text.split(), b.text.split()):
        return True
    x, y = a.subject, b.subject
    if x and y and x != y and x in b.content and y in a.content and a.passive == b.passive:
        return True  # the subject of one is the object of the other
    if a.passive == b.passive and _clause_subjects_swapped(a, b):
        return True
    if a.passive != b.passive and (_agent_kept_after(a, b) or _agent_kept_after(b, a)):
        return True
    if not a.passive and not b.passive and (_pronoun_cases_swapped(a, b) or _pronoun_cases_swapped(b, a)):
        return True
    pos_a, pos_b = _positions(a.content), _positions(b.content)
    shared = [w for w in pos_a if w in pos_b]
    named = a.entities | b.entities
    shared = [w for w in shared if not _adjective(w)]
    for u, v, words_a, words_b in _crossings(a, b, pos_a, pos_b, shared):
        if a.passive == b.passive and _one_relation(words_a, words_b):
            return True  # "can X replace Y" / "is Y a good replacement for X"; "Y be replaced by X" is not
        if a.passive == b.passive and u in named and v in named and words_a - named and words_b - named:
            return True  # not "In Python, ... to JSON" / "... to JSON in Python": nothing between there
    return _heads_swapped(a, b) or _arguments_swapped(a, b, pos_a, pos_b)


def _crossings(
    a: Profile, b: Profile, pos_a: dict[str, int], pos_b: dict[str, int], shared: list[str]
) -> Iterator[tuple[str, str, set[str], set[str]]]:
    """Pairs of shared things (in a's order) in the other order on the two sides, near each other on both and not
    joined by "and", "or", "vs": each with the content words between them on each side."""
    for n, u in enumerate(shared):
        for v in shared[n + 1 :]:
            if pos_a[v] - pos_a[u] > _NEAR:
                break  # two things a relation joins stand near each other; this bounds the pairs' cost
            if (pos_a[u] < pos_a[v]) == (pos_b[u] < pos_b[v]) or abs(pos_b[u] - pos_b[v]) > _NEAR:
                continue  # the same order, or too far apart
            between_a = _between(a.content, pos_a[u], pos_a[v])
            between_b = _between(b.content, pos_b[u], pos_b[v])
            if COORDINATOR_TAG in between_a or COORDINATOR_TAG in between_b:
                continue
            yield u, v, {w for w in between_a if w[0] != "<"}, {w for w in between_b if w[0] != "<"}


def _arguments_swapped(a: Profile, b: Profile, pos_a: dict[str, int], pos_b: dict[str, int]) -> bool:
    """Two things that are a verb's arguments on both sides (determined noun phrases no preposition governs), in
    the other order with words between them on both sides, whatever those words are: "What does the tenant owe
    the landlord?" / "What is the landlord liable to pay the tenant?". A phrase moved with its preposition ("For
    dry skin, what moisturizer ..." / "What moisturizer ... for dry skin?") or a passive is not."""
    if a.passive != b.passive:
        return False
    # Agent nouns made of a verb of the antonym list ("buyer") are things; adjectives and superlatives are not.
    bare_a, bare_b = dict(a.bare), dict(b.bare)
    shared = [w for w in pos_a if w in pos_b and w in bare_a and w in bare_b and not _quality(w)]
    for u, v, words_a, words_b in _crossings(a, b, pos_a, pos_b, shared):
        if bare_a[u] == bare_a[v] and bare_b[u] == bare_b[v] and words_a and words_b:
            return True  # not in different clauses: "If the landlord sells, can the tenant stay?"
    return False


# Words that join two things without ranking them, as written in a prompt's normal text ("&" is dropped there).
_SYMMETRIC = frozenset(["and", "or", "vs", "versus", "nor"])
_MAX_EXCHANGED = 40  # words that differ between two prompts, at most, for two runs exchanged to be looked for


def _blocks_exchanged(words_a: list[str], words_b: list[str]) -> bool:
    """One prompt is the other, word for word, with two runs of words exchanged around a middle left in place:
    "replace butter with olive oil in baking" / "replace olive oil with butter in baking", whatever the middle
    says ("with", "to", "more than", "at the expense of"). A middle that only joins ("X and Y") is not a role."""
    if len(words_a) != len(words_b) or words_a == words_b or sorted(words_a) != sorted(words_b):
        return False
    start = 0
    while words_a[start] == words_b[start]:
        start += 1
    end = len(words_a)
    while words_a[end - 1] == words_b[end - 1]:
        end -= 1
    a, b = words_a[start:end], words_b[start:end]
    n = len(a)
    if n > _MAX_EXCHANGED:
        return False  # a request is a sentence or two; past that the runs are no roles, and the search is quadratic
    for i in range(1, n - 1):  # X = a[:i] must end b
        if a[:i] != b[n - i :]:
            continue
        for j in range(1, n - i):  # Y = a[n - j:] must start b, the middle between them in place
            if a[n - j :] == b[:j] and a[i : n - j] == b[j : n - i] and not set(a[i : n - j]) <= _SYMMETRIC:
                return True
    return False


def _agent_kept_after(passive: Profile, active: Profile) -> bool:
    """A passive that keeps the active's order: "Did Beethoven influence Wagner?" / "Was Beethoven influenced by
    Wagner?" (the agent, Wagner, the one who acts in the passive, is acted on in the active). The passive of the
    same question has the other order: "Was Wagner influenced by Beethoven?"."""
    if not passive.passive or active.passive:
        return False
    g = passive.agent
    pos_p, pos_a = _positions(passive.content), _positions(active.content)
    if g not in pos_p or g not in pos_a:
        return False
    for u, i in pos_p.items():
        if u == g or u not in pos_a or _adjective(u) or i > pos_p[g] or pos_a[u] > pos_a[g]:
            continue
        if _between(passive.content, i, pos_p[g]) and _between(active.content, pos_a[u], pos_a[g]):
            return True  # u before the agent on both sides, a verb between
    return False


# A personal pronoun's object form and its subject form: "owes me" / "I owe".
_SUBJECT_OF = {"me": "i", "us": "we", "him": "he", "her": "she", "them": "they"}


def _pronoun_cases_swapped(a: Profile, b: Profile) -> bool:
    """One person the object of a verb on one side ("My roommate owes me") and its subject on the other ("I owe my
    roommate"), a thing on the other side of that verb each time: the two trade roles."""
    words_a, words_b = a.text.split(), b.text.split()
    pos_a, pos_b = _positions(a.content), _positions(b.content)
    for k in range(len(words_a) - 1):
        subject = _SUBJECT_OF.get(words_a[k + 1])
        verb = canonical(stem(words_a[k]))
        if subject is None or verb not in pos_a or verb not in pos_b:
            continue
        # the subject's side: the same verb right after the subject form, or with one word between ("I still owe")
        m = next((m for m in range(len(words_b)) if canonical(stem(words_b[m])) == verb), -1)
        if m < 1 or subject not in words_b[max(0, m - 2) : m]:
            continue
        for thing in pos_a:
            if thing != verb and thing in pos_b and pos_a[thing] < pos_a[verb] and pos_b[thing] > pos_b[verb]:
                return True
    return False


def _clause_subjects_swapped(a: Profile, b: Profile) -> bool:
    """The clause one conjunction opens has another subject on each side, each named on the other side: "...
    when Liverpool played at home?" / "When Chelsea hosted Liverpool, ...?"."""
    subjects_b = dict(b.clause_subjects)
    for conjunction, x in a.clause_subjects:
        y = subjects_b.get(conjunction)
        if y and x != y and x in b.content and y in a.content:
            return True
    return False


def _quality(w: str) -> bool:
    """An adjective in its base form or a superlative: it moves freely and bears no role."""
    return lexicon.LEMMA.get(w) == w or (w.endswith("est") and len(w) > 5)


# Content words between two things for them to be read as the two sides of one relation, at most: a sentence's
# worth. It also bounds the cost of the pairs of things on long prompts (each pair reads what is between).
_NEAR = 12


# Endings that make a noun or an adjective of a verb: "replace" / "replacement", "infect" / "infection".
_DERIVATIONS = ("ment", "ments", "ement", "ion", "ions", "ation", "ition", "al", "ance", "ence", "er", "ers", "or")


def _derived(x: str, y: str) -> bool:
    """Whether two content stems are one word and its derivation ("replac" / "replacement", "pay" / "payment")."""
    if x == y:
        return True
    short, long = (x, y) if len(x) < len(y) else (y, x)
    return len(short) >= 3 and long.startswith(short) and long[len(short) :] in _DERIVATIONS


def _one_relation(words_a: set[str], words_b: set[str]) -> bool:
    """Whether the words between two things say one relation on both sides: the same words, or a verb on one
    side and its noun on the other ("replace" / "a good replacement for"), a few words at most (past that, the
    two things are in different phrases)."""
    if not words_a or not words_b or len(words_a) > 3 or len(words_b) > 3:
        return False
    if words_a == words_b:
        return len(words_a) <= 2
    return any(x != y and _derived(x, y) for x in words_a for y in words_b)


def _adjective(w: str) -> bool:
    """A known adjective or a superlative: it moves freely ("the safest car brand" / "which car brand is the
    safest") and bears no role."""
    return w in lexicon.LEMMA or (w.endswith("est") and len(w) > 5)


def _heads_swapped(a: Profile, b: Profile) -> bool:
    """ "u h ... v h" in one and "v h ... u h" in the other: two kinds of one thing swapped."""

    def kinds(content: tuple[str, ...]) -> list[tuple[str, str, int]]:
        return [(content[i], content[i + 1], i) for i in range(len(content) - 1) if content[i][0] != "<"]

    in_b = {(u, h): i for u, h, i in kinds(b.content)}
    found = [k for k in kinds(a.content) if k[:2] in in_b]  # in a's order
    for n, (u, h, i) in enumerate(found):
        for v, h2, j in found[n + 1 :]:
            if j - i > _NEAR:
                break
            if h2 == h and v != u and in_b[(v, h)] < in_b[(u, h)] and COORDINATOR_TAG not in a.content[i:j]:
                return True
    return False
