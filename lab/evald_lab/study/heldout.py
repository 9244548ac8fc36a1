"""The held-out problem set: questions worded unlike the manifests' examples and unlike the
templates of :mod:`evald_lab.study.items`, to ask what a model sets up off the page it was
shown.

Both tasks ask what the original set asks (the same six kinds of arithmetic, letter counting),
in new wordings and sentence orders (the question first in some, the operands out of the order
of the expression in others), and:

- **numbers written as words** in a third of the arithmetic items (every number of the item,
  distractor included: ``thirty-eight rows of twenty-seven chairs``);
- **a distractor** in a third of the items, independently: a sentence with a number the
  answer does not use (``The hall was built in 1987.``), or, for letters, another word
  (``My sister's favourite word is "pelican".``), placed before or after the facts. A
  distractor never equals an operand or the answer, so a span that uses it is wrong.

Each item's ``params`` record the operands (``operands``), the distractor (``distractor``,
``None`` without one) and whether the numbers are in words (``words``), so the study can ask
whether a span used the distractor.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable

from evald_lab.study.items import StudyItem
from evald_lab.study.words import STUDY_WORDS

__all__ = [
    "HELDOUT_ARITHMETIC_TEMPLATES",
    "HELDOUT_LETTER_TEMPLATES",
    "heldout_arithmetic_items",
    "heldout_letter_items",
    "number_in_words",
]

_Wording = tuple[str, str]
#: Per kind: (text, the expression of its answer). ``{a}``… are the operands; the question comes
#: first in some, and the operands are not always in the expression's order.
HELDOUT_ARITHMETIC_TEMPLATES: dict[str, tuple[_Wording, ...]] = {
    "sum": (
        ("How many stickers does Ada own now, if she owned {a} and her cousin handed her {b}?",
         "{a} + {b}"),
        ("Two lorries brought bricks to the site: the first carried {a} and the second {b}. "
         "Find the number of bricks delivered.", "{a} + {b}"),
        ("{b} new singers joined a choir that already counted {a} members. What is the size "
         "of the choir now?", "{a} + {b}"),
    ),
    "difference": (
        ("What remains of a budget of {a} pounds once {b} pounds have been spent?",
         "{a} - {b}"),
        ("A ferry has room for {a} cars and {b} cars are already aboard. How many more cars "
         "fit?", "{a} - {b}"),
        ("After giving {b} of her {a} postcards to friends, how many postcards does Lena "
         "keep?", "{a} - {b}"),
    ),
    "product_sum": (
        ("Each of {a} coaches seats {b} pupils, and {c} pupils travel by car. How many pupils "
         "go on the trip?", "{a} * {b} + {c}"),
        ("Find the number of tiles: {c} loose tiles lie next to {a} boxes that hold {b} tiles "
         "apiece.", "{a} * {b} + {c}"),
        ("How many tulips are planted when a gardener sets out {a} beds of {b} bulbs and adds "
         "{c} bulbs by the gate?", "{a} * {b} + {c}"),
    ),
    "product_difference": (
        ("From {a} packs of {b} batteries, {c} batteries turn out to be dead. How many "
         "batteries work?", "{a} * {b} - {c}"),
        ("How many eggs stay whole when {c} of the eggs in {a} cartons of {b} crack?",
         "{a} * {b} - {c}"),
        ("{a} classrooms receive {b} new books each; later {c} of the books are sent back as "
         "damaged. How many books are kept?", "{a} * {b} - {c}"),
    ),
    "two_step": (
        ("Every day a cafe sells {a} muffins and {b} scones. What is the total number of "
         "pastries it sells over {c} days?", "({a} + {b}) * {c}"),
        ("What does a group pay for {a} adult tickets at {b} euros and {c} student tickets at "
         "{d} euros?", "{a} * {b} + {c} * {d}"),
        ("For {c} weeks a workshop builds {a} chairs and {b} stools a week. How many pieces "
         "of furniture does it build?", "({a} + {b}) * {c}"),
    ),
    "division": (
        ("How many crates are needed to pack {a} melons, {b} to a crate?", "{a} / {b}"),
        ("Shared out evenly, {a} marbles go to {b} children. How many marbles does each child "
         "receive?", "{a} / {b}"),
        ("A report of {a} pages is split equally among {b} authors. How many pages does each "
         "author write?", "{a} / {b}"),
    ),
}

#: Sentences with a number the answer does not use, and the range it is drawn from.
_NUMBER_DISTRACTORS: tuple[tuple[str, int, int], ...] = (
    ("The hall was built in {x}.", 1950, 2020),
    ("It was {x} degrees outside that afternoon.", 5, 35),
    ("The count was written on page {x} of a notebook.", 2, 300),
    ("The owner is {x} years old.", 19, 90),
    ("This happened on bus route {x}.", 2, 99),
)

#: Same draws as the original set, so the two sets differ in wording only.
_DRAWS: dict[str, Callable[[random.Random], dict[str, int]]] = {
    "sum": lambda r: {"a": r.randint(100, 3000), "b": r.randint(20, 2000)},
    "difference": lambda r: (lambda a: {"a": a, "b": r.randint(10, a - 10)})(r.randint(200, 5000)),
    "product_sum": lambda r: {"a": r.randint(3, 60), "b": r.randint(3, 60), "c": r.randint(2, 400)},
    "product_difference": lambda r: (
        lambda a, b: {"a": a, "b": b, "c": r.randint(2, a * b - 1)}
    )(r.randint(3, 60), r.randint(3, 60)),
    "two_step": lambda r: {
        "a": r.randint(3, 90),
        "b": r.randint(3, 90),
        "c": r.randint(2, 30),
        "d": r.randint(2, 30),
    },
    "division": lambda r: (lambda b, q: {"a": b * q, "b": b})(r.randint(2, 25), r.randint(3, 200)),
}

HELDOUT_LETTER_TEMPLATES: tuple[str, ...] = (
    "Spell out the word {word} and tell me how often the letter {letter} shows up.",
    "{word} - how many copies of the letter {letter} does it contain?",
    "Tally the occurrences of '{letter}' within the word {word}.",
    "If you write {word}, how many times do you write the letter {letter}?",
    'How frequently does {letter} appear when spelling "{word}"?',
    "Looking at the word {word}, count its {letter}'s.",
)

_WORD_DISTRACTORS: tuple[str, ...] = (
    'My sister\'s favourite word is "{other}".',
    "Yesterday I read about a {other}.",
    "(The previous question was about {other}.)",
)

_ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen"
).split()
_TENS = "twenty thirty forty fifty sixty seventy eighty ninety".split()


def number_in_words(n: int) -> str:
    """English words for ``0 <= n < 1,000,000`` (``2341`` → ``two thousand three hundred and
    forty-one``): the form the operands option reads back to digits."""
    if not 0 <= n < 1_000_000:
        raise ValueError(f"{n} is out of range")
    if n < 20:
        return _ONES[n]
    if n < 100:
        tens, ones = divmod(n, 10)
        return _TENS[tens - 2] + (f"-{_ONES[ones]}" if ones else "")
    if n < 1000:
        hundreds, rest = divmod(n, 100)
        return f"{_ONES[hundreds]} hundred" + (f" and {number_in_words(rest)}" if rest else "")
    thousands, rest = divmod(n, 1000)
    head = f"{number_in_words(thousands)} thousand"
    if not rest:
        return head
    joiner = " and " if rest < 100 else " "
    return f"{head}{joiner}{number_in_words(rest)}"


def _with_distractor(rng: random.Random, text: str, sentence: str) -> str:
    """``sentence`` before the text or before its last sentence (the question)."""
    if rng.random() < 0.5:
        return f"{sentence} {text}"
    cut = max(text.rfind(". ", 0, len(text) - 1), text.rfind("; ", 0, len(text) - 1))
    if cut < 0:
        return f"{text} {sentence}"
    return f"{text[: cut + 1]} {sentence} {text[cut + 2 :]}"


def heldout_arithmetic_items(n: int, seed: int) -> list[StudyItem]:
    """``n`` word problems; item ``i`` is of kind ``i mod 6``; numbers in words in one item of
    three and a distractor in one of three, drawn independently (see the module doc)."""
    from evaluators_wasm.reference import reference

    calc = reference("calc")
    rng = random.Random(f"heldout-arithmetic:{seed}")
    kinds = list(HELDOUT_ARITHMETIC_TEMPLATES)
    items = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        wording = rng.randrange(len(HELDOUT_ARITHMETIC_TEMPLATES[kind]))
        text, expression = HELDOUT_ARITHMETIC_TEMPLATES[kind][wording]
        numbers = _DRAWS[kind](rng)
        filled = expression.format(**numbers)
        truth = calc(filled.encode())
        words = rng.random() < 1 / 3
        shown = {k: number_in_words(v) if words else str(v) for k, v in numbers.items()}
        prompt = text.format(**shown)
        distractor = None
        if rng.random() < 1 / 3:
            taken = {*numbers.values(), int(truth)}
            template, low, high = rng.choice(_NUMBER_DISTRACTORS)
            distractor = rng.randint(low, high)
            while distractor in taken:
                distractor += 1
            sentence = template.format(x=number_in_words(distractor) if words else distractor)
            prompt = _with_distractor(rng, prompt, sentence)
        variant = ("words" if words else "digits") + ("+distractor" if distractor else "")
        items.append(
            StudyItem(
                "arithmetic",
                i,
                prompt,
                truth,
                {
                    **numbers,
                    "expression": filled,
                    "operands": sorted(numbers[k] for k in re.findall(r"\{(\w)\}", expression)),
                    "distractor": distractor,
                    "words": words,
                },
                f"{kind}/{wording + 1}/{variant}",
            )
        )
    return items


def heldout_letter_items(n: int, seed: int) -> list[StudyItem]:
    """``n`` letter-counting questions in :data:`HELDOUT_LETTER_TEMPLATES`; the letter occurs
    in the word four times out of five; another word as a distractor in one item of three."""
    rng = random.Random(f"heldout-letters:{seed}")
    words = list(STUDY_WORDS)
    rng.shuffle(words)
    items = []
    for i in range(n):
        word = words[i % len(words)]
        if rng.random() < 0.8:
            letter = rng.choice(sorted(set(word)))
        else:
            letter = rng.choice([c for c in "abcdefghijklmnopqrstuvwxyz" if c not in word])
        phrasing = i % len(HELDOUT_LETTER_TEMPLATES)
        prompt = HELDOUT_LETTER_TEMPLATES[phrasing].format(letter=letter, word=word)
        distractor = None
        if rng.random() < 1 / 3:
            distractor = rng.choice([w for w in STUDY_WORDS if w != word])
            sentence = rng.choice(_WORD_DISTRACTORS).format(other=distractor)
            prompt = f"{sentence} {prompt}" if rng.random() < 0.5 else f"{prompt} {sentence}"
        items.append(
            StudyItem(
                "letters",
                i,
                prompt,
                str(word.count(letter)),
                {"word": word, "letter": letter, "distractor": distractor},
                f"phrasing/{phrasing + 1}/{'distractor' if distractor else 'plain'}",
            )
        )
    return items
