"""Test helpers: a private, patchable copy of the installed UniLab 1.5.2 and G1 placeholders."""

from __future__ import annotations

import importlib.util
import re
import shutil
import struct
import zlib
from pathlib import Path


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


def _tetrahedron_stl() -> bytes:
    # MuJoCo needs >= 4 vertices per mesh. The G1 meshes are visual only (density 0,
    # contype 0), so tiny placeholders give the same physics as the real ones.
    v = [(0, 0, 0), (0.001, 0, 0), (0, 0.001, 0), (0, 0, 0.001)]
    faces = [(0, 2, 1), (0, 1, 3), (0, 3, 2), (1, 2, 3)]
    out = b"\0" * 80 + struct.pack("<I", len(faces))
    for face in faces:
        out += struct.pack("<3f", 0, 0, 0) + b"".join(struct.pack("<3f", *v[i]) for i in face) + struct.pack("<H", 0)
    return out


def _png(width: int, height: int) -> bytes:
    raw = b"".join(b"\x00" + b"\x80\x80\x80" * width for _ in range(height))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def add_g1_placeholders(pkg: Path) -> Path:
    """Placeholder meshes + the floor texture UniLab uses as its 'assets complete' marker."""
    g1 = pkg / "assets" / "robots" / "g1"
    (g1 / "assets").mkdir(exist_ok=True)
    (g1 / "textures").mkdir(exist_ok=True)
    names = set(re.findall(r'file="([^"]+\.[sS][tT][lL])"', (g1 / "g1.xml").read_text()))
    for name in names:
        (g1 / "assets" / name).write_bytes(_tetrahedron_stl())
    (g1 / "textures" / "floor.png").write_bytes(_png(4, 4))
    return g1 / "scene_flat.xml"
