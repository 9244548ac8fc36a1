"""The product does not contain, ship or import its lab (``lab/``, the ``evald-lab``
distribution), and says how to get the lab's commands when it is not installed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from setuptools import find_namespace_packages

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("evald", "engine_adapter", "evaluators_wasm")
#: What only the lab holds: no product module may be named like these.
LAB_NAMES = ("evald_lab", "fuzz", "bench", "study", "demo", "gpu_check")

#: Runs in a fresh interpreter; ``sys.modules["evald_lab"] = None`` makes any import of the lab
#: fail, as when it is not installed.
BLOCK_LAB = "import sys\nsys.modules['evald_lab'] = None\n"


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_the_wheel_packages_are_the_products_only() -> None:
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    packages = find_namespace_packages(where=str(ROOT), include=find["find"]["include"])
    assert {"evald", "engine_adapter", "evaluators_wasm"} <= set(packages)
    assert all(package.split(".")[0] in PRODUCT for package in packages), packages
    for package in packages:
        folder = ROOT / package.replace(".", "/")
        names = {path.stem.lstrip("_") for path in folder.glob("*.py")} | {package.split(".")[-1]}
        assert not names & {name.lstrip("_") for name in LAB_NAMES}, (package, names)


def test_every_product_module_imports_without_the_lab() -> None:
    """Each product module imports with the lab blocked, and none pulls the lab in (checked also
    when the lab is importable: a lazy import would show in ``sys.modules``)."""
    code = textwrap.dedent(
        """
        import importlib, pkgutil, sys
        block = sys.argv[1] == "block"
        if block:
            sys.modules["evald_lab"] = None
        failed, skipped = [], []
        for top in ("evald", "engine_adapter", "evaluators_wasm"):
            package = importlib.import_module(top)
            for info in pkgutil.walk_packages(package.__path__, top + "."):
                if info.name.endswith(".__main__"):  # runs a command when imported
                    continue
                try:
                    importlib.import_module(info.name)
                except ModuleNotFoundError as exc:
                    # An optional engine's own package (vllm, sglang) may be absent here.
                    if (exc.name or "").split(".")[0] in ("vllm", "sglang"):
                        skipped.append(info.name)
                    else:
                        failed.append(f"{info.name}: {exc!r}")
                except ImportError as exc:
                    failed.append(f"{info.name}: {exc!r}")
        loaded = sorted(n for n, m in sys.modules.items() if n.startswith("evald_lab") and m)
        print("imported; skipped", skipped)
        assert not failed, failed
        assert not loaded, loaded
        """
    )
    for mode in ("block", "allow"):
        result = subprocess.run(
            [sys.executable, "-c", code, mode],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, f"{mode}: {result.stdout}{result.stderr}"


@pytest.mark.parametrize(
    ("cli", "argv"),
    [
        ("evald.cli", ["fuzz", "--profile", "short"]),
        ("evald.cli", ["bench", "overhead", "--profile", "tiny"]),
        ("engine_adapter.cli", ["study", "--profile", "tiny"]),
        ("engine_adapter.cli", ["bench", "decode", "--profile", "tiny"]),
    ],
)
def test_a_lab_command_without_the_lab_says_how_to_install_it(cli: str, argv: list[str]) -> None:
    result = _python(
        BLOCK_LAB + f"from {cli} import main\nsys.exit(main({argv!r}))\n",
    )
    assert result.returncode == 2, result.stderr
    assert "comes with the evald-lab package" in result.stderr
    assert "pip install -e ./lab" in result.stderr
    assert "usage:" not in result.stderr  # a hint, not an argparse wall
    assert "Traceback" not in result.stderr


def test_the_products_own_commands_work_without_the_lab() -> None:
    result = _python(BLOCK_LAB + "from evald.cli import main\nsys.exit(main(['--help']))\n")
    assert result.returncode == 0, result.stderr
    assert "serve" in result.stdout and "fuzz" not in result.stdout
    result = _python(
        BLOCK_LAB + "from engine_adapter.cli import main\nsys.exit(main(['--help']))\n"
    )
    assert result.returncode == 0, result.stderr
    assert "generate" in result.stdout and "study" not in result.stdout


def test_the_installed_lab_adds_its_commands() -> None:
    """With the lab installed (``make setup``), its commands reach both CLIs by entry points."""
    result = _python("from evald.cli import main\nimport sys\nsys.exit(main(['--help']))\n")
    assert result.returncode == 0 and "fuzz" in result.stdout and "bench" in result.stdout
    result = _python(
        "from engine_adapter.cli import main\nimport sys\nsys.exit(main(['--help']))\n"
    )
    assert result.returncode == 0 and "study" in result.stdout and "bench" in result.stdout
