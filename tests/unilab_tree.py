"""Test helpers: a private, patchable copy of the installed UniLab 1.5.2 and G1 placeholders."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from flashsac_opt.unilab.assets import placeholder_meshes


def installed_unilab() -> Path:
    spec = importlib.util.find_spec("unilab")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent


def copy_unilab(dest: Path) -> Path:
    """Copy the installed `unilab` package (+ its dist-info) into dest (a site-packages-like dir)."""
    src = installed_unilab()
    shutil.copytree(src, dest / "unilab", ignore=shutil.ignore_patterns("__pycache__"))
    for info in src.parent.glob("unilab-*.dist-info"):
        shutil.copytree(info, dest / info.name)
    return dest


def add_g1_placeholders(pkg: Path) -> Path:
    """`flashsac-opt unilab placeholder-meshes` on the unilab package dir pkg; the G1 scene path."""
    return placeholder_meshes(pkg).scene
