"""Write the semantic cache's transformed pair sets: look-alikes made by rule from paraphrase pairs, not by hand.

`python -m tools.semantic_pairs` rewrites plugins/semantic_cache/pairs/transformed.jsonl (tuning) and
transformed-holdout.jsonl (frozen) from the seeds below, deterministically (same seeds, same files).

Every seed is a paraphrase pair (a, b) written as a template. Should-hit pairs are the paraphrase itself and
three rule-made variants of b that keep its meaning: a typo, lower-case chat shorthand, a synonym. Must-not
pairs keep a and transform b by one rule that changes the answer:

- swap: the two arguments of a relation exchanged ("X to Y" / "Y into X", "A beat B" / "B beat A"), names of one
  or more words, relations written with any word;
- scope: a length, depth or extent instruction added to b, or opposite ones on the two sides;
- affix: a word of b negated by a prefix ("healthy" / "unhealthy", "alcoholic" / "non-alcoholic");
- negation: "not" put after b's first auxiliary verb ("are safe" / "are not safe");
- antonym: a word of b replaced by its opposite, superlatives and comparatives included;
- quantity: a unit or a quantity word of b replaced by another ("a cup" / "a tablespoon", "a few" / "a dozen").

A seed goes to the holdout when the first byte of sha256(its template a) is below 86 (about a third): whole
templates are held out, not pairs of a template otherwise seen. The word lists here (antonyms, affixes,
synonyms) were written for this generator independently of the guards' lexicon (plugins/semantic_cache/lexicon.py).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "plugins" / "semantic_cache" / "pairs"
SEED = 20261203

# -- swap: (template a, paraphrase b, the kind of argument); {x} and {y} are the two arguments
RELATIONS = [
    ("Convert {x} to {y}", "How do I change {x} into {y}?", "currency"),
    ("What is the exchange rate from {x} to {y}?", "How much {y} do I get for my {x}?", "currency"),
    ("Translate this paragraph from {x} into {y}", "Can you put this paragraph, written in {x}, into {y}?", "lang"),
    ("How do I say good morning in {y} if I speak {x}?", "As a {x} speaker, how do I say good morning in {y}?", "lang"),
    ("What's the fastest way to get from {x} to {y} by train?", "How do I travel by train from {x} to {y}?", "city"),
    ("How long is the flight from {x} to {y}?", "How many hours does it take to fly from {x} to {y}?", "city"),
    ("Is {x} bigger than {y}?", "Is {x} larger in size than {y}?", "city"),
    ("Why is {x} more expensive to live in than {y}?", "What makes {x} pricier to live in than {y}?", "city"),
    ("How do I migrate my data from {x} to {y}?", "What are the steps to move my data from {x} over to {y}?", "app"),
    ("Can I import a file from {x} into {y}?", "Is it possible to bring a {x} file into {y}?", "app"),
    ("Did {x} beat {y} in the final?", "Did {x} win against {y} in the final?", "team"),
    ("Why did {x} lose to {y} last season?", "What made {x} lose against {y} last season?", "team"),
    ("Is {x} healthier than {y}?", "Is {x} better for your health than {y}?", "food"),
    ("Can I use {x} instead of {y} in a cake?", "Can I substitute {x} for {y} when baking a cake?", "food"),
    ("How does {x} affect {y}?", "What effect does {x} have on {y}?", "cause"),
    ("Does {x} cause {y}?", "Can {x} lead to {y}?", "cause"),
    (
        "Write an email from {x} to {y} asking to reschedule a meeting",
        "Draft a message {x} sends {y} to move a meeting",
        "role",
    ),
    (
        "What should {x} say to {y} in a first meeting?",
        "What's a good thing for {x} to tell {y} when they first meet?",
        "role",
    ),
    ("How many {x} are in a {y}?", "How many {x} make up one {y}?", "unit"),
    ("Is {x} a kind of {y}?", "Would {x} count as a type of {y}?", "category"),
]
ARGUMENTS = {
    "currency": [("US dollars", "euros"), ("British pounds", "Japanese yen"), ("Swiss francs", "Canadian dollars")],
    "lang": [("English", "Spanish"), ("Brazilian Portuguese", "Italian"), ("Simplified Chinese", "Korean")],
    "city": [("New York", "Los Angeles"), ("London", "Paris"), ("San Francisco", "Mexico City")],
    "app": [("Google Drive", "Microsoft OneDrive"), ("Excel", "Google Sheets"), ("MySQL", "PostgreSQL")],
    "team": [("Real Madrid", "Manchester City"), ("the Lakers", "the Boston Celtics"), ("France", "Argentina")],
    "food": [("brown rice", "white rice"), ("butter", "olive oil"), ("honey", "white sugar")],
    "cause": [("caffeine", "sleep"), ("inflation", "interest rates"), ("stress", "blood pressure")],
    "role": [("a tenant", "their landlord"), ("an employee", "their manager"), ("a student", "a professor")],
    "unit": [("cups", "gallon"), ("ounces", "pound"), ("teaspoons", "tablespoon")],
    "category": [("a tomato", "fruit"), ("a spider", "insect"), ("a mushroom", "plant")],
}

# -- seeds for the other rules: plain paraphrase pairs
REQUESTS = [
    ("Explain how vaccines work", "How do vaccines work?"),
    ("Summarize the plot of Hamlet", "What happens in Hamlet?"),
    ("Describe the causes of the French Revolution", "What caused the French Revolution?"),
    ("How does compound interest work?", "Explain compound interest to me"),
    ("What is a black hole?", "Tell me what a black hole is"),
    ("How do I write a cover letter?", "What's the way to write a cover letter?"),
    ("Explain what a REST API is", "What is a REST API?"),
    ("What is photosynthesis?", "Explain photosynthesis"),
    ("How does a mortgage work?", "Explain how mortgages work"),
    ("What is the difference between a virus and a bacterium?", "How do viruses and bacteria differ?"),
    ("How do I change a flat tire?", "What are the steps to change a flat tyre?"),
    ("What does a product manager do?", "Describe the job of a product manager"),
]
SCOPES = [
    "in one sentence",
    "in detail",
    "step by step",
    "in three bullet points",
    "in under 50 words",
    "briefly",
    "like I'm five",
    "with examples",
    "in a single paragraph",
    "and only give me the short answer",
    "with a full explanation",
    "in depth",
]
OPPOSITE_SCOPES = [("in one line", "in great detail"), ("briefly", "thoroughly"), ("in a few words", "at length")]

AFFIXED = [  # (template a with {w}, paraphrase b with {w}); the words of AFFIX_WORDS fill {w}
    ("What are some {w} snacks for kids?", "Can you suggest {w} snacks for children?"),
    ("Recommend a few {w} drinks for a party", "What {w} drinks should I serve at a party?"),
    ("Is this contract clause {w}?", "Would this clause in my contract be {w}?"),
    ("List {w} ways to lose weight", "What are {w} methods for losing weight?"),
    ("Which cleaning products are {w} for pets?", "What household cleaners are {w} for my pets?"),
    ("Why do some people find cats {w}?", "What makes cats seem {w} to some people?"),
    ("Is {w} almond milk good for baking?", "Can I bake with {w} almond milk?"),
    ("Give me examples of {w} verbs in English", "What are some English verbs that are {w}?"),
]
AFFIX_WORDS = [
    ("healthy", "unhealthy"),
    ("alcoholic", "non-alcoholic"),
    ("legal", "illegal"),
    ("effective", "ineffective"),
    ("toxic", "non-toxic"),
    ("friendly", "unfriendly"),
    ("sweetened", "unsweetened"),
    ("regular", "irregular"),
    ("safe", "unsafe"),
    ("honest", "dishonest"),
    ("responsible", "irresponsible"),
    ("possible", "impossible"),
    ("secure", "insecure"),
]
AFFIX_FIT = {  # which words make sense in which template (by index)
    0: ["healthy"],
    1: ["alcoholic"],
    2: ["legal"],
    3: ["effective", "healthy", "safe"],
    4: ["toxic", "safe"],
    5: ["friendly", "honest"],
    6: ["sweetened"],
    7: ["regular"],
}

NEGATABLE = [
    ("Which foods are safe for dogs to eat?", "What foods can dogs eat safely?"),
    ("Which countries use the euro?", "What countries have the euro as their currency?"),
    ("Should I tip at a restaurant in Japan?", "Is tipping expected at restaurants in Japan?"),
    ("Can I take ibuprofen with coffee?", "Is it okay to have coffee after taking ibuprofen?"),
    ("Which plants grow well in shade?", "What plants do well in the shade?"),
    ("Do cats need vaccines every year?", "Are yearly vaccines needed for cats?"),
    ("Which fruits are high in vitamin C?", "What fruits have a lot of vitamin C?"),
    ("Should I stretch before running?", "Is stretching before a run a good idea?"),
    ("Can you freeze cooked rice?", "Is it safe to freeze rice after cooking it?"),
    ("Which apps work offline?", "What apps can be used without internet?"),
]
AUXILIARIES = ("are", "is", "can", "should", "do", "does", "will", "have")

ANTONYMS = [
    ("largest", "smallest"),
    ("richest", "poorest"),
    ("oldest", "newest"),
    ("hottest", "coldest"),
    ("best", "worst"),
    ("cheapest", "most expensive"),
    ("safest", "most dangerous"),
    ("easiest", "hardest"),
    ("fastest", "slowest"),
    ("most popular", "least popular"),
    ("cheap", "expensive"),
    ("easy", "difficult"),
    ("strengths", "weaknesses"),
    ("benefits", "risks"),
    ("increase", "decrease"),
    ("long", "short"),
    ("wet", "dry"),
    ("heavy", "light"),
    ("deep", "shallow"),
    ("early", "late"),
]
SUPERLATIVES = [  # (template a, paraphrase b), {w} filled by an antonym pair's first word, then its second
    ("What is the {w} city in Europe?", "Which European city is the {w}?", ["largest", "richest", "oldest", "hottest"]),
    (
        "What's the {w} way to learn to code?",
        "Which way of learning to code is the {w}?",
        ["best", "cheapest", "easiest", "fastest"],
    ),
    ("Which car brand is the {w}?", "What is the {w} brand of car?", ["safest", "most popular", "cheapest"]),
    ("What are the {w} of remote work?", "What {w} does working remotely have?", ["strengths", "benefits"]),
    ("What makes house prices {w}?", "Why do house prices {w}?", ["increase"]),
    ("Is it {w} to learn Japanese?", "Is learning Japanese {w}?", ["easy", "cheap"]),
    ("What are good hikes with a {w} climb?", "Suggest hikes that have a {w} climb", ["long"]),
    (
        "How do I care for plants in {w} soil?",
        "What is the way to look after plants growing in {w} soil?",
        ["wet", "deep"],
    ),
    ("What should I pack for a {w} backpack trip?", "What goes in a {w} backpack for a trip?", ["heavy", "light"]),
    ("Is it bad to eat dinner {w}?", "Is eating dinner {w} unhealthy?", ["early", "late"]),
]

QUANTITIES = [  # (template a, paraphrase b, the quantity words that fill {q}: the first and a replacement)
    ("How many calories are in {q} of rice?", "What's the calorie count of {q} of rice?", ("a cup", "a tablespoon")),
    ("How much water should I drink per {q}?", "What amount of water do I need each {q}?", ("day", "hour")),
    ("Give me {q} ideas for a birthday party", "Suggest {q} birthday party ideas", ("a few", "a dozen")),
    ("How much does {q} of gold cost?", "What is the price of {q} of gold?", ("an ounce", "a kilogram")),
    ("How many steps should I walk in {q}?", "What number of steps should I take in {q}?", ("a day", "a week")),
    ("What can I cook with {q} eggs?", "What recipes use {q} eggs?", ("a couple of", "a dozen")),
    (
        "How fast can a cheetah run in miles per {q}?",
        "What is a cheetah's top speed in miles per {q}?",
        ("hour", "minute"),
    ),
    (
        "How much protein is in {q} of chicken breast?",
        "What is the protein content of {q} of chicken breast?",
        ("100 grams", "100 ounces"),
    ),
    ("List {q} tips for better sleep", "Give me {q} tips to sleep better", ("some", "a hundred")),
    ("How much should I save each {q}?", "How much money should I put aside every {q}?", ("month", "year")),
]

SYNONYMS = {
    "explain": "clarify",
    "describe": "outline",
    "suggest": "recommend",
    "big": "large",
    "bigger": "larger",
    "large": "big",
    "fast": "quick",
    "fastest": "quickest",
    "buy": "purchase",
    "help": "assist",
    "children": "kids",
    "kids": "children",
    "method": "technique",
    "methods": "techniques",
    "way": "method",
    "steps": "stages",
    "find": "locate",
    "start": "begin",
    "make": "create",
    "use": "utilize",
    "change": "switch",
    "move": "shift",
    "pricier": "more costly",
    "draft": "write",
    "idea": "notion",
    "ideas": "suggestions",
    "happen": "occur",
    "tell": "inform",
    "cost": "price",
    "get": "obtain",
    "needed": "required",
    "good": "decent",
    "unhealthy": "bad for you",
}
SHORTHAND = {
    "you": "u",
    "your": "ur",
    "are": "r",
    "please": "pls",
    "what is": "whats",
    "what's": "whats",
    "how do i": "how do i",
    "people": "ppl",
    "because": "bc",
    "with": "w/",
    "without": "w/o",
    "tomorrow": "tmrw",
    "about": "abt",
    "really": "rly",
    "something": "smth",
    "thanks": "thx",
}


def _held_out(template: str) -> bool:
    return hashlib.sha256(template.encode()).digest()[0] < 86


def _typo(text: str, rng: random.Random) -> str:
    """One typo in one word of five letters or more: two letters swapped, one dropped or one doubled."""
    words = text.split()
    long = [i for i, w in enumerate(words) if sum(c.isalpha() for c in w) >= 5 and w[0].islower()]
    if not long:
        return text
    i = rng.choice(long)
    w = words[i]
    j = rng.randrange(1, len([c for c in w if c.isalpha()]) - 2)
    how = rng.randrange(3)
    if how == 0:
        w = w[:j] + w[j + 1] + w[j] + w[j + 2 :]
    elif how == 1:
        w = w[:j] + w[j + 1 :]
    else:
        w = w[:j] + w[j] + w[j:]
    words[i] = w
    return " ".join(words)


def _shorthand(text: str) -> str:
    """Lower case, no final punctuation, chat abbreviations."""
    out = text.lower().rstrip("?.!")
    for long, short in SHORTHAND.items():
        out = " ".join(short if w == long else w for w in out.split()) if " " not in long else out.replace(long, short)
    return out


def _synonym(text: str) -> str | None:
    words = text.split()
    for i, w in enumerate(words):
        bare = w.strip("?,.!").lower()
        if bare in SYNONYMS:
            repl = SYNONYMS[bare]
            repl = repl.capitalize() if w[0].isupper() else repl
            words[i] = w.replace(w.strip("?,.!"), repl)
            return " ".join(words)
    return None


def _negate(text: str) -> str | None:
    words = text.split()
    for i, w in enumerate(words):
        if w.lower() == "have" and i > 0:  # "fruits have" -> "fruits do not have"
            return " ".join([*words[:i], "do not", *words[i:]])
        if w.lower() in AUXILIARIES and i > 0:
            return " ".join([*words[: i + 1], "not", *words[i + 1 :]])
        if w.lower() in AUXILIARIES and i == 0:  # a yes/no question: "Can you ..." -> "Can you not ..."
            return " ".join([*words[:2], "not", *words[2:]])
    return None


def _with_scope(text: str, scope: str) -> str:
    bare = text.rstrip("?.!")
    return f"{bare} {scope}{text[len(bare) :]}"


def _recall_variants(a: str, b: str, rng: random.Random) -> Iterator[tuple[str, str, bool, str]]:
    yield a, b, True, "paraphrase"
    typo = _typo(b, rng)
    if typo != b:
        yield a, typo, True, "typo"
    yield a, _shorthand(b), True, "shorthand"
    synonym = _synonym(b)
    if synonym is not None:
        yield a, synonym, True, "synonym"


@dataclass(frozen=True)
class Seeds:
    relations: list[tuple[str, str, str]]
    arguments: dict[str, list[tuple[str, str]]]
    requests: list[tuple[str, str]]
    affixed: list[tuple[str, str]]
    affix_fit: dict[int, list[str]]
    negatable: list[tuple[str, str]]
    superlatives: list[tuple[str, str, list[str]]]
    quantities: list[tuple[str, str, tuple[str, str]]]


FIRST = Seeds(RELATIONS, ARGUMENTS, REQUESTS, AFFIXED, AFFIX_FIT, NEGATABLE, SUPERLATIVES, QUANTITIES)


def pairs(seeds: Seeds = FIRST, seed: int = SEED) -> Iterator[tuple[str, tuple[str, str, bool, str]]]:
    """(the seed template, pair) for every pair, in a fixed order."""
    rng = random.Random(seed)
    for ta, tb, kind in seeds.relations:
        for x, y in seeds.arguments[kind]:
            a = ta.format(x=x, y=y)
            b = tb.format(x=x, y=y)
            b = b[0].upper() + b[1:]
            for p in _recall_variants(a, b, rng):
                yield ta, p
            swapped = tb.format(x=y, y=x)
            yield ta, (a, swapped[0].upper() + swapped[1:], False, "swap")
    for n, (a, b) in enumerate(seeds.requests):
        for p in _recall_variants(a, b, rng):
            yield a, p
        yield a, (a, _with_scope(b, SCOPES[n % len(SCOPES)]), False, "scope")
        yield a, (_with_scope(a, SCOPES[(n + 5) % len(SCOPES)]), b, False, "scope")
        short, long = OPPOSITE_SCOPES[n % len(OPPOSITE_SCOPES)]
        yield a, (_with_scope(a, short), _with_scope(b, long), False, "scope")
    for n, (ta, tb) in enumerate(seeds.affixed):
        for plain, negated in AFFIX_WORDS:
            if plain not in seeds.affix_fit[n]:
                continue
            a = ta.format(w=plain)
            for p in _recall_variants(a, tb.format(w=plain), rng):
                yield ta, p
            yield ta, (a, tb.format(w=negated), False, "affix")
    for a, b in seeds.negatable:
        for p in _recall_variants(a, b, rng):
            yield a, p
        not_b = _negate(b)
        if not_b is not None:
            yield a, (a, not_b, False, "negation")
    opposite = {one: other for one, other in ANTONYMS} | {other: one for one, other in ANTONYMS}
    for ta, tb, words in seeds.superlatives:
        for w in words:
            a = ta.format(w=w)
            for p in _recall_variants(a, tb.format(w=w), rng):
                yield ta, p
            yield ta, (a, tb.format(w=opposite[w]), False, "antonym")
    for ta, tb, (q, other) in seeds.quantities:
        a = ta.format(q=q)
        for p in _recall_variants(a, tb.format(q=q), rng):
            yield ta, p
        yield ta, (a, tb.format(q=other), False, "quantity")


# -- a second holdout: seeds written after the guards' first round of changes, frozen before the second round,
# all held out (transformed-late.jsonl)
LATE = Seeds(
    relations=[
        ("Convert {x} into {y}", "What's the way to turn {x} into {y}?", "format"),
        ("Is {x} older than {y}?", "Was {x} founded before {y}?", "org"),
        ("Can I send money from {x} to {y}?", "Is it possible to transfer money from {x} to {y}?", "bank"),
        ("Why does {x} chase {y}?", "What makes {x} chase {y}?", "animal"),
        ("How do I drive from {x} to {y}?", "What's the driving route from {x} to {y}?", "city2"),
        ("Should I switch from {x} to {y}?", "Is it worth moving from {x} to {y}?", "phone"),
        ("Does {x} weigh more than {y}?", "Is {x} heavier than {y}?", "thing"),
        ("Can {x} replace {y} in a recipe?", "Is {x} a good replacement for {y} in a recipe?", "food2"),
        ("Who won the match between {x} and {y} when {x} played at home?", "When {x} hosted {y}, who won?", "club"),
        ("Is it cheaper to fly from {x} to {y} on weekdays?", "Are weekday flights from {x} to {y} cheaper?", "city2"),
        ("What does {x} owe {y} under the lease?", "Under the lease, what is {x} liable to pay {y}?", "party"),
        ("How do I export my contacts from {x} to {y}?", "What's the way to move contacts from {x} to {y}?", "phone"),
    ],
    arguments={
        "format": [("a Word document", "a PDF"), ("a PNG image", "a JPEG"), ("CSV", "JSON")],
        "org": [("Harvard University", "Oxford University"), ("Coca-Cola", "Pepsi")],
        "bank": [("PayPal", "my bank account"), ("a savings account", "a checking account")],
        "animal": [("a dog", "a cat"), ("a fox", "a rabbit")],
        "city2": [("Berlin", "Munich"), ("Rio de Janeiro", "Sao Paulo"), ("Hong Kong", "New Delhi")],
        "phone": [("an iPhone", "an Android phone"), ("Gmail", "Outlook")],
        "thing": [("a liter of water", "a liter of milk"), ("a bowling ball", "a watermelon")],
        "food2": [("applesauce", "butter"), ("Greek yogurt", "sour cream")],
        "club": [("Liverpool", "Chelsea"), ("Bayern Munich", "Borussia Dortmund")],
        "party": [("the tenant", "the landlord"), ("the buyer", "the seller")],
    },
    requests=[
        ("How does a heat pump work?", "Explain how heat pumps work"),
        ("What is inflation?", "Tell me what inflation is"),
        ("How do I negotiate a salary?", "What's the way to negotiate my pay?"),
        ("Explain the rules of chess", "What are the rules of chess?"),
        ("What is machine learning?", "Explain machine learning to me"),
        ("How do solar panels make electricity?", "Explain how solar panels generate power"),
        ("Describe the water cycle", "How does the water cycle work?"),
        ("What is a credit score?", "Explain what a credit score is"),
    ],
    affixed=[
        ("Is it {w} to record a phone call without consent?", "Would recording a call without consent be {w}?"),
        ("What makes a password {w}?", "Why is a password considered {w}?"),
        ("Name some {w} beers", "Which beers are {w}?"),
        ("How can I tell if a mushroom is {w}?", "What shows that a mushroom is {w}?"),
    ],
    affix_fit={0: ["legal"], 1: ["secure"], 2: ["alcoholic"], 3: ["toxic", "safe"]},
    negatable=[
        ("Which vegetables can be eaten raw?", "What vegetables are fine to eat raw?"),
        ("Should I water succulents every week?", "Do succulents need watering weekly?"),
        ("Which airlines allow pets in the cabin?", "What airlines let pets fly in the cabin?"),
        ("Can I pay with a credit card at the airport?", "Is paying by credit card possible at the airport?"),
        ("Which countries require a visa for US citizens?", "What countries do US citizens need a visa for?"),
    ],
    superlatives=[
        (
            "What is the {w} planet in the solar system?",
            "Which planet in the solar system is the {w}?",
            ["largest", "hottest"],
        ),
        (
            "Which programming language is the {w} to learn?",
            "What is the {w} programming language to learn?",
            ["easiest"],
        ),
        ("What are the {w} of nuclear power?", "What {w} does nuclear power have?", ["benefits", "strengths"]),
        ("Why do prices {w} in winter?", "What makes prices {w} during winter?", ["increase"]),
        ("Which month is the {w} in Sydney?", "What is the {w} month in Sydney?", ["hottest", "wet"]),
    ],
    quantities=[
        (
            "How much caffeine is in {q} of espresso?",
            "What is the caffeine content of {q} of espresso?",
            ("a shot", "a liter"),
        ),
        (
            "How many times should I brush my teeth per {q}?",
            "How often should I brush my teeth each {q}?",
            ("day", "week"),
        ),
        ("Suggest {q} names for a cat", "Give me {q} cat name ideas", ("a few", "fifty")),
        ("How far can I walk in {q}?", "What distance can I walk in {q}?", ("an hour", "a day")),
    ],
)


def main() -> None:
    tuning: list[str] = []
    holdout: list[str] = []
    seen: set[tuple[str, str]] = set()
    for template, (a, b, same, kind) in pairs():
        if (a, b) in seen or a == b:
            continue
        seen.add((a, b))
        line = json.dumps({"a": a, "b": b, "same": same, "kind": kind}, ensure_ascii=False)
        (holdout if _held_out(template) else tuning).append(line)
    late: list[str] = []
    for _, (a, b, same, kind) in pairs(LATE, SEED + 1):
        if (a, b) not in seen and a != b:
            seen.add((a, b))
            late.append(json.dumps({"a": a, "b": b, "same": same, "kind": kind}, ensure_ascii=False))
    for name, lines in (("transformed", tuning), ("transformed-holdout", holdout), ("transformed-late", late)):
        (OUT / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        print(f"{name}.jsonl: {len(lines)} pairs")


if __name__ == "__main__":
    main()
