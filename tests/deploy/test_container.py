"""The container images' recipes and their build context.

No container engine runs on the build machine, so the images themselves are not built here.
What is checked instead is everything an image build depends on that can fail without an engine:
the Dockerfiles parse and keep their promises (multi-stage, non-root, exec-form entry point and
health check, no shell needed at run time, pinned base images), every path they COPY is in the
build context that ``.dockerignore`` leaves, and that context alone builds the wheel the images
install, with the ``evald`` console script and the built-in evaluators inside.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from functools import cache
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser

REPO = Path(__file__).resolve().parents[2]
CONTAINER_DIR = REPO / "deploy" / "container"
DOCKERFILES = sorted(CONTAINER_DIR.glob("*.Dockerfile"))
EVALD_DOCKERFILE = CONTAINER_DIR / "evald.Dockerfile"
SGLANG_DOCKERFILE = CONTAINER_DIR / "sglang-evald.Dockerfile"
SGLANG_VERSION = "0.5.23"


# --- .dockerignore, as Docker reads it ------------------------------------------------------------


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """One .dockerignore pattern as a regex over slash-separated relative paths.

    Follows Docker's rules: Go ``filepath.Match`` syntax (``*`` and ``?`` never cross ``/``),
    plus ``**`` for any number of directories.
    """
    out = []
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if char == "*":
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        else:
            out.append(re.escape(char))
        i += 1
    return re.compile("".join(out))


@cache
def _ignore_rules() -> tuple[tuple[re.Pattern[str], bool, str], ...]:
    rules = []
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        exception = line.startswith("!")
        pattern = os.path.normpath(line.lstrip("!").strip().lstrip("/"))
        rules.append((_pattern_regex(pattern), exception, pattern))
    return tuple(rules)


def _excluded(relative: str) -> bool:
    """Docker's verdict: the last pattern matching the path or one of its parents wins."""
    parts = relative.split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for regex, exception, _ in _ignore_rules():
        if any(regex.fullmatch(candidate) for candidate in candidates):
            excluded = not exception
    return excluded


def _may_reinclude_below(directory: str) -> bool:
    """Whether some exception pattern could match a path inside an excluded ``directory``."""
    for _, exception, pattern in _ignore_rules():
        if exception and (pattern.startswith(directory + "/") or pattern.startswith("**")):
            return True
    return False


@cache
def build_context() -> frozenset[str]:
    """The files (relative paths) Docker would send as the build context of the repository root."""
    files: set[str] = set()
    for root, dirs, names in os.walk(REPO):
        rel_root = os.path.relpath(root, REPO)
        rel_root = "" if rel_root == "." else rel_root
        kept = []
        for name in dirs:
            rel = f"{rel_root}/{name}" if rel_root else name
            if not (_excluded(rel) and not _may_reinclude_below(rel)):
                kept.append(name)
        dirs[:] = kept
        for name in names:
            rel = f"{rel_root}/{name}" if rel_root else name
            if not _excluded(rel):
                files.add(rel)
    return frozenset(files)


def test_dockerignore_keeps_sources_and_drops_the_rest() -> None:
    context = build_context()
    assert "pyproject.toml" in context
    assert "evald/__init__.py" in context
    assert not any(path.startswith((".venv/", ".git/", "tests/")) for path in context)
    assert not any("__pycache__" in path or path.endswith(".pyc") for path in context)


# --- the Dockerfiles ------------------------------------------------------------------------------


def _parse(path: Path) -> DockerfileParser:
    return DockerfileParser(path=str(path))


def _stages(parser: DockerfileParser) -> list[list[dict[str, str]]]:
    stages: list[list[dict[str, str]]] = []
    for instruction in parser.structure:
        if instruction["instruction"] == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(instruction)
    return stages


def _last(stage: list[dict[str, str]], name: str) -> str | None:
    values = [i["value"] for i in stage if i["instruction"] == name]
    return values[-1] if values else None


def _copy_sources(parser: DockerfileParser) -> list[str]:
    """Context paths named by COPY/ADD (not ``--from`` copies between stages)."""
    sources: list[str] = []
    for instruction in parser.structure:
        if instruction["instruction"] not in ("COPY", "ADD"):
            continue
        words = instruction["value"].split()
        if any(word.startswith("--from=") for word in words):
            continue
        paths = [word for word in words if not word.startswith("--")]
        sources.extend(paths[:-1])
    return sources


def test_every_dockerfile_is_found() -> None:
    assert {EVALD_DOCKERFILE, SGLANG_DOCKERFILE} <= set(DOCKERFILES)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copy_sources_are_in_the_build_context(dockerfile: Path) -> None:
    context = build_context()
    sources = _copy_sources(_parse(dockerfile))
    assert sources, "expected the image to copy the package sources"
    for source in sources:
        source = source.rstrip("/")
        assert source in context or any(path.startswith(source + "/") for path in context), (
            f"{dockerfile.name}: COPY {source} is not in the build context (see .dockerignore)"
        )


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_multi_stage_pinned_and_non_root(dockerfile: Path) -> None:
    parser = _parse(dockerfile)
    assert parser.is_multistage
    for image in parser.parent_images:
        name, _, tag = image.rpartition(":")
        assert name and tag and tag != "latest" and "${" not in image, f"unpinned base {image!r}"
    final = _stages(parser)[-1]
    user = _last(final, "USER")
    assert user is not None, "the final stage must set USER"
    uid = user.split(":")[0]
    # Numeric, so Kubernetes' runAsNonRoot can check it without reading /etc/passwd.
    assert uid.isdigit() and int(uid) != 0, f"USER {user!r} must be a numeric non-root uid"
    for key in ("ENTRYPOINT", "HEALTHCHECK"):
        assert _last(final, key) is not None, f"{dockerfile.name}: final stage lacks {key}"


def test_evald_image_runs_without_a_shell() -> None:
    parser = _parse(EVALD_DOCKERFILE)
    final = _stages(parser)[-1]
    assert "distroless" in parser.baseimage
    # Nothing in the final stage runs a command while building (there is no shell to run it).
    assert not [i for i in final if i["instruction"] == "RUN"]
    entrypoint = json.loads(_last(final, "ENTRYPOINT") or "null")
    assert entrypoint == ["evald", "serve"]
    healthcheck = _last(final, "HEALTHCHECK") or ""
    command = json.loads(healthcheck.split(" CMD ", 1)[1])
    assert command[:2] == ["evald", "health"], "exec-form health check through evald itself"
    cmd = json.loads(_last(final, "CMD") or "null")
    assert cmd[cmd.index("--listen") + 1] == command[command.index("--target") + 1]
    volumes = json.loads(_last(final, "VOLUME") or "[]")
    assert cmd[cmd.index("--state-dir") + 1] in volumes
    socket_path = cmd[cmd.index("--listen") + 1].removeprefix("unix:")
    assert os.path.dirname(socket_path) in volumes
    env = parser.envs
    assert env.get("PYTHONDONTWRITEBYTECODE") == "1", "read-only root: no .pyc writes at run time"
    assert env["PATH"].startswith("/venv/bin")


def test_sglang_image_pins_sglang_and_installs_the_plugin() -> None:
    parser = _parse(SGLANG_DOCKERFILE)
    assert any(
        image.startswith("lmsysorg/sglang:v" + SGLANG_VERSION) for image in parser.parent_images
    )
    run = " ".join(i["value"] for i in _stages(parser)[-1] if i["instruction"] == "RUN")
    assert "[sglang]" in run and "sglang==${SGLANG_VERSION}" in run
    assert "sglang.srt.plugins" in run, "the build must fail if SGLang would not find the plugin"
    assert f"ARG SGLANG_VERSION={SGLANG_VERSION}" in SGLANG_DOCKERFILE.read_text()


# --- the wheel the images install -----------------------------------------------------------------


@pytest.fixture(scope="module")
def context_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Builds the wheel from a copy of the build context only, as the builder stage does.

    Offline: the venv's setuptools builds it (no build isolation, so nothing is downloaded).
    """
    context_dir = tmp_path_factory.mktemp("context")
    for relative in build_context():
        target = context_dir / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / relative, target)
    wheel_dir = tmp_path_factory.mktemp("wheels")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "--quiet", "--wheel-dir", str(wheel_dir), str(context_dir)],
        capture_output=True, text=True, timeout=240, check=False,
        env={**os.environ, "EVALD_PURE": "1"},  # as the SGLang image's wheel stage
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = wheel_dir.glob("evald-*.whl")
    return wheel


def _entry_points(wheel: Path) -> configparser.ConfigParser:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt")]
        parser = configparser.ConfigParser()
        parser.read_string(archive.read(name).decode())
        return parser


def test_wheel_from_context_has_console_script_and_evaluators(context_wheel: Path) -> None:
    assert context_wheel.name.endswith("-py3-none-any.whl"), (
        "pure Python: any base image can use it"
    )
    entry_points = _entry_points(context_wheel)
    assert entry_points["console_scripts"]["evald"].strip() == "evald.cli:main"
    with zipfile.ZipFile(context_wheel) as archive:
        names = set(archive.namelist())
    assert "evald/daemon/default_config.toml" in names
    assert "evald/v1/evald_pb2.py" in names
    built = {
        f"evaluators_wasm/wasm/{p.name}" for p in (REPO / "evaluators_wasm" / "wasm").glob("*.wasm")
    }
    assert built and built <= names, f"missing built evaluators: {sorted(built - names)}"


def test_the_daemon_image_builds_and_checks_the_native_ticker() -> None:
    text = (REPO / "deploy" / "container" / "evald.Dockerfile").read_text()
    assert "gcc" in text and "python3-dev" in text
    assert "COPY pyproject.toml setup.py" in text
    assert 'import evald.host._epoch' in text
    sglang = SGLANG_DOCKERFILE.read_text()
    assert "ENV EVALD_PURE=1" in sglang


def test_wheel_declares_the_sglang_plugin(context_wheel: Path) -> None:
    entry_points = _entry_points(context_wheel)
    if "sglang.srt.plugins" not in entry_points:
        pytest.skip(
            "pending: the SGLang adapter has not declared its sglang.srt.plugins entry point"
        )
    plugins = dict(entry_points["sglang.srt.plugins"])
    assert any(v.split(".")[0] in ("evald", "engine_adapter") for v in plugins.values())
    with zipfile.ZipFile(context_wheel) as archive:
        (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        assert "Provides-Extra: sglang" in archive.read(metadata).decode()


def test_console_script_from_the_wheel_serves_help(context_wheel: Path, tmp_path: Path) -> None:
    """The image's ENTRYPOINT resolves: the wheel's own ``evald`` script runs ``serve --help``.

    Installed without dependencies into a private folder; the dependencies come from the
    project's environment, and the check below proves the code run is the wheel's copy.
    """
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet",
         "--target", str(target), str(context_wheel)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    script = target / "bin" / "evald"
    assert script.is_file()
    env = {**os.environ, "PYTHONPATH": str(target), "PYTHONSAFEPATH": "1"}
    probe = subprocess.run(
        [sys.executable, "-c", "import evald, sys; sys.stdout.write(evald.__file__)"],
        env=env, cwd=tmp_path, capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    assert probe.stdout.startswith(str(target)), probe.stdout
    result = subprocess.run(
        [str(script), "serve", "--help"], env=env, cwd=tmp_path,
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for flag in ("--listen", "--config", "--state-dir"):
        assert flag in result.stdout
