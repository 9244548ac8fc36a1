"""The accuracy study's questions: seeded, several templates per task, truth computed in code.

**arithmetic**: six kinds, each in three wordings with their own settings (a library, a tank, a
theater, a printer, a bus, …), numbers up to a few thousand: ``sum`` (``a + b``), ``difference``
(``a - b``), ``product_sum`` (``a * b + c``), ``product_difference`` (``a * b - c``), ``two_step``
(``(a + b) * c`` or ``a * b + c * d``) and ``division`` (``a / b``, exact). Items cycle through the
kinds (each kind gets n/6 items) and draw a wording and numbers at random.

**letters**: five phrasings of "how many times does letter L occur in word W" (quoted and bare
words and letters) over :data:`~evald_lab.study.words.STUDY_WORDS`; the letter occurs in the
word four times out of five.

None of the wordings is one of the manifests' examples (``evaluators_wasm/src/*/manifest.json``):
the study asks whether a model that has seen those examples sets up problems worded differently.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from evald_lab.study.words import STUDY_WORDS

__all__ = [
    "ARITHMETIC_TEMPLATES",
    "LETTER_TEMPLATES",
    "NUMBER_DRAWS",
    "StudyItem",
    "arithmetic_items",
    "letter_items",
]


@dataclass(frozen=True)
class StudyItem:
    """One question. ``truth`` is the canonical answer as the evaluator would print it;
    ``template`` is ``KIND/WORDING`` (``product_sum/2``)."""

    task: str
    item_id: int
    prompt: str
    truth: str
    params: dict[str, Any]
    template: str = ""


# Each wording: (text with {a} {b} {c} {d}, the expression of its answer).
_Wording = tuple[str, str]
ARITHMETIC_TEMPLATES: dict[str, tuple[_Wording, ...]] = {
    "sum": (
        ("A library had {a} books and bought {b} more. How many books does it have now?",
         "{a} + {b}"),
        ("On Monday {a} people visited the museum and on Tuesday {b} people did. How many "
         "visitors came on the two days?", "{a} + {b}"),
        ("A farmer picked {a} apples in the morning and {b} in the afternoon. How many apples "
         "did the farmer pick in total?", "{a} + {b}"),
    ),
    "difference": (
        ("A school had {a} chairs. {b} of them were broken and thrown away. How many chairs "
         "are left?", "{a} - {b}"),
        ("A tank holds {a} litres of water. After {b} litres are used, how many litres "
         "remain?", "{a} - {b}"),
        ("Maria saved {a} dollars and spent {b} dollars on a bike. How many dollars does she "
         "have left?", "{a} - {b}"),
    ),
    "product_sum": (
        ("A theater has {a} rows with {b} seats in each row, plus {c} extra seats at the back. "
         "How many seats are there?", "{a} * {b} + {c}"),
        ("A baker fills {a} trays with {b} rolls each and then bakes {c} more rolls. How many "
         "rolls does the baker make?", "{a} * {b} + {c}"),
        ("There are {a} shelves with {b} jars on each shelf, and {c} jars on the floor. How "
         "many jars are there altogether?", "{a} * {b} + {c}"),
    ),
    "product_difference": (
        ("A warehouse stores {a} crates with {b} bottles in each crate. {c} bottles break. How "
         "many bottles are not broken?", "{a} * {b} - {c}"),
        ("A printer prints {a} pages a minute for {b} minutes, but {c} pages jam. How many "
         "good pages are printed?", "{a} * {b} - {c}"),
        ("A club orders {a} boxes of {b} T-shirts and gives away {c} T-shirts. How many "
         "T-shirts are left?", "{a} * {b} - {c}"),
    ),
    "two_step": (
        ("A shop sells {a} red pens and {b} blue pens each day. How many pens does it sell in "
         "{c} days?", "({a} + {b}) * {c}"),
        ("On a bus, {a} adults pay {b} dollars each and {c} children pay {d} dollars each. How "
         "many dollars do they pay in total?", "{a} * {b} + {c} * {d}"),
        ("Each week Tom runs {a} km on Saturday and {b} km on Sunday. How many km does he run "
         "in {c} weeks?", "({a} + {b}) * {c}"),
    ),
    "division": (
        ("{a} cookies are packed into bags of {b}. How many bags are filled?", "{a} / {b}"),
        ("A rope {a} metres long is cut into {b} equal pieces. How many metres long is each "
         "piece?", "{a} / {b}"),
        ("{a} students are split equally into {b} teams. How many students are in each team?",
         "{a} / {b}"),
    ),
}

#: Number draws per kind: each returns the template's fields (the held-out set draws the same).
NUMBER_DRAWS: dict[str, Callable[[random.Random], dict[str, int]]] = {
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

LETTER_TEMPLATES: tuple[str, ...] = (
    'How many times does the letter "{letter}" appear in the word "{word}"?',
    "How many {letter}'s are in the word {word}?",
    'Count the letter {letter} in "{word}".',
    'In the word "{word}", how many times does "{letter}" occur?',
    "What is the number of times {letter} is used in {word}?",
)


def arithmetic_items(n: int, seed: int) -> list[StudyItem]:
    """``n`` word problems; item ``i`` is of kind ``i mod 6`` (see the module doc)."""
    from evaluators_wasm.reference import reference

    calc = reference("calc")
    rng = random.Random(f"arithmetic:{seed}")
    kinds = list(ARITHMETIC_TEMPLATES)
    items = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        wording = rng.randrange(len(ARITHMETIC_TEMPLATES[kind]))
        text, expression = ARITHMETIC_TEMPLATES[kind][wording]
        numbers = NUMBER_DRAWS[kind](rng)
        filled = expression.format(**numbers)
        items.append(
            StudyItem(
                "arithmetic",
                i,
                text.format(**numbers),
                calc(filled.encode()),
                {**numbers, "expression": filled},
                f"{kind}/{wording + 1}",
            )
        )
    return items


def letter_items(n: int, seed: int) -> list[StudyItem]:
    """``n`` letter-counting questions: distinct words while they last, then words again with
    other letters; phrasings cycle, the letter occurs four times out of five."""
    rng = random.Random(f"letters:{seed}")
    words = list(STUDY_WORDS)
    rng.shuffle(words)
    items = []
    for i in range(n):
        word = words[i % len(words)]
        present = sorted(set(word))
        if rng.random() < 0.8:
            letter = rng.choice(present)
        else:
            letter = rng.choice([c for c in "abcdefghijklmnopqrstuvwxyz" if c not in word])
        phrasing = i % len(LETTER_TEMPLATES)
        prompt = LETTER_TEMPLATES[phrasing].format(letter=letter, word=word)
        items.append(
            StudyItem(
                "letters",
                i,
                prompt,
                str(word.count(letter)),
                {"word": word, "letter": letter},
                f"phrasing/{phrasing + 1}",
            )
        )
    return items
