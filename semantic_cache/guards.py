"""Checks a semantic match must pass before it is served: the things embeddings blur.

MiniLM puts "is it safe to eat raw eggs?" and "is it not safe ..." at 0.99 cosine, and
"15% of 200" next to "15% of 300". A cached answer is served only when both questions carry
the same negation, the same numbers, the same named entities and no opposite verbs. A failed
guard demotes the match to a draft hint, which verification keeps lossless.

No word list knows every antonym ("ascending"/"descending", "pause"/"resume", "map"/"filter"),
so one guard looks at the shape of the difference instead: two questions that are the same
words except for one short local swap ("sort ... in ascending order" / "... in descending
order") differ exactly where the meaning is. Such a minimal pair is refused unless what was
swapped carries no content (function words, inflections, known aliases). A paraphrase that
rewords the question around its content passes; a paraphrase that swaps just one content word
for a synonym is refused too, and served through verification instead (`semantic.mode`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_WORD = re.compile(r"[A-Za-z][A-Za-z0-9+#.\-']*[A-Za-z0-9+#]|[A-Za-z]|\d+(?:[.,]\d+)*%?")

_NEGATIONS = frozenset(
    "not no never none nothing nobody neither nor without cannot avoid lack lacking".split()
)

_NUMBER_WORDS = {
    w: str(i)
    for i, w in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
        "sixteen seventeen eighteen nineteen twenty".split()
    )
}
_ORDINALS = {"first": "1", "second": "2", "third": "3", "fourth": "4", "fifth": "5", "tenth": "10"}

# Words whose swap turns a question into its opposite. Each pair is symmetric.
_OPPOSITES = [
    ("enable", "disable"), ("increase", "decrease"), ("install", "uninstall"), ("encrypt", "decrypt"),
    ("before", "after"), ("add", "remove"), ("upload", "download"), ("maximum", "minimum"),
    ("max", "min"), ("start", "stop"), ("import", "export"), ("advantages", "disadvantages"),
    ("pros", "cons"), ("in", "out"), ("lock", "unlock"), ("push", "pull"), ("buy", "sell"),
    ("compress", "extract"), ("zip", "unzip"), ("on", "off"), ("rise", "fall"), ("inflation", "deflation"),
    ("open", "close"), ("show", "hide"), ("allow", "deny"), ("accept", "reject"), ("win", "lose"),
    ("gain", "lose"), ("hot", "cold"), ("fast", "slow"), ("best", "worst"), ("more", "less"),
    ("mount", "unmount"), ("follow", "unfollow"), ("subscribe", "unsubscribe"), ("serialize", "deserialize"),
    ("encode", "decode"), ("login", "logout"), ("connect", "disconnect"), ("read", "write"),
    ("higher", "lower"), ("above", "below"), ("first", "last"), ("largest", "smallest"),
]
# Members of one class are never interchangeable: a question about one is not about another.
_CONTRAST_CLASSES = [
    "list dict dictionary tuple set array string map queue stack tree graph heap",
    "int integer float double boolean bool char byte",
    "text image video audio file folder directory",
    "car bike bicycle bus truck train plane motorcycle boat",
    "cold flu covid allergy fever migraine",
    "monday tuesday wednesday thursday friday saturday sunday",
    "january february march april may june july august september october november december",
    "red green blue yellow black white orange purple pink brown",
    "dog cat rabbit horse bird fish hamster",
    "breakfast lunch dinner",
    "daily weekly monthly yearly",
    "seconds minutes hours days weeks months years",
    "unit integration e2e",
    "tcp udp http https ftp ssh",
    "get post put patch delete",
]
_OPPOSITE_OF: dict[str, set[str]] = {}
for _a, _b in _OPPOSITES:
    _OPPOSITE_OF.setdefault(_a, set()).add(_b)
    _OPPOSITE_OF.setdefault(_b, set()).add(_a)
for _line in _CONTRAST_CLASSES:
    _members = _line.split()
    for _w in _members:
        _OPPOSITE_OF.setdefault(_w, set()).update(m for m in _members if m != _w)

# Capitalized words that are not names: sentence starters, question words, pronouns.
_COMMON = frozenset(
    """a an the i i'm i've what what's which who whom whose when where why how is are was were do does did
    can could should would will shall may might must tell explain give list write plan summarize describe
    convert translate please help show find make create my your our their his her its it this that these
    those there here in on at for to of and or but if with by from as be have has had hi hello hey yes no
    ok okay thanks thank so also then just any some every each all one earth world""".split()
)
_ROMAN = {"ii": "2", "iii": "3", "iv": "4", "vi": "6", "vii": "7", "viii": "8", "ix": "9"}


@dataclass(frozen=True, slots=True)
class Facts:
    negated: bool
    numbers: frozenset[str]  # written with digits: "15%", "3.12", "2014"
    soft_numbers: frozenset[str]  # words and numerals: "two", "second", "II" (often not a quantity)
    entities: tuple[str, ...]  # names in order of appearance
    words: frozenset[str]


def facts(text: str) -> Facts:
    tokens = _WORD.findall(text)
    words: list[str] = []
    numbers: set[str] = set()
    soft: set[str] = set()
    entities: dict[str, None] = {}  # ordered, with constant-time membership
    negated = False
    for i, tok in enumerate(tokens):
        low = tok.lower()
        stem = low[:-2] if low.endswith("'s") else low
        if low.endswith("n't") or low in _NEGATIONS:
            negated = True
        if tok[0].isdigit():
            numbers.add(tok.replace(",", ""))
            words.append(stem)
            continue
        if re.fullmatch(r"\d+(st|nd|rd|th)", stem):
            numbers.add(stem[:-2])
        elif stem in _NUMBER_WORDS:
            soft.add(_NUMBER_WORDS[stem])
        elif stem in _ORDINALS and i > 0:
            soft.add(_ORDINALS[stem])
        elif tok.isupper() and stem in _ROMAN:
            soft.add(_ROMAN[stem])
        # A name: capitalized (or has capitals inside, like "PostgreSQL", "S3"), not a common
        # word that happens to start the sentence.
        elif (tok[0].isupper() or any(c.isupper() for c in tok[1:])) and stem not in _COMMON:
            entities.setdefault(stem)
        words.append(stem)
    return Facts(negated, frozenset(numbers), frozenset(soft), tuple(entities), frozenset(words))


def _acronyms_resolved(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[set[str], set[str]]:
    """Entity sets with acronyms matched to the names they abbreviate ("UK" ~ "United Kingdom").
    Linear in the names: each run of 2-5 names is indexed once by its initials."""
    only_a, only_b = set(a) - set(b), set(b) - set(a)
    for short_side, long_side, long_order in ((only_a, only_b, b), (only_b, only_a, a)):
        shorts = [w for w in short_side if 2 <= len(w) <= 5 and w.isalpha()]
        if not shorts:
            continue
        runs: dict[str, list[int]] = {}  # initials -> where runs with them start
        for n in range(2, 6):
            for i in range(len(long_order) - n + 1):
                runs.setdefault("".join(w[0] for w in long_order[i : i + n]), []).append(i)
        for short in shorts:
            for i in runs.get(short, ())[:_ACRONYM_TRIES]:
                run = long_order[i : i + len(short)]
                if all(w in long_side for w in run):
                    short_side.discard(short)
                    long_side.difference_update(run)
                    break
    return only_a, only_b


_ACRONYM_TRIES = 8  # runs with an acronym's initials tried for it, at most


_ALIASES = {"integer": "int", "dictionary": "dict", "bicycle": "bike", "directory": "folder", "boolean": "bool"}


def _singular(words: frozenset[str]) -> set[str]:
    out = {w[:-1] if w.endswith("s") and not w.endswith("ss") and len(w) > 3 else w for w in words} | set(words)
    return {_ALIASES.get(w, w) for w in out}


_LOCAL_SWAP_TOKENS = 3  # a swap this short (per side), with everything around it the same, is a minimal pair


def _content(words: list[str]) -> set[str]:
    return _singular(frozenset(w for w in words if w not in _COMMON and len(w) > 1))


def _minimal_pair(a: list[str], b: list[str]) -> bool:
    """The same words except one short local swap (or insertion) of content words?"""
    start = 0
    while start < min(len(a), len(b)) and a[start] == b[start]:
        start += 1
    end = 0
    while end < min(len(a), len(b)) - start and a[len(a) - 1 - end] == b[len(b) - 1 - end]:
        end += 1
    middle_a, middle_b = a[start:len(a) - end], b[start:len(b) - end]
    if max(len(middle_a), len(middle_b)) > _LOCAL_SWAP_TOKENS or not (middle_a or middle_b):
        return False
    if any(_OPPOSITE_OF.get(w, set()) & set(middle_b) for w in middle_a):  # "on" / "off" beside another "on"
        return True
    swapped_a, swapped_b = _content(middle_a), _content(middle_b)
    if not middle_a or not middle_b:  # a content word put in: "reverse alphabetical", "bow tie"
        return bool(swapped_a or swapped_b)
    return bool(swapped_a) and bool(swapped_b) and swapped_a != swapped_b  # one swapped for another


def mismatch(cached: str, query: str) -> str | None:
    """Why `cached`'s answer must not serve `query`, or None if the guards pass."""
    a, b = facts(cached), facts(query)
    if a.negated != b.negated:
        return "negation"
    if a.numbers != b.numbers:
        return "numbers"
    # Number words are often not quantities ("one line at a time", "join two strings"):
    # they count only when both questions carry some.
    if (a.numbers | a.soft_numbers) and (b.numbers | b.soft_numbers) and (
        a.numbers | a.soft_numbers != b.numbers | b.soft_numbers
    ):
        return "numbers"
    only_a, only_b = _acronyms_resolved(a.entities, b.entities)
    if only_a or only_b:
        return "entities"
    # "Celsius to Fahrenheit" vs "Fahrenheit to Celsius": same names, opposite direction.
    if len(a.entities) >= 2 and "to" in a.words and "to" in b.words and a.entities != b.entities:
        return "direction"
    words_a, words_b = _singular(a.words), _singular(b.words)
    diff_a, diff_b = words_a - words_b, words_b - words_a
    for word in diff_a:
        if _OPPOSITE_OF.get(word, set()) & diff_b:
            return "contrast"
    tokens_a, tokens_b = [w.lower() for w in _WORD.findall(cached)], [w.lower() for w in _WORD.findall(query)]
    if tokens_a != tokens_b and sorted(tokens_a) == sorted(tokens_b):  # "miles to kilometers" reversed
        return "direction"
    if _minimal_pair(tokens_a, tokens_b):
        return "substitution"
    return None
