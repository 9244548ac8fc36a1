"""The native parts of evald: the GIL-free epoch ticker (evald/host/_epoch.c) and the reset loop
of fresh isolation (evald/host/_reset.c).

Everything else is declared in pyproject.toml. Both extensions are optional: where they cannot
be built the daemon falls back to a Python ticker thread and logs a warning (deadlines then
depend on the GIL, see docs/daemon.md), and to the same reset loop in Python (slower). ``EVALD_PURE=1`` leaves it out on purpose: a pure
Python wheel for images that run only the engine adapter (deploy/container/sglang-evald).
"""

import os

from setuptools import Extension, setup

NATIVE = [
    Extension(
        "evald.host._epoch",
        sources=["evald/host/_epoch.c"],
        extra_compile_args=["-O2", "-std=c11", "-Wall"],
        optional=True,
    ),
    Extension(
        "evald.host._reset",
        sources=["evald/host/_reset.c"],
        extra_compile_args=["-O2", "-std=c11", "-Wall"],
        optional=True,
    ),
]

setup(ext_modules=[] if os.environ.get("EVALD_PURE") == "1" else NATIVE)
