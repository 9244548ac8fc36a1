"""The one native part of evald: the GIL-free epoch ticker (evald/host/_epoch.c).

Everything else is declared in pyproject.toml. The extension is optional: where it cannot be
built the daemon falls back to a Python ticker thread and logs a warning (deadlines then
depend on the GIL, see docs/daemon.md). ``EVALD_PURE=1`` leaves it out on purpose: a pure
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
    )
]

setup(ext_modules=[] if os.environ.get("EVALD_PURE") == "1" else NATIVE)
