"""The guards' vocabularies: stop and filler words, negations, direction words, scope words and quantifiers,
relation markers, numbers in words, dates, units and languages, each with the spellings that mean the same.

Plain data and one helper, imported by profiles.py, guards.py and roles.py; nothing here reads a prompt.
"""

from __future__ import annotations


def _words(text: str) -> list[str]:
    return text.split()


STOP_WORDS = frozenset(
    _words("""a an the this that these those is are was were be been being am do does did doing done have has had having
    i me my mine we us our you your yours he him his she her it its they them their there here what which who whom
    whose why how where when whether of in on at by for with about as into onto upon within out off
    and or but if so such than then too very also just own same other another any can could would should will
    shall may might must let lets get gets got getting make makes made making give gives gave tell tells told
    show shows showed explain explains explained describe describes described way ways thing things something
    anything one's oneself someone anyone somebody anybody people person use using used""")
)
# Words that change the tone of a request, not its answer.
FILLER_WORDS = frozenset(
    _words("""please pls plz kindly thanks thank thx ty hey hi hello hiya greetings dear sir madam folks guys friend
    help helping need needs want wants wanted wondering wonder know knows like quick quickly question questions
    actually really basically simply literally honestly maybe perhaps possibly ok okay um uh hmm well yeah yes
    sorry excuse mind able curious trying try idea ideas""")
)
NEGATIONS = frozenset(
    _words("not no never none nothing nobody nowhere neither nor without cannot unable lack lacks lacking")
)
# Opposites: one of a pair on one side and the other on the other side reverses what is asked.
OPPOSITES = tuple(
    tuple(pair.split("/"))
    for pair in _words(
        """before/after above/below over/under up/down upward/downward upstairs/downstairs left/right north/south
        east/west increase/decrease raise/lower rise/fall higher/lower highest/lowest ascending/descending
        encode/decode encrypt/decrypt compress/decompress zip/unzip import/export upload/download buy/sell
        push/pull inbound/outbound incoming/outgoing forward/backward earlier/later earliest/latest oldest/newest
        older/newer min/max minimum/maximum largest/smallest biggest/smallest bigger/smaller cheapest/dearest
        best/worst better/worse add/remove plus/minus enable/disable open/close start/stop begin/end first/last
        top/bottom input/output hot/cold warm/cool win/lose gain/lose pros/cons advantages/disadvantages
        true/false more/less most/least heavier/lighter faster/slower longer/shorter taller/shorter
        easier/harder strongest/weakest positive/negative maximize/minimize include/exclude accept/reject
        allow/deny allow/block lock/unlock mount/unmount install/uninstall connect/disconnect login/logout
        sunrise/sunset arrival/departure arrive/leave send/receive lend/borrow asleep/awake import/export
        inhale/exhale expand/collapse shrink/grow on/off male/female man/woman men/women boy/girl
        boiling/freezing"""
    )
)
SCOPE_WORDS = frozenset(
    _words(
        """all every each only entire whole total overall average median both either single recursive
        recursively including excluding except daily weekly monthly yearly annual annually hourly nightly
        partial partially full fully complete completely exactly"""
    )
)
# Scope words that say the same: "each chapter" and "all chapters" ask for the same.
SCOPE_SYNONYMS = {
    "every": "all",
    "each": "all",
    "entire": "whole",
    "full": "whole",
    "complete": "whole",
    "fully": "completely",
    "annual": "yearly",
}
# Quantifiers: prompts with different ones ("most cats" / "any cats") ask different things; one on one side only
# ("some ways to ..." / "ways to ...") usually does not.
QUANTIFIERS = frozenset(_words("all every each most some any none few many several no lot lots plenty"))
# "each day", "every month", "per week", "a year": the same scope as "daily", "monthly", "weekly", "yearly".
PERIODS = {"day": "daily", "week": "weekly", "month": "monthly", "year": "yearly", "hour": "hourly", "night": "nightly"}
# Direction markers: a word moved from one side of one to the other reverses the request.
ORDER_MARKERS = frozenset(_words("to into from than before after over onto towards toward against instead of on for"))
# Markers that say the same: "change X into Y" is "convert X to Y", "use X instead of Y" is "X for Y".
_MARKER_SAME = {"into": "to", "towards": "to", "toward": "to", "onto": "on", "instead": "for"}
ORDER_TAGS = frozenset(f"<{_MARKER_SAME.get(m, m)}>" for m in ORDER_MARKERS)  # a marker in a profile's content
# Words after which "to" starts an infinitive ("how to", "possible to", "want to"), not a direction.
_INFINITIVE_TAKERS = frozenset(
    _words("""how what where when way ways possible impossible able unable want wants need needs try trying going
    have has had like love hate easy hard best time steps step order used supposed allowed plan decide learn
    better safe ok okay good take takes took taking fastest quickest easiest cheapest simplest""")
)
# Words that join two things without ranking them: "X and Y", "X or Y", "X vs Y" say nothing of roles.
COORDINATORS = frozenset(_words("and or vs versus nor &"))
COORDINATOR_TAG = "<&>"

NUMBER_WORDS = {
    w: i
    for i, w in enumerate(
        _words("""zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen
        seventeen eighteen nineteen""")
    )
}
NUMBER_WORDS.update(
    {"twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90}
)
MULTIPLIERS = {"hundred": 100, "thousand": 1000, "million": 1_000_000, "billion": 1_000_000_000}
OTHER_NUMBERS = {
    "dozen": 12,
    "half": 0.5,
    "quarter": 0.25,
    "twice": 2,
    "double": 2,
    "triple": 3,
    "pair": 2,
    "squared": 2,  # an exponent: "x squared" is "x to the power of 2"
    "cubed": 3,
}
ORDINALS = {
    w: i + 1
    for i, w in enumerate(
        _words("""first second third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth""")
    )
}

MONTHS = {
    m: i + 1
    for i, m in enumerate(
        _words("january february march april may june july august september october november december")
    )
}
MONTHS.update({m[:3]: i for m, i in list(MONTHS.items()) if m != "may"})
MONTHS["sept"] = 9
WEEKDAYS = frozenset(_words("monday tuesday wednesday thursday friday saturday sunday weekday weekend"))
DATE_WORDS = frozenset(
    _words(
        """today tomorrow yesterday tonight morning afternoon evening night midnight noon am pm summer autumn
        winter century decade weekend"""
    )
)
# Seasons that are ordinary words too ("fall asleep", "a spring"): seasons only after one of these.
_AMBIGUOUS_SEASONS = frozenset(_words("spring fall"))
_SEASON_CUES = frozenset(_words("in this next last during every early late"))

# Units: spelling -> canonical unit.
_UNIT_SPELLINGS = {
    "kg": "kilogram kilograms kilo kilos kgs",
    "g": "gram grams gm gms gr",
    "mg": "milligram milligrams mgs",
    "lb": "pound pounds lbs",
    "oz": "ounce ounces",
    "floz": "",
    "c": "celsius centigrade °c",
    "f": "fahrenheit °f",
    "k": "kelvin",
    "km": "kilometer kilometers kilometre kilometres kms",
    "m": "meter meters metre metres",
    "cm": "centimeter centimeters centimetre centimetres",
    "mm": "millimeter millimeters millimetre millimetres",
    "mi": "mile miles",
    "ft": "foot feet",
    "in": "inch inches",
    "yd": "yard yards",
    "l": "liter liters litre litres",
    "ml": "milliliter milliliters millilitre millilitres",
    "gal": "gallon gallons",
    "qt": "quart quarts",
    "pt": "pint pints",
    "cup": "cups",
    "tbsp": "tablespoon tablespoons tbs",
    "tsp": "teaspoon teaspoons",
    "mph": "",
    "kph": "kmh kmph",
    "knot": "knots",
    "h": "hour hours hr hrs",
    "min": "minute minutes mins",
    "s": "second seconds sec secs",
    "ms": "millisecond milliseconds",
    "day": "days",
    "week": "weeks",
    "month": "months",
    "year": "years yr yrs",
    "usd": "dollar dollars $ bucks",
    "eur": "euro euros €",
    "gbp": "£ sterling quid",
    "jpy": "yen ¥",
    "cny": "yuan renminbi rmb",
    "inr": "rupee rupees",
    "chf": "franc francs",
    "cad": "",
    "aud": "",
    "percent": "% percentage pct",
    "byte": "bytes",
    "kb": "kilobyte kilobytes",
    "mb": "megabyte megabytes",
    "gb": "gigabyte gigabytes",
    "tb": "terabyte terabytes",
    "w": "watt watts",
    "kw": "kilowatt kilowatts",
    "kwh": "",
    "v": "volt volts",
    "cal": "calorie calories kcal",
    "j": "joule joules",
    "psi": "",
    "acre": "acres",
    "hectare": "hectares ha",
    "sqft": "",
    "degree": "degrees",
    "rad": "radian radians",
}
UNITS = {s: unit for unit, spellings in _UNIT_SPELLINGS.items() for s in [unit, *_words(spellings)]}
# Short unit spellings that are ordinary words too: units only right after a number ("5 in", "3 m", "2 s").
_AMBIGUOUS_UNITS = frozenset(_words("in m s g h l c f k j v w min pt ha gr cal day week month year second minute hour"))

_LANGUAGE_SPELLINGS = {
    "python": "py python3",
    "java": "",
    "javascript": "js ecmascript",
    "typescript": "ts",
    "c": "",
    "c++": "cpp cplusplus",
    "c#": "csharp",
    "go": "golang",
    "rust": "",
    "ruby": "",
    "php": "",
    "swift": "",
    "kotlin": "",
    "scala": "",
    "haskell": "",
    "perl": "",
    "lua": "",
    "r": "",
    "matlab": "",
    "julia": "",
    "dart": "",
    "elixir": "",
    "erlang": "",
    "clojure": "",
    "fortran": "",
    "cobol": "",
    "sql": "",
    "bash": "sh zsh",
    "powershell": "",
    "html": "",
    "css": "",
    "english": "",
    "spanish": "castilian",
    "french": "",
    "german": "",
    "italian": "",
    "portuguese": "",
    "chinese": "mandarin",
    "cantonese": "",
    "japanese": "",
    "korean": "",
    "russian": "",
    "arabic": "",
    "hindi": "",
    "bengali": "",
    "dutch": "",
    "swedish": "",
    "norwegian": "",
    "danish": "",
    "finnish": "",
    "polish": "",
    "greek": "",
    "turkish": "",
    "hebrew": "",
    "vietnamese": "",
    "thai": "",
    "indonesian": "",
    "ukrainian": "",
    "czech": "",
    "latin": "",
    "swahili": "",
}
LANGUAGES = {s: lang for lang, spellings in _LANGUAGE_SPELLINGS.items() for s in [lang, *_words(spellings)]}
# Language names that are ordinary words too: languages only when capitalised (Go, R, C, Swift, Rust, Julia...).
_AMBIGUOUS_LANGUAGES = frozenset(_words("go r c swift rust ruby dart julia lua perl scala latin sh"))
