"""Mutated module bytes, for registration fuzzing: the validator must refuse what is broken and
nothing may crash the worker that compiles it."""

from __future__ import annotations

import random

__all__ = ["mutated_module"]


def mutated_module(base: bytes, rng: random.Random) -> bytes:
    """``base`` with a few bytes flipped, cut or inserted past its 8-byte header."""
    data = bytearray(base)
    for _ in range(rng.randint(1, 4)):
        choice = rng.randrange(4)
        index = rng.randrange(8, len(data)) if len(data) > 8 else 0
        if choice == 0:
            data[index] ^= 1 << rng.randrange(8)
        elif choice == 1:
            data[index] = rng.randrange(256)
        elif choice == 2:
            del data[index : index + rng.randint(1, 16)]
        else:
            data[index:index] = rng.randbytes(rng.randint(1, 16))
    return bytes(data)
