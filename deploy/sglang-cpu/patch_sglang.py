"""Applies one of the SGLang CPU venv's patches (``install.sh`` runs them in order).

usage: python patch_sglang.py {kernel-cmake SRC_DIR | kernel-shim | amx-backend | torchvision-init}

- ``kernel-cmake SRC_DIR``: adds the ``SGL_KERNEL_CPU_X86_V3`` option to the kernel's
  ``csrc/cpu/CMakeLists.txt`` (an x86-64-v3 build for CPUs without AVX-512, whose code paths
  the kernel's sources already guard with ``CPU_CAPABILITY_AVX512``). Run on the extracted
  source before building.
- ``kernel-shim``: installs ``sgl_kernel_compat.py`` as ``sgl_kernel/_evald_compat.py``.
- ``amx-backend``: routes SGLang's intel_amx attention through that shim.
- ``torchvision-init``: PyPI's torchvision is CUDA-built; its ``_C`` cannot load against the CPU
  torch, and its unconditional op registrations then fail ("operator torchvision::nms does not
  exist"). They are made conditional on the ops having loaded.

Each step is idempotent: a file is patched only from its pristine state (its sha256 in the
installed package's RECORD, or the kernel source's exact text), reported as already patched when
it is exactly the patched text, and anything else fails with exit status 1.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

PACKAGE_PATCHES = {
    "amx-backend": {
        "dist": "sglang",
        "version": "0.5.23",
        "rel": "sglang/srt/layers/attention/intel_amx_backend.py",
        "old": (
            "        self.decode_attention_fwd = torch.ops.sgl_kernel.decode_attention_cpu\n"
            "        self.extend_attention_fwd = torch.ops.sgl_kernel.extend_attention_cpu\n"
        ),
        "new": (
            "        from sgl_kernel import _evald_compat  # evald: the Aug-2026 kernel's schema\n"
            "        self.decode_attention_fwd = _evald_compat.decode_attention_cpu\n"
            "        self.extend_attention_fwd = _evald_compat.extend_attention_cpu\n"
        ),
    },
    "torchvision-init": {
        "dist": "torchvision",
        "version": "0.28.0",
        "rel": "torchvision/__init__.py",
        "old": (
            "from . import extension  # usort:skip  # noqa: F401\n"
            "from torchvision import (\n"
            "    _autograd_registrations,\n"
            "    _meta_registrations,\n"
            "    datasets,\n"
        ),
        "new": (
            "from . import extension  # usort:skip  # noqa: F401\n"
            "if extension._has_ops():  # evald: the CUDA-built _C cannot load on CPU torch\n"
            "    from torchvision import _autograd_registrations, _meta_registrations  # noqa: F401\n"
            "from torchvision import (\n"
            "    datasets,\n"
        ),
    },
}

CMAKE_OLD = 'if(MY_ARCH_DIR STREQUAL "x86_64")\n    add_compile_options('
CMAKE_NEW = (
    'option(SGL_KERNEL_CPU_X86_V3 "x86-64-v3 (AVX2) build for CPUs without AVX-512" OFF)\n'
    'if(MY_ARCH_DIR STREQUAL "x86_64" AND SGL_KERNEL_CPU_X86_V3)\n'
    "    add_compile_options(-O3 -Wno-unknown-pragmas -march=x86-64-v3 -fopenmp)\n"
    'elseif(MY_ARCH_DIR STREQUAL "x86_64")\n'
    "    add_compile_options("
)


def die(message: str) -> None:
    print(f"patch_sglang: FAILED: {message}", file=sys.stderr)
    sys.exit(1)


def record_sha256(dist: md.Distribution, rel: str) -> str:
    for entry in dist.files or []:
        if str(entry) == rel and entry.hash is not None and entry.hash.mode == "sha256":
            return entry.hash.value
    die(f"{rel}: not listed with a sha256 in {dist.metadata['Name']}'s RECORD")
    raise AssertionError


def b64sha256(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def package_patch(name: str) -> None:
    patch = PACKAGE_PATCHES[name]
    try:
        dist = md.distribution(patch["dist"])
    except md.PackageNotFoundError:
        die(f"{patch['dist']} is not installed in {sys.prefix}")
    if dist.version != patch["version"]:
        die(f"{patch['dist']} is {dist.version}; this patch is for {patch['version']} only")
    path = Path(str(dist.locate_file(patch["rel"])))
    text = path.read_text(encoding="utf-8")
    pristine = record_sha256(dist, patch["rel"])
    if b64sha256(text.encode()) == pristine:
        if text.count(patch["old"]) != 1:
            die(f"{path}: pristine, but the text to replace is not there exactly once")
        path.write_text(text.replace(patch["old"], patch["new"]), encoding="utf-8")
        print(f"patch_sglang: {name}: applied to {path}")
    elif text.count(patch["new"]) == 1 and (
        b64sha256(text.replace(patch["new"], patch["old"]).encode()) == pristine
    ):
        print(f"patch_sglang: {name}: already applied ({path})")
    else:
        die(
            f"{path} is neither the pristine {patch['dist']} {patch['version']} file nor its "
            f"patched version; reinstall it (pip install --force-reinstall --no-deps "
            f"{patch['dist']}=={patch['version']}) and rerun"
        )


def kernel_shim() -> None:
    try:
        dist = md.distribution("sglang-kernel-cpu")
    except md.PackageNotFoundError:
        die("sglang-kernel-cpu is not installed")
    package = Path(str(dist.locate_file("sgl_kernel")))
    if not (package / "__init__.py").is_file():
        die(f"{package} is not the sgl_kernel package")
    source, target = HERE / "sgl_kernel_compat.py", package / "_evald_compat.py"
    if target.is_file() and target.read_bytes() == source.read_bytes():
        print(f"patch_sglang: kernel-shim: already installed ({target})")
        return
    shutil.copyfile(source, target)
    print(f"patch_sglang: kernel-shim: installed {target}")


def kernel_cmake(source_dir: Path) -> None:
    path = source_dir / "csrc" / "cpu" / "CMakeLists.txt"
    text = path.read_text(encoding="utf-8")
    if text.count(CMAKE_NEW) == 1:
        print(f"patch_sglang: kernel-cmake: already applied ({path})")
    elif text.count(CMAKE_OLD) == 1:
        path.write_text(text.replace(CMAKE_OLD, CMAKE_NEW), encoding="utf-8")
        print(f"patch_sglang: kernel-cmake: applied to {path}")
    else:
        die(f"{path}: not the kernel source this patch was written for")


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["kernel-cmake"] and len(args) == 2:
        kernel_cmake(Path(args[1]))
    elif args == ["kernel-shim"]:
        kernel_shim()
    elif len(args) == 1 and args[0] in PACKAGE_PATCHES:
        package_patch(args[0])
    else:
        die("usage: patch_sglang.py {kernel-cmake SRC_DIR | kernel-shim | amx-backend | torchvision-init}")


if __name__ == "__main__":
    main()
