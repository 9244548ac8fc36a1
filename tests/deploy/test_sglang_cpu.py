"""The SGLang CPU venv's own files (deploy/sglang-cpu/): the kernel source it carries, with its
licence, the build option its CMake patch adds (the install runs in `make sglang-test`), and
the shell scripts' pipelines under ``pipefail``."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "deploy" / "sglang-cpu"
TARBALL = HERE / "sgl-kernel-cpu-src.tar.gz"
#: docs/sglang.md names this source; a changed tarball must change the docs with it.
TARBALL_SHA256 = "54a2778a77b994a55307e386d503011db8539af851f9306f791b5f483b7838f7"


def test_the_kernel_source_is_the_documented_one_with_its_licence() -> None:
    assert hashlib.sha256(TARBALL.read_bytes()).hexdigest() == TARBALL_SHA256
    with tarfile.open(TARBALL) as archive:
        names = set(archive.getnames())
    for required in ("LICENSE", "THIRDPARTYNOTICES.txt", "csrc/cpu/CMakeLists.txt"):
        assert f"sgl-kernel-cpu-src/{required}" in names
    docs = (HERE.parents[1] / "docs" / "sglang.md").read_text()
    assert "7f8f030000b628ea2cb033e7457a13dd0ac80f99" in docs and "Apache-2.0" in docs


def patch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(HERE / "patch_sglang.py"), *args],
        capture_output=True,
        text=True,
        check=False,
    )


def test_the_cmake_patch_adds_the_x86_64_v3_build_once(tmp_path: Path) -> None:
    with tarfile.open(TARBALL) as archive:
        archive.extractall(tmp_path, filter="data")
    source = tmp_path / "sgl-kernel-cpu-src"
    cmake = source / "csrc" / "cpu" / "CMakeLists.txt"
    pristine = cmake.read_text()
    first = patch("kernel-cmake", str(source))
    assert first.returncode == 0 and "applied" in first.stdout, first.stderr
    patched = cmake.read_text()
    assert "SGL_KERNEL_CPU_X86_V3" in patched and "-march=x86-64-v3" in patched
    assert "-march=x86-64-v4" in patched  # the AMX build keeps the kernel's own flags
    assert patched.count("\n") == pristine.count("\n") + 3  # three lines added, none changed
    again = patch("kernel-cmake", str(source))
    assert again.returncode == 0 and "already applied" in again.stdout
    assert cmake.read_text() == patched
    cmake.write_text("project(other)\n")
    refused = patch("kernel-cmake", str(source))
    assert refused.returncode == 1 and "not the kernel source" in refused.stderr


#: A pipeline whose last command stops reading before the end (``head``, ``grep -q``/``-m``, an
#: awk program that exits outside its END block) can end the writer with SIGPIPE; under
#: ``set -o pipefail`` that is the pipeline's status, so the script fails or takes the wrong
#: branch depending on timing (the install once failed with exit 141 on
#: ``ldconfig -p | awk '… {print; exit}'``).
_EARLY_READER = re.compile(r"\|\s*(head\b|grep\s+-\w*[qm])")
_AWK_PROGRAM = re.compile(r"\|\s*awk\s+'([^']*)'")
_AWK_END_BLOCK = re.compile(r"\bEND\s*\{[^}]*\}")


@pytest.mark.parametrize(
    "script", ["deploy/sglang-cpu/install.sh", "deploy/gpu-check.sh", ".ci/run"]
)
def test_no_pipeline_under_pipefail_stops_reading_early(script: str) -> None:
    text = (ROOT / script).read_text()
    assert "pipefail" in text
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("#"):
            continue
        early = _EARLY_READER.search(line)
        assert early is None, f"{script}:{number}: {early.group(0)!r} can SIGPIPE its writer"
        for program in _AWK_PROGRAM.findall(line):
            body = _AWK_END_BLOCK.sub("", program)
            assert not re.search(r"\bexit\b", body), (
                f"{script}:{number}: awk exits before reading all input; its writer can SIGPIPE"
            )
