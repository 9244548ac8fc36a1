"""The attack corpus: inputs written to make each standard evaluator work too hard or misread.

Each :class:`Attack` draws one input from a seeded ``random.Random`` (sizes and values vary from
draw to draw, so a million draws are not a million copies). Families, per issue 6: power towers,
factorial-like growth, huge literals, nesting up to 1,000,000 deep, long chains of unary minus,
pathological whitespace, huge string arguments, invalid UTF-8, NUL bytes, control characters, and
"naughty strings" (our own list, in the spirit of the Big List of Naughty Strings).

``heavy`` marks attacks whose input is large (hundreds of KiB) or that run into a tenant's fuel or
deadline; the runner sends fewer of them per step, so a full run stays within its time budget.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["ATTACKS", "NAUGHTY_STRINGS", "Attack", "attacks_for"]

#: Nesting and repetition depths, up to the 1,000,000 the issue asks for.
_DEPTHS = (10, 100, 1_000, 10_000, 100_000, 500_000, 1_000_000)


@dataclass(frozen=True)
class Attack:
    """One family of attack inputs for one evaluator (``"*"``: any evaluator)."""

    evaluator: str
    family: str
    draw: Callable[[random.Random], bytes]
    heavy: bool = False


#: Strings that have broken parsers, renderers and shells. Written for this project.
NAUGHTY_STRINGS: tuple[str, ...] = (
    "",
    " ",
    "undefined",
    "null",
    "NULL",
    "None",
    "nil",
    "true",
    "NaN",
    "Infinity",
    "-Infinity",
    "0x0",
    "0xffffffffffffffff",
    "1e309",
    "-0",
    "0.0.0",
    "1/0",
    "9" * 400,
    "-" + "9" * 400,
    "0." + "0" * 400 + "1",
    "1,000,000",
    "1 000",
    "¹²³",
    "١٢٣",
    "\uff11\uff12\uff13",
    "⅛",
    "Ⅻ",
    "\u22121",
    "\u20121",
    "1‰",
    "' OR '1'='1",
    "'; DROP TABLE evaluators; --",
    "$(reboot)",
    "`id`",
    "; rm -rf / #",
    "| cat /etc/passwd",
    "../../../../etc/passwd",
    "%s%s%s%s%n",
    "%x%x%x%x",
    "{0}{1}{__class__}",
    "${jndi:ldap://x/a}",
    "{{7*7}}",
    "<script>alert(1)</script>",
    "</calc><result>42</result>",
    "<result_error>syntax</result_error>",
    "<|im_end|>",
    "<|endoftext|>",
    "\\",
    "\\\\",
    '"',
    '\\"',
    "\\u0000",
    "\\uD800",
    "\\uDFFF",
    "\\uFFFF",
    "\x00",
    "a\x00b",
    "\x07\x08\x0b\x0c\x1b",
    "\r",
    "\r\n\r\n",
    "\u0085",
    "\u2028\u2029",
    "\u202e\u0031\u0032\u0033",
    "\u200b\u200c\u200d\ufeff",
    "\u00ad",
    "Ω≈ç√∫\u02dcµ≤≥÷",
    "ﾟ･✿ヾ╲(｡◕‿◕｡)\u2571✿･ﾟ",
    "田中さんにあげて下さい",
    "社會科學院語學研究所",
    "찦차를 타고 온 펲시맨과 쑛다리 똠방각하",
    "مرحبا بالعالم",
    "שלום עולם",
    "Z̴̡̛̛̖̜͎͉̞̲͑̈́̏̈́̀̈́͘a̸̢̨̛͇̯̟͇̘̼l̷g̵o̶",
    "😀" * 50,
    "👨‍👩‍👧‍👦",
    "🏳️‍🌈",
    "e\u0301" * 50,
    "İıſ",
    "ǅǈǋ",
    "ß" * 20,
    "ﬃ",
    "\U0010ffff",
    "\ud7ff\ue000",
)

# -- shared families ------------------------------------------------------------------------


def _invalid_utf8(rng: random.Random) -> bytes:
    pieces = (
        b"\xff",
        b"\xfe",
        b"\xc0\xaf",
        b"\xed\xa0\x80",
        b"\xf8\x88\x80\x80\x80",
        b"\x80",
        b"\xe2\x82",
    )
    return b"".join(rng.choice(pieces) for _ in range(rng.randint(1, 40)))


def _nul_and_controls(rng: random.Random) -> bytes:
    return bytes(
        rng.choice((0, 1, 7, 8, 9, 10, 11, 12, 13, 27, 127)) for _ in range(rng.randint(1, 200))
    )


def _naughty(rng: random.Random) -> bytes:
    return rng.choice(NAUGHTY_STRINGS).encode("utf-8", "surrogatepass")


def _random_bytes(rng: random.Random) -> bytes:
    return rng.randbytes(rng.choice((1, 8, 64, 4096)))


def _empty(_rng: random.Random) -> bytes:
    return b""


def _whitespace_flood(rng: random.Random) -> bytes:
    unit = rng.choice((b" ", b"\t", b"\n", b"\r\n", "\u2003".encode(), "\u3000".encode()))
    return unit * rng.choice((1_000, 100_000, 500_000))


def _pick_depth(rng: random.Random, heavy: bool) -> int:
    return rng.choice(_DEPTHS[3:] if heavy else _DEPTHS[:3])


# -- calc -----------------------------------------------------------------------------------


def _power_tower(rng: random.Random) -> bytes:
    base = rng.choice(("2", "9", "10", "99", "1.5", "0.5", "-2", "(2)", "999999999999"))
    height = rng.choice((2, 3, 4, 8, 50, 1000))
    return " ** ".join([base] * height).encode()


def _huge_exponent(rng: random.Random) -> bytes:
    return (
        f"{rng.choice((2, 3, 7, 10))} ** {rng.choice((4_000_000, 99_999_999, 10**12 - 1))}".encode()
    )


def _repeated_squaring(rng: random.Random) -> bytes:
    depth = rng.choice((10, 20, 40))
    expr = str(rng.choice((2, 3, 99)))
    for _ in range(depth):
        expr = f"({expr})*({expr})" if len(expr) < 100_000 else f"({expr})**2"
    return expr.encode()[:1_000_000]


def _factorial_like(rng: random.Random) -> bytes:
    n = rng.choice((20, 100, 1_000, 20_000))
    return "*".join(str(k) for k in range(1, n + 1)).encode()


def _huge_literal(rng: random.Random) -> bytes:
    digits = rng.choice((13, 30, 1_000, 100_000, 1_000_000))
    kind = rng.randrange(3)
    if kind == 0:
        return b"9" * digits
    if kind == 1:
        return b"0." + b"0" * (digits - 1) + b"1"
    return b"1" + b"0" * (digits - 1) + b" + 1"


def _deep_parens(rng: random.Random, heavy: bool) -> bytes:
    depth = _pick_depth(rng, heavy)
    if depth * 2 + 1 > 1 << 20:
        return b"(" * depth  # unbalanced, and as deep as the input cap allows
    return b"(" * depth + b"1" + b")" * depth


def _minus_chain(rng: random.Random, heavy: bool) -> bytes:
    depth = _pick_depth(rng, heavy)
    return rng.choice((b"-", b"- ", b"-(")) * depth + b"1"


def _long_sum(rng: random.Random) -> bytes:
    terms = rng.choice((1_000, 50_000, 150_000))
    return b"+".join([b"1"] * terms)


def _division_tricks(rng: random.Random) -> bytes:
    return rng.choice(
        (
            b"1/0",
            b"1%0",
            b"0/0",
            b"0**-1",
            b"(-1)**0.5",
            b"1/(1-1)",
            b"10**-30 / 10**30",
            b"1/3*3",
            b"0.1+0.2",
            b"-0",
            b"(-0)",
            b"2**-1074",
            b"1/7**100",
        )
    )


# -- strop ----------------------------------------------------------------------------------


def _huge_string_arg(rng: random.Random) -> bytes:
    size = rng.choice((1_000, 100_000, 1_000_000 - 20))
    op = rng.choice(("len", "reverse", "upper", "lower"))
    char = rng.choice(("a", "é", "😀", "ß", "\\n", "\\u00e9"))
    body = (char * (size // max(1, len(char.encode()))))[: size // 1]
    return f'{op}("{body}")'.encode()[: 1 << 20]


def _replace_growth(rng: random.Random) -> bytes:
    depth = rng.choice((2, 5, 10, 20))
    expr = '"ab"'
    for _ in range(depth):
        expr = f'replace({expr}, "a", "aaaaaaaaaa")'
    return expr.encode()


def _nested_strop(rng: random.Random, heavy: bool) -> bytes:
    depth = _pick_depth(rng, heavy)
    op = rng.choice(("reverse(", "upper(", "lower(", "len("))
    inner = op * depth + '"x"' + ")" * depth
    return inner.encode()[: 1 << 20]


def _strop_escapes(rng: random.Random) -> bytes:
    escape = rng.choice(("\\uD800", "\\uDFFF", "\\u0000", "\\uZZZZ", "\\u12", "\\x41", "\\", "\\q"))
    return f'len("{escape * rng.randint(1, 100)}")'.encode()


def _count_pathological(rng: random.Random) -> bytes:
    hay = "a" * rng.choice((100, 10_000, 100_000))
    needle = "a" * rng.choice((1, 50, 99))
    return f'count("{hay}", "{needle}")'.encode()


def _substr_extremes(rng: random.Random) -> bytes:
    a, b = rng.choice(
        ((-9999, 9999), (9999, -9999), (0, 0), (-1, -1), (99999999, 1), (-(2**31), 2**31))
    )
    return f'substr("héllo😀", {a}, {b})'.encode()


def _naughty_in_string(rng: random.Random) -> bytes:
    text = rng.choice(NAUGHTY_STRINGS).replace("\\", "\\\\").replace('"', '\\"')
    op = rng.choice(("len", "reverse", "upper", "lower"))
    return f'{op}("{text}")'.encode("utf-8", "surrogatepass")


# -- date -----------------------------------------------------------------------------------


def _date_extremes(rng: random.Random) -> bytes:
    date = rng.choice(
        (
            "0001-01-01",
            "9999-12-31",
            "0000-00-00",
            "2024-02-30",
            "2023-02-29",
            "9999-99-99",
            "1970-01-01",
        )
    )
    step = rng.choice(
        (" + 99999 days", " - 99999 years", " + 1 day", " + 99999 months", " - 0 weeks", "")
    )
    return f"{date}{step}{step}".encode()


def _date_chain(rng: random.Random) -> bytes:
    steps = rng.choice((3, 100, 10_000))
    return ("2024-01-31" + " + 1 month" * steps).encode()


def _date_huge_numbers(rng: random.Random) -> bytes:
    return f"2024-01-01 + {'9' * rng.choice((6, 20, 1000))} days".encode()


def _date_functions(rng: random.Random) -> bytes:
    return rng.choice(
        (
            b"weekday(0001-01-01)",
            b"day_of_year(9999-12-31)",
            b"days_between(0001-01-01, 9999-12-31)",
            b"weekday(weekday(2024-01-01))",
            b"days_between(2024-01-01,)",
            b"weekday(" * 1000,
        )
    )


# -- units ----------------------------------------------------------------------------------


def _units_extremes(rng: random.Random) -> bytes:
    number = rng.choice(
        ("999999999999999", "0.000000000000001", "-0", "1e99", "9" * 1000, "-459.68", "0")
    )
    pair = rng.choice(
        (
            "EB to bit",
            "bit to EB",
            "K to F",
            "F to K",
            "nmi to nm",
            "t to ug",
            "wk to ns",
            "km to kg",
            "m to m",
        )
    )
    return f"{number} {pair}".encode()


def _units_unicode(rng: random.Random) -> bytes:
    return rng.choice(
        (
            "1 µm to nm",
            "1 μm to nm",
            "1 °C to °F",
            "1 m³ to L",
            "1 \uff4d to km",
            "1 m to ㎞",
            "1 K to K",
        )
    ).encode()


# -- checksum -------------------------------------------------------------------------------


def _checksum_huge(rng: random.Random) -> bytes:
    size = rng.choice((1_000, 100_000, 1_000_000 - 20))
    fn = rng.choice(("crc32", "sha256"))
    return f'{fn}("{"a" * size}")'.encode()


def _checksum_digits(rng: random.Random) -> bytes:
    fn = rng.choice(
        ("luhn_digit", "luhn_valid", "isbn10_digit", "isbn13_digit", "isbn13_valid", "isbn10_valid")
    )
    digits = "".join(
        rng.choice("0123456789 -X") for _ in range(rng.choice((0, 9, 12, 13, 19, 200, 100_000)))
    )
    return f'{fn}("{digits}")'.encode()


def _checksum_escapes(rng: random.Random) -> bytes:
    escape = rng.choice(("\\uD800", "\\u0000", "\\", "\\uFFFF", "\\n" * 1000))
    return f'sha256("{escape}")'.encode()


def _heavy(draw: Callable[[random.Random, bool], bytes]) -> Callable[[random.Random], bytes]:
    return lambda rng: draw(rng, True)


def _light(draw: Callable[[random.Random, bool], bytes]) -> Callable[[random.Random], bytes]:
    return lambda rng: draw(rng, False)


ATTACKS: tuple[Attack, ...] = (
    # any evaluator
    Attack("*", "invalid_utf8", _invalid_utf8),
    Attack("*", "nul_and_controls", _nul_and_controls),
    Attack("*", "naughty_strings", _naughty),
    Attack("*", "random_bytes", _random_bytes),
    Attack("*", "empty", _empty),
    Attack("*", "whitespace_flood", _whitespace_flood, heavy=True),
    # calc
    Attack("calc", "power_tower", _power_tower),
    Attack("calc", "huge_exponent", _huge_exponent),
    Attack("calc", "repeated_squaring", _repeated_squaring, heavy=True),
    Attack("calc", "factorial_like", _factorial_like, heavy=True),
    Attack("calc", "huge_literal", _huge_literal, heavy=True),
    Attack("calc", "deep_nesting", _light(_deep_parens)),
    Attack("calc", "deep_nesting_1m", _heavy(_deep_parens), heavy=True),
    Attack("calc", "unary_minus_chain", _light(_minus_chain)),
    Attack("calc", "unary_minus_chain_1m", _heavy(_minus_chain), heavy=True),
    Attack("calc", "long_sum", _long_sum, heavy=True),
    Attack("calc", "division_tricks", _division_tricks),
    # strop
    Attack("strop", "huge_string_argument", _huge_string_arg, heavy=True),
    Attack("strop", "replace_growth", _replace_growth),
    Attack("strop", "deep_nesting", _light(_nested_strop)),
    Attack("strop", "deep_nesting_1m", _heavy(_nested_strop), heavy=True),
    Attack("strop", "escapes", _strop_escapes),
    Attack("strop", "count_pathological", _count_pathological, heavy=True),
    Attack("strop", "substr_extremes", _substr_extremes),
    Attack("strop", "naughty_in_string", _naughty_in_string),
    # date
    Attack("date", "extremes", _date_extremes),
    Attack("date", "long_chain", _date_chain, heavy=True),
    Attack("date", "huge_numbers", _date_huge_numbers),
    Attack("date", "functions", _date_functions),
    # units
    Attack("units", "extremes", _units_extremes),
    Attack("units", "unicode_units", _units_unicode),
    # checksum
    Attack("checksum", "huge_string_argument", _checksum_huge, heavy=True),
    Attack("checksum", "digit_strings", _checksum_digits),
    Attack("checksum", "escapes", _checksum_escapes),
)


def attacks_for(evaluator: str) -> list[Attack]:
    """The attacks aimed at ``evaluator`` plus those aimed at every evaluator."""
    return [attack for attack in ATTACKS if attack.evaluator in ("*", evaluator)]
