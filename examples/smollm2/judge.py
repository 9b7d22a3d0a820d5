"""Task and programmatic judge of the SmolLM2 example: short, correct answers to short questions.

Every prompt is a short question with a known answer (capitals, small arithmetic, opposites, colours,
animal young and sounds, plurals, past tenses, days and months). The judge measures three things:

* **correctness**: an accepted answer appears (case-insensitive, whole word) and it is the *first*
  answer of its kind the response gives (so "Sunday, Monday, Tuesday" or "12 or 13" does not count
  for a hedge that happens to contain the answer);
* **brevity**: the base model (SmolLM2-135M-Instruct) is verbose; PPO should shorten its answers to at
  most ``MAX_WORDS`` words without losing correctness;
* **repetition**: a repeated word 3-gram. A short reward for "the answer appears" is easy to hack by
  repeating the answer (or the question) over and over; the penalty blocks it.

``reward`` is the dense PPO reward built from them; ``meets_target`` (correct, brief, not repetitive)
is the 0/1 held-out "gold" judge. Plain Python (no torch): lmppo loads it by file path, e.g.
``reward.function: examples/smollm2/judge.py:reward``.

Items are split 80/20 into train and test by the underlying item (a country, a number pair, a word
pair, ...), deterministically, so no test question is a rephrasing of a training one.
"""

from __future__ import annotations

import hashlib
import random
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass

MAX_WORDS = 12  # at most this many words is "brief"; the brevity term reaches 0 at 3 * MAX_WORDS
REPEAT_N = 3  # a repeated word n-gram of this size makes a response repetitive
TEST_FRACTION = 0.2
TEMPLATES_PER_ITEM = 2  # each item is asked with this many of its kind's phrasings
SEED = 1234

# --------------------------------------------------------------------------------------------------
# Source tables (our own lists)
# --------------------------------------------------------------------------------------------------

# country (as written in a sentence) -> accepted capitals
CAPITALS = {
    "France": ["Paris"],
    "Germany": ["Berlin"],
    "Italy": ["Rome"],
    "Spain": ["Madrid"],
    "Portugal": ["Lisbon"],
    "the United Kingdom": ["London"],
    "Ireland": ["Dublin"],
    "the Netherlands": ["Amsterdam"],
    "Belgium": ["Brussels"],
    "Austria": ["Vienna"],
    "Switzerland": ["Bern", "Berne"],
    "Poland": ["Warsaw"],
    "the Czech Republic": ["Prague"],
    "Hungary": ["Budapest"],
    "Greece": ["Athens"],
    "Sweden": ["Stockholm"],
    "Norway": ["Oslo"],
    "Denmark": ["Copenhagen"],
    "Finland": ["Helsinki"],
    "Iceland": ["Reykjavik"],
    "Russia": ["Moscow"],
    "Ukraine": ["Kyiv", "Kiev"],
    "Romania": ["Bucharest"],
    "Bulgaria": ["Sofia"],
    "Serbia": ["Belgrade"],
    "Croatia": ["Zagreb"],
    "Turkey": ["Ankara"],
    "Egypt": ["Cairo"],
    "Kenya": ["Nairobi"],
    "Nigeria": ["Abuja"],
    "Ethiopia": ["Addis Ababa"],
    "Morocco": ["Rabat"],
    "Ghana": ["Accra"],
    "Japan": ["Tokyo"],
    "China": ["Beijing", "Peking"],
    "South Korea": ["Seoul"],
    "India": ["New Delhi", "Delhi"],
    "Pakistan": ["Islamabad"],
    "Bangladesh": ["Dhaka"],
    "Thailand": ["Bangkok"],
    "Vietnam": ["Hanoi"],
    "Indonesia": ["Jakarta"],
    "the Philippines": ["Manila"],
    "Malaysia": ["Kuala Lumpur"],
    "Iran": ["Tehran"],
    "Iraq": ["Baghdad"],
    "Saudi Arabia": ["Riyadh"],
    "Afghanistan": ["Kabul"],
    "Nepal": ["Kathmandu"],
    "Australia": ["Canberra"],
    "New Zealand": ["Wellington"],
    "Canada": ["Ottawa"],
    "the United States": ["Washington"],
    "Mexico": ["Mexico City"],
    "Brazil": ["Brasilia"],
    "Argentina": ["Buenos Aires"],
    "Chile": ["Santiago"],
    "Peru": ["Lima"],
    "Colombia": ["Bogota"],
    "Venezuela": ["Caracas"],
    "Cuba": ["Havana"],
    "Jamaica": ["Kingston"],
    "Mongolia": ["Ulaanbaatar", "Ulan Bator"],
    "Syria": ["Damascus"],
    "Lebanon": ["Beirut"],
    "Jordan": ["Amman"],
    "Qatar": ["Doha"],
    "Uganda": ["Kampala"],
    "Zimbabwe": ["Harare"],
    "Senegal": ["Dakar"],
    "Algeria": ["Algiers"],
    "Tunisia": ["Tunis"],
    "Libya": ["Tripoli"],
    "Sudan": ["Khartoum"],
    "Scotland": ["Edinburgh"],
}

# (word, its opposite, other accepted answers for the opposite, other accepted answers for the word):
# "What is the opposite of hot?" accepts cold; "... of cold?" accepts hot or warm.
OPPOSITES = [
    ("hot", "cold", ["chilly", "freezing"], ["warm"]),
    ("big", "small", ["little", "tiny"], ["large", "huge"]),
    ("tall", "short", [], ["long"]),
    ("fast", "slow", [], ["quick"]),
    ("happy", "sad", ["unhappy"], []),
    ("light", "dark", ["heavy"], ["bright"]),
    ("open", "closed", ["shut"], []),
    ("full", "empty", [], []),
    ("hard", "soft", ["easy"], ["loud"]),
    ("rich", "poor", [], ["wealthy"]),
    ("wet", "dry", [], []),
    ("early", "late", [], []),
    ("loud", "quiet", ["soft", "silent"], []),
    ("thick", "thin", [], ["fat"]),
    ("strong", "weak", [], []),
    ("heavy", "light", [], []),
    ("push", "pull", [], []),
    ("buy", "sell", [], []),
    ("win", "lose", [], ["find"]),
    ("young", "old", ["elderly"], ["new"]),
    ("clean", "dirty", [], []),
    ("cheap", "expensive", ["costly"], ["inexpensive"]),
    ("day", "night", [], []),
    ("love", "hate", [], []),
    ("give", "take", ["receive"], []),
    ("smooth", "rough", [], []),
    ("wide", "narrow", [], ["broad"]),
    ("deep", "shallow", [], []),
    ("true", "false", ["untrue"], []),
    ("always", "never", [], []),
    ("inside", "outside", [], []),
    ("above", "below", ["beneath", "under"], []),
    ("friend", "enemy", ["foe"], ["ally"]),
    ("ancient", "modern", ["new"], ["old", "traditional"]),
    ("remember", "forget", [], []),
    ("asleep", "awake", [], ["sleeping"]),
    ("alive", "dead", [], ["living"]),
    ("polite", "rude", ["impolite"], ["courteous"]),
    ("safe", "dangerous", ["unsafe"], []),
    ("laugh", "cry", [], []),
    ("north", "south", [], []),
    ("east", "west", [], []),
    ("top", "bottom", [], []),
    ("first", "last", [], []),
    ("tight", "loose", [], []),
    ("float", "sink", [], []),
    ("wild", "tame", ["domestic", "domesticated"], ["feral"]),
    ("summer", "winter", [], []),
    ("war", "peace", [], ["conflict"]),
    ("entrance", "exit", [], ["entry"]),
    ("victory", "defeat", ["loss"], ["win"]),
    ("healthy", "sick", ["ill", "unhealthy"], []),
]
# pairs asked one way only: the reverse question is already asked by another pair ("light", "soft")
ONE_WAY = {"heavy", "loud"}

# thing (as written in a question) -> accepted colours
COLOURS = {
    "the sky on a clear day": ["blue"],
    "grass": ["green"],
    "snow": ["white"],
    "coal": ["black"],
    "a ripe banana": ["yellow"],
    "a ripe tomato": ["red"],
    "blood": ["red"],
    "milk": ["white"],
    "a lemon": ["yellow"],
    "a carrot": ["orange"],
    "chocolate": ["brown"],
    "a strawberry": ["red"],
    "a lime": ["green"],
    "a pumpkin": ["orange"],
    "a polar bear": ["white"],
    "a crow": ["black"],
    "a flamingo": ["pink"],
    "an elephant": ["grey", "gray"],
    "a frog": ["green"],
    "a fire truck": ["red"],
    "a school bus": ["yellow"],
    "the ocean": ["blue"],
    "soot": ["black"],
    "a cherry": ["red"],
    "a tree trunk": ["brown"],
    "a leaf in summer": ["green"],
    "an emerald": ["green"],
    "a ruby": ["red"],
    "a sapphire": ["blue"],
    "a raven": ["black"],
    "an eggplant": ["purple"],
    "a plum": ["purple"],
    "a swan": ["white"],
    "a canary": ["yellow"],
    "a pig": ["pink"],
    "ivory": ["white"],
    "a pea": ["green"],
    "corn": ["yellow"],
    "a cucumber": ["green"],
    "a mouse": ["grey", "gray", "brown"],
    "a cloud": ["white", "grey", "gray"],
    "a penguin": ["black", "white"],
    "a zebra": ["black", "white"],
    "cinnamon": ["brown"],
    "a dandelion flower": ["yellow"],
    "a blackboard": ["black", "green"],
}
COLOUR_WORDS = [
    "red",
    "orange",
    "yellow",
    "green",
    "blue",
    "purple",
    "violet",
    "pink",
    "brown",
    "black",
    "white",
    "grey",
    "gray",
    "silver",
    "gold",
    "golden",
    "beige",
    "tan",
    "turquoise",
    "indigo",
]

# adult animal (with article) -> accepted names of its young
YOUNG = {
    "dog": ["puppy", "pup"],
    "cat": ["kitten", "kitty"],
    "cow": ["calf"],
    "horse": ["foal", "colt", "filly"],
    "sheep": ["lamb"],
    "pig": ["piglet"],
    "chicken": ["chick"],
    "duck": ["duckling"],
    "lion": ["cub"],
    "bear": ["cub"],
    "tiger": ["cub"],
    "fox": ["cub", "kit"],
    "kangaroo": ["joey"],
    "frog": ["tadpole", "froglet"],
    "butterfly": ["caterpillar", "larva"],
    "deer": ["fawn"],
    "goat": ["kid"],
    "goose": ["gosling"],
    "swan": ["cygnet"],
    "owl": ["owlet"],
    "eagle": ["eaglet"],
    "whale": ["calf"],
    "elephant": ["calf"],
    "seal": ["pup"],
    "rabbit": ["kit", "kitten", "bunny"],
    "wolf": ["pup", "cub"],
    "dolphin": ["calf"],
    "giraffe": ["calf"],
    "zebra": ["foal"],
    "penguin": ["chick"],
    "turkey": ["poult", "chick"],
    "hen": ["chick"],
}

# animal -> accepted sounds (verb stems; inflected forms are accepted too)
SOUNDS = {
    "dog": ["bark", "woof"],
    "cat": ["meow", "miaow", "mew", "purr"],
    "cow": ["moo"],
    "pig": ["oink", "grunt"],
    "duck": ["quack"],
    "horse": ["neigh", "whinny"],
    "sheep": ["baa", "bleat"],
    "lion": ["roar"],
    "snake": ["hiss"],
    "bee": ["buzz"],
    "owl": ["hoot"],
    "hen": ["cluck"],
    "frog": ["croak", "ribbit"],
    "mouse": ["squeak"],
    "wolf": ["howl"],
    "rooster": ["crow", "cock-a-doodle-doo"],
    "donkey": ["bray", "hee-haw"],
    "elephant": ["trumpet"],
    "turkey": ["gobble"],
    "pigeon": ["coo"],
    "goat": ["bleat", "baa"],
    "crow": ["caw"],
    "chick": ["cheep", "peep", "chirp", "tweet"],
}

PLURALS = {
    "child": ["children"],
    "mouse": ["mice"],
    "foot": ["feet"],
    "tooth": ["teeth"],
    "man": ["men"],
    "woman": ["women"],
    "goose": ["geese"],
    "person": ["people", "persons"],
    "ox": ["oxen"],
    "cactus": ["cacti", "cactuses"],
    "knife": ["knives"],
    "leaf": ["leaves"],
    "wolf": ["wolves"],
    "half": ["halves"],
    "life": ["lives"],
    "wife": ["wives"],
    "loaf": ["loaves"],
    "shelf": ["shelves"],
    "box": ["boxes"],
    "bus": ["buses", "busses"],
    "city": ["cities"],
    "baby": ["babies"],
    "story": ["stories"],
    "potato": ["potatoes"],
    "tomato": ["tomatoes"],
    "hero": ["heroes"],
    "dish": ["dishes"],
    "church": ["churches"],
    "fox": ["foxes"],
    "glass": ["glasses"],
    "party": ["parties"],
    "cherry": ["cherries"],
    "key": ["keys"],
    "toy": ["toys"],
    "louse": ["lice"],
    "die": ["dice"],
    "fungus": ["fungi", "funguses"],
    "crisis": ["crises"],
    "thesis": ["theses"],
    "phenomenon": ["phenomena"],
    "criterion": ["criteria"],
    "bacterium": ["bacteria"],
    "nucleus": ["nuclei"],
    "matrix": ["matrices"],
    "calf": ["calves"],
    "thief": ["thieves"],
    "echo": ["echoes"],
    "wish": ["wishes"],
    "lady": ["ladies"],
    "watch": ["watches"],
    "cat": ["cats"],
    "apple": ["apples"],
    "pony": ["ponies"],
    "berry": ["berries"],
}

PAST = {
    "go": ["went"],
    "eat": ["ate"],
    "see": ["saw"],
    "run": ["ran"],
    "swim": ["swam"],
    "sing": ["sang"],
    "write": ["wrote"],
    "take": ["took"],
    "give": ["gave"],
    "drink": ["drank"],
    "begin": ["began"],
    "bring": ["brought"],
    "buy": ["bought"],
    "think": ["thought"],
    "teach": ["taught"],
    "catch": ["caught"],
    "fight": ["fought"],
    "fly": ["flew"],
    "drive": ["drove"],
    "ride": ["rode"],
    "speak": ["spoke"],
    "break": ["broke"],
    "choose": ["chose"],
    "freeze": ["froze"],
    "steal": ["stole"],
    "wake": ["woke"],
    "sleep": ["slept"],
    "keep": ["kept"],
    "feel": ["felt"],
    "meet": ["met"],
    "sit": ["sat"],
    "stand": ["stood"],
    "understand": ["understood"],
    "tell": ["told"],
    "sell": ["sold"],
    "find": ["found"],
    "hold": ["held"],
    "win": ["won"],
    "lose": ["lost"],
    "throw": ["threw"],
    "grow": ["grew"],
    "know": ["knew"],
    "draw": ["drew"],
    "blow": ["blew"],
    "fall": ["fell"],
    "forget": ["forgot"],
    "hide": ["hid"],
    "bite": ["bit"],
    "shake": ["shook"],
    "jump": ["jumped"],
    "walk": ["walked"],
    "play": ["played"],
    "cry": ["cried"],
    "stop": ["stopped"],
    "dance": ["danced"],
    "carry": ["carried"],
}

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]

TEMPLATES = {
    "capital": [
        "What is the capital of {x}?",
        "Which city is the capital of {x}?",
        "Name the capital city of {x}.",
        "What city is the capital of {x}?",
    ],
    "arithmetic": [
        "What is {a} {op} {b}?",
        "How much is {a} {op} {b}?",
        "Compute {a} {op} {b}.",
        "What does {a} {op} {b} equal?",
    ],
    "opposite": [
        "What is the opposite of {x}?",
        'What is the opposite of the word "{x}"?',
        "Give the opposite of {x}.",
        "Which word means the opposite of {x}?",
    ],
    "colour": [
        "What colour is {x}?",
        "What color is {x}?",
        "What is the colour of {x}?",
        "Which color is {x}?",
    ],
    "animal_young": [
        "What is a baby {x} called?",
        "What do you call a young {x}?",
        "What is the name for a baby {x}?",
    ],
    "animal_sound": [
        "What sound does {x} make?",
        "What noise does {x} make?",
        "Which sound is made by {x}?",
    ],
    "plural": [
        "What is the plural of {x}?",
        'What is the plural of the word "{x}"?',
        "What do you call more than one {x}?",
    ],
    "past_tense": [
        "What is the past tense of {x}?",
        'What is the past tense of the verb "{x}"?',
        "What is the simple past form of {x}?",
    ],
    "calendar": [
        "What {unit} comes {rel} {x}?",
        "Which {unit} is {rel2} {x}?",
        "What is the {unit} {rel} {x}?",
    ],
}

# --------------------------------------------------------------------------------------------------
# Items and prompts
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Item:
    """One prompt: its text, kind, accepted answers, and the underlying item it is split by."""

    prompt: str
    kind: str
    answers: tuple[str, ...]
    key: str  # the underlying item; every prompt of one key lands in the same split


_ONES = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
]
_TENS = ["_", "_", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]


def number_words(n: int) -> str:
    """English words of 0 <= n < 1000 ("forty-two", "one hundred and five")."""
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + ("" if n % 10 == 0 else "-" + _ONES[n % 10])
    rest = n % 100
    return _ONES[n // 100] + " hundred" + ("" if rest == 0 else " and " + number_words(rest))


def _inflections(stem: str) -> list[str]:
    """A sound verb and its -s / -ing / -ed forms ("bark" -> barks, barking, barked)."""
    if " " in stem or "-" in stem:
        return [stem]
    if stem.endswith(("s", "z", "sh", "ch")):
        return [stem, stem + "es", stem + "ing", stem + "ed"]
    if stem.endswith("y") and stem[-2] not in "aeiou":
        return [stem, stem[:-1] + "ies", stem + "ing", stem[:-1] + "ied"]
    if stem.endswith("e") and not stem.endswith(("ee", "oe")):
        return [stem, stem + "s", stem[:-1] + "ing", stem + "d"]
    return [stem, stem + "s", stem + "ing", stem + "ed"]


def _noun_forms(word: str) -> list[str]:
    """A noun and its plural ("calf" -> calves, "puppy" -> puppies)."""
    if word.endswith("y") and word[-2] not in "aeiou":
        return [word, word[:-1] + "ies"]
    if word.endswith("f"):
        return [word, word[:-1] + "ves"]
    if word.endswith(("s", "x", "ch", "sh")):
        return [word, word + "es"]
    return [word, word + "s"]


def _article(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _arithmetic_items() -> list[tuple[str, dict, list[str]]]:
    """(key, template fields, answers) of small sums, differences and products; none has an answer
    equal to one of its operands (a response repeating the question must not look correct)."""
    rng = random.Random(SEED)
    out = []
    pairs = sorted({tuple(sorted(p)) for p in ((a, b) for a in range(2, 20) for b in range(2, 13))})
    for a, b in rng.sample(pairs, 40):
        if rng.random() < 0.5:
            a, b = b, a
        out.append((f"add:{min(a, b)}:{max(a, b)}", {"a": a, "b": b, "op": "plus"}, a + b))
    diffs = [(a, b) for a in range(5, 21) for b in range(2, a - 1) if a - b != b]
    for a, b in rng.sample(diffs, 30):
        out.append((f"sub:{a}:{b}", {"a": a, "b": b, "op": "minus"}, a - b))
    products = sorted({tuple(sorted(p)) for p in ((a, b) for a in range(2, 10) for b in range(2, 11))})
    for a, b in rng.sample(products, 30):
        if rng.random() < 0.5:
            a, b = b, a
        out.append((f"mul:{min(a, b)}:{max(a, b)}", {"a": a, "b": b, "op": "times"}, a * b))
    return [(key, fields, [str(n), number_words(n)]) for key, fields, n in out]


def _raw_items() -> list[tuple[str, str, dict, list[str]]]:
    """(kind, key, template fields, accepted answers) of every underlying item."""
    items = []
    for country, capitals in CAPITALS.items():
        items.append(("capital", country, {"x": country}, capitals))
    for key, fields, answers in _arithmetic_items():
        items.append(("arithmetic", key, fields, answers))
    for a, b, b_alts, a_alts in OPPOSITES:
        pair = f"{a}/{b}"  # both directions of a pair are one underlying item
        items.append(("opposite", pair, {"x": a}, [b, *b_alts]))
        if a not in ONE_WAY:
            items.append(("opposite", pair, {"x": b}, [a, *a_alts]))
    for thing, colours in COLOURS.items():
        items.append(("colour", thing, {"x": thing}, colours))
    for animal, young in YOUNG.items():
        items.append(("animal_young", animal, {"x": animal}, [f for w in young for f in _noun_forms(w)]))
    for animal, sounds in SOUNDS.items():
        items.append(
            ("animal_sound", animal, {"x": _article(animal)}, [f for s in sounds for f in _inflections(s)])
        )
    for word, plurals in PLURALS.items():
        items.append(("plural", word, {"x": word}, plurals))
    for verb, past in PAST.items():
        items.append(("past_tense", verb, {"x": verb}, past))
    for unit, names in (("day", DAYS), ("month", MONTHS)):
        n = len(names)
        for i, name in enumerate(names):
            items.append(
                (
                    "calendar",
                    f"{unit}:{name}:after",
                    {"unit": unit, "rel": "after", "rel2": "right after", "x": name},
                    [names[(i + 1) % n]],
                )
            )
            items.append(
                (
                    "calendar",
                    f"{unit}:{name}:before",
                    {"unit": unit, "rel": "before", "rel2": "just before", "x": name},
                    [names[(i - 1) % n]],
                )
            )
    return items


def _stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{SEED}:{text}".encode()).digest()[:8], "big")


def _build() -> tuple[list[Item], dict[str, str]]:
    """All prompts and each underlying item's split ("train" / "test")."""
    raw = _raw_items()
    items, split_of = [], {}
    for kind in TEMPLATES:
        keys = sorted({key for k, key, _, _ in raw if k == kind}, key=_stable_hash)
        n_test = round(TEST_FRACTION * len(keys))
        split_of.update({(kind, key): ("test" if i < n_test else "train") for i, key in enumerate(keys)})
    for kind, key, fields, answers in raw:
        templates = TEMPLATES[kind]
        chosen = sorted(
            random.Random(_stable_hash(f"{kind}:{key}:{fields}")).sample(
                range(len(templates)), TEMPLATES_PER_ITEM
            )
        )
        for t in chosen:
            item = Item(templates[t].format(**fields), kind, tuple(dict.fromkeys(answers)), key)
            for answer in item.answers:  # a response repeating the question must not look correct
                if re.search(rf"(?<!\w){re.escape(answer)}(?!\w)", item.prompt, re.IGNORECASE):
                    raise AssertionError(f"{item.prompt!r} contains its own answer {answer!r}")
            items.append(item)
    return items, split_of


ITEMS, _SPLIT = _build()
_BY_PROMPT: dict[str, Item] = {}
for _item in ITEMS:
    if _item.prompt in _BY_PROMPT:
        raise AssertionError(f"duplicate prompt {_item.prompt!r}")
    _BY_PROMPT[_item.prompt] = _item


def split_of(item: Item) -> str:
    return _SPLIT[(item.kind, item.key)]


def prompt_rows(split: str) -> list[dict]:
    """``[{"prompt", "kind", "answers"}]`` of one split ("train" or "test"), in a fixed order."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    return [
        {"prompt": it.prompt, "kind": it.kind, "answers": list(it.answers)}
        for it in ITEMS
        if split_of(it) == split
    ]


# --------------------------------------------------------------------------------------------------
# Judging
# --------------------------------------------------------------------------------------------------

_WORD = re.compile(r"[^\W_]+(?:['\u2019-][^\W_]+)*")
_CASE_SENSITIVE = {"may", "march"}  # month names that are common English words: matched as "May", "March"


def _normalise(text: str) -> str:
    """Accents stripped, hyphens and dashes to spaces, curly quotes straightened (case kept)."""
    text = unicodedata.normalize("NFKD", text)
    text = "".join(c for c in text if not unicodedata.combining(c))
    text = text.replace("\u2019", "'").replace("\u2018", "'")
    return re.sub(r"[-\u2010-\u2015]", " ", text)


def _phrase_pattern(phrase: str) -> re.Pattern:
    phrase = _normalise(phrase)
    body = r"\s+".join(re.escape(p) for p in phrase.split())
    if phrase.isdigit():  # "12" but not "120", "1.2" or "12.5"
        return re.compile(rf"(?<![\w.,]){body}(?![\w]|[.,]\d)")
    flags = 0 if phrase.lower() in _CASE_SENSITIVE else re.IGNORECASE
    if phrase.lower() in _CASE_SENSITIVE:
        body = re.escape(phrase.lower().capitalize())
    return re.compile(rf"(?<!\w){body}(?!\w)", flags)


def _rival_table() -> dict[str, set[str]]:
    """Per kind, every answer any of its items accepts: a rival answer given before the accepted one
    makes a response a (wrong or hedged) miss."""
    table: dict[str, set[str]] = {}
    for it in ITEMS:
        table.setdefault(it.kind, set()).update(a.lower() for a in it.answers if not a.isdigit())
    table["colour"].update(COLOUR_WORDS)
    table["calendar"].update(d.lower() for d in DAYS + MONTHS)
    table["arithmetic"] = set()  # numbers: every number in the response not in the prompt is a rival
    return table


_RIVALS = _rival_table()
_PATTERNS: dict[str, re.Pattern] = {}


def _pattern(phrase: str) -> re.Pattern:
    if phrase not in _PATTERNS:
        _PATTERNS[phrase] = _phrase_pattern(phrase)
    return _PATTERNS[phrase]


def _first_answer(item: Item, response: str) -> tuple[str | None, bool]:
    """The first answer of the item's kind the response gives, and whether it is accepted.

    Candidates are the accepted answers plus the kind's rivals (for arithmetic: any number), minus
    whatever the prompt itself mentions (repeating the question is no answer). Earliest match wins;
    at the same position the longer one ("New Delhi" over "New").
    """
    text, prompt = _normalise(response), _normalise(item.prompt)
    accepted = {a.lower() for a in item.answers}
    matches = []
    for phrase in accepted | _RIVALS[item.kind]:
        if _pattern(phrase).search(prompt):
            continue
        for m in _pattern(phrase).finditer(text):
            matches.append((m.start(), -(m.end() - m.start()), phrase in accepted, m.group(0)))
    if item.kind == "arithmetic":
        in_prompt = set(re.findall(r"\d+", prompt))
        for m in re.finditer(r"(?<![\w.,])\d+(?![\w]|[.,]\d)", text):
            if m.group(0) not in in_prompt:
                matches.append((m.start(), -(m.end() - m.start()), m.group(0) in accepted, m.group(0)))
    if not matches:
        return None, False
    _, _, ok, found = min(matches, key=lambda t: (t[0], t[1], not t[2]))
    return found, ok


def _item_of(prompt) -> Item:
    """The item of a prompt string or chat messages (the last user message)."""
    text = prompt
    if isinstance(prompt, (list, tuple)):
        users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        if not users:
            raise ValueError(f"prompt has no user message: {prompt!r}")
        text = users[-1]
    if not isinstance(text, str):
        raise TypeError(f"prompt must be a string or chat messages, got {type(prompt).__name__}: {prompt!r}")
    item = _BY_PROMPT.get(text.strip())
    if item is None:
        raise ValueError(
            f"unknown prompt {text!r}: examples/smollm2/judge.py only judges the prompts it generates "
            "(prompt_rows('train'/'test'), data/prompts_*.jsonl)."
        )
    return item


def kind_of(prompt) -> str:
    """The prompt's kind ("capital", "arithmetic", ...): a slice for per-kind metrics."""
    return _item_of(prompt).kind


def word_count(response: str) -> int:
    return len(_WORD.findall(response))


def is_repetitive(response: str, n: int = REPEAT_N) -> bool:
    """Some word n-gram (case-insensitive) occurs twice."""
    words = [w.lower() for w in _WORD.findall(response)]
    grams = Counter(tuple(words[i : i + n]) for i in range(len(words) - n + 1))
    return any(c > 1 for c in grams.values())


def brevity(words: int) -> float:
    """1.0 for 1..MAX_WORDS words, falling linearly to 0.0 at 3 * MAX_WORDS; 0.0 for an empty response
    (saying nothing is not a short answer)."""
    if words == 0:
        return 0.0
    return max(0.0, min(1.0, (3 * MAX_WORDS - words) / (2 * MAX_WORDS)))


def judge_row(prompt, response: str) -> dict:
    """Everything the judge measures on one response.

    ``correct``: an accepted answer appears (case-insensitive, whole word) and is the first answer of
    its kind given; ``words``; ``brief`` (1 <= words <= MAX_WORDS); ``repetitive`` (a repeated word
    3-gram); ``meets_target`` (correct, brief, not repetitive); plus ``kind``, ``found`` (the first
    answer found, or None), ``brevity`` and ``reward``.
    """
    item = _item_of(prompt)
    found, correct = _first_answer(item, response)
    words = word_count(response)
    repetitive = is_repetitive(response)
    brief = 1 <= words <= MAX_WORDS
    return {
        "kind": item.kind,
        "correct": correct,
        "found": found,
        "words": words,
        "brief": brief,
        "repetitive": repetitive,
        "meets_target": correct and brief and not repetitive,
        "brevity": brevity(words),
        "reward": float(correct) + brevity(words) - float(repetitive),
    }


def reward(prompts, responses) -> list[float]:
    """PPO reward per row: 1.0 if correct, + brevity (1.0 at <= MAX_WORDS words, linearly down to 0 at
    3 * MAX_WORDS), - 1.0 if repetitive. Range [-1, 2]; dense in length, so PPO can shorten answers
    step by step while the correctness term keeps it from dropping the answer."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    return [judge_row(p, r)["reward"] for p, r in zip(prompts, responses)]


def brevity_reward(prompts, responses) -> list[float]:
    """The brevity term alone, as a reward component beside a learned RM (ppo_rm_brevity.yaml)."""
    return [brevity(word_count(r)) for r in responses]


def meets_target(prompt, response: str) -> float:
    """The held-out gold judge: 1.0 if the response is correct, brief and not repetitive, else 0.0."""
    return float(judge_row(prompt, response)["meets_target"])


if __name__ == "__main__":
    counts = Counter((it.kind, split_of(it)) for it in ITEMS)
    for kind in TEMPLATES:
        print(f"{kind:13s} train {counts[(kind, 'train')]:4d}  test {counts[(kind, 'test')]:4d}")
    print(f"{'total':13s} train {len(prompt_rows('train')):4d}  test {len(prompt_rows('test')):4d}")
