"""Apply, check and revert flashsac_opt's patch series on a UniLab 1.5.2 tree.

The series lives in ``patches/`` (``series.json`` + one unified diff per patch, paths
relative to the directory that holds the ``unilab`` package, so ``patch -p1`` works from
``src/`` of a checkout or from ``site-packages/``). Each patched file is identified by the
SHA-256 of its UniLab 1.5.2 original and of its patched form, which makes every state
decidable before anything is written:

- all files original -> ``apply`` writes them; all patched -> nothing to do (idempotent);
- a file matching neither -> "locally modified or not UniLab 1.5.2": refused;
- some original and some patched -> "half-applied": refused;
- all files as an earlier flashsac_opt version of the patch left them ("applied-earlier",
  series.json ``earlier``) -> ``apply`` upgrades them, ``revert`` restores the originals.

A file two patches change (0003 and 0006: ``scripts/train_offpolicy.py``) is decided by which of
them it carries: the subset whose hunks, taken back out, give the original's hash (each patch's
hunks are written against the original and may not overlap another's); applying or reverting
one of them rebuilds the file from the original with the other's hunks kept as they were.

``apply`` and ``revert`` compute every new file in memory and check its hash first, then
replace files one by one (write to a temp file, ``os.replace``), restoring the already
replaced ones if a later write fails: all files or none.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_VERSION = "1.5.2"


class PatchError(RuntimeError):
    """A refusal: the message says why; no file was changed."""


class PatchWriteError(OSError):
    """Writing a file failed (read-only directory, immutable file, full disk, ...).

    ``path`` is the file being written, ``reason`` the operating system's reason. The files
    already replaced were restored from memory unless ``unrestored`` names some.
    """

    def __init__(self, path: Path, reason: str, unrestored: list[tuple[Path, str]] | None = None):
        self.path, self.reason, self.unrestored = path, reason, unrestored or []
        message = f"could not write {path}: {reason}"
        if self.unrestored:
            failed = "; ".join(f"{p} ({why})" for p, why in self.unrestored)
            message += f"; restoring these already written files also failed, restore them from UniLab {SUPPORTED_VERSION}: {failed}"
        else:
            message += "; nothing changed"
        super().__init__(message)


@dataclass
class FilePatch:
    path: str  # relative to the directory holding the `unilab` package
    original_sha256: str
    patched_sha256: str
    hunks: list[tuple[int, int, list[str]]] = field(default_factory=list)  # (old start, new start, lines)
    # the same file's patches by other patches of the series (each against the original), if any
    shared_with: list["FilePatch"] = field(default_factory=list, repr=False, compare=False)


@dataclass
class Patch:
    name: str
    description: str
    optional: bool
    files: list[FilePatch]
    earlier: list["Patch"] = field(default_factory=list)  # older versions of this patch


def patches_dir() -> Path:
    here = Path(__file__).resolve().parent
    for candidate in (here / "patches", here.parents[1] / "patches"):
        if (candidate / "series.json").is_file():
            return candidate
    raise PatchError("flashsac_opt's patches/ directory (series.json) was not found next to the package")


_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def parse_unified_diff(text: str) -> dict[str, list[tuple[int, int, list[str]]]]:
    """{path: [(old start, new start, lines)]} from a `diff -u`/`git diff` text (a/ b/ prefixes)."""
    files: dict[str, list[tuple[int, int, list[str]]]] = {}
    current: list[tuple[int, int, list[str]]] | None = None
    for line in text.splitlines(keepends=True):
        if line.startswith("+++ "):
            path = line[4:].strip().split("\t")[0]
            path = path[2:] if path.startswith("b/") else path
            current = files.setdefault(path, [])
        elif line.startswith("--- "):
            continue
        elif line.startswith("@@"):
            match = _HUNK.match(line)
            if match is None or current is None:
                raise PatchError(f"malformed hunk header: {line.strip()}")
            current.append((int(match.group(1)), int(match.group(3)), []))
        elif line.startswith("\\"):
            raise PatchError("patches must not touch a file's last line without a newline")
        elif current and line[:1] in (" ", "+", "-"):
            current[-1][2].append(line)
    return files


def _apply_hunks(original: str, hunks: list[tuple[int, int, list[str]]], reverse: bool) -> str:
    """Apply hunks exactly at their line numbers (no fuzz: the file's hash was checked)."""
    lines = original.splitlines(keepends=True)
    out: list[str] = []
    cursor = 0
    for old_start, new_start, body in hunks:
        old = [line[1:] for line in body if line[0] in " -"]
        new = [line[1:] for line in body if line[0] in " +"]
        start = old_start
        if reverse:
            old, new, start = new, old, new_start
        begin = start - 1 if old else start  # a pure insertion is "after line `start`"
        if begin < cursor or lines[begin : begin + len(old)] != old:
            raise PatchError(f"hunk at line {start} does not match the file")
        out.extend(lines[cursor:begin])
        out.extend(new)
        cursor = begin + len(old)
    out.extend(lines[cursor:])
    return "".join(out)


def _spans(patches: list[FilePatch]) -> list[tuple[int, list[str], list[str]]]:
    """The hunks of several patches of one file, in the original's order: (0-based line where
    each begins in the original, its old lines, its new lines); PatchError where two overlap."""
    spans = []
    for f in patches:
        for old_start, _new_start, body in f.hunks:
            old = [line[1:] for line in body if line[0] in " -"]
            spans.append((old_start - 1 if old else old_start, old, [line[1:] for line in body if line[0] in " +"], f.path))
    spans.sort(key=lambda span: span[0])
    for (begin, old, _, path), (next_begin, *_rest) in zip(spans, spans[1:]):
        if begin + len(old) > next_begin:
            raise PatchError(f"two patches of {path} overlap at line {next_begin + 1}: the series cannot combine them")
    return [(begin, old, new) for begin, old, new, _ in spans]


def _splice(text: str, patches: list[FilePatch], reverse: bool) -> str:
    """The original with ``patches``' hunks applied (or, reverse, ``text`` carrying exactly those
    patches taken back to the original); PatchError where a hunk does not match."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    cursor = delta = 0
    for begin, old, new in _spans(patches):
        src, dst, at = (new, old, begin + delta) if reverse else (old, new, begin)
        if at < cursor or lines[at : at + len(src)] != src:
            raise PatchError(f"hunk at line {at + 1} does not match the file")
        out.extend(lines[cursor:at])
        out.extend(dst)
        cursor = at + len(src)
        delta += len(new) - len(old)
    out.extend(lines[cursor:])
    return "".join(out)


def carried_patches(content: bytes, f: FilePatch) -> tuple[str, list[FilePatch]] | None:
    """For a file several patches change: (the original's text, the patches ``content`` carries),
    or None when no combination of them explains it (locally modified, another version)."""
    group = [f, *f.shared_with]
    text = content.decode(errors="replace")
    for mask in range(1 << len(group)):
        carried = [g for i, g in enumerate(group) if mask >> i & 1]
        try:
            original = _splice(text, carried, reverse=True) if carried else text
        except PatchError:
            continue
        if hashlib.sha256(original.encode()).hexdigest() == f.original_sha256:
            return original, carried
    return None


def load_series(directory: Path | None = None) -> list[Patch]:
    directory = directory or patches_dir()
    meta = json.loads((directory / "series.json").read_text())
    if meta.get("unilab_version") != SUPPORTED_VERSION:
        raise PatchError(f"patch series is for UniLab {meta.get('unilab_version')}, expected {SUPPORTED_VERSION}")
    series = []
    for entry in meta["patches"]:
        diff = parse_unified_diff((directory / entry["file"]).read_text())
        files = []
        for f in entry["files"]:
            if f["path"] not in diff:
                raise PatchError(f"{entry['file']} has no hunks for {f['path']}")
            files.append(FilePatch(f["path"], f["original_sha256"], f["patched_sha256"], diff[f["path"]]))
        earlier = []
        originals = {f.path: f.original_sha256 for f in files}
        for old in entry.get("earlier", []):
            old_diff = parse_unified_diff((directory / old["file"]).read_text())
            old_files = [FilePatch(f["path"], originals[f["path"]], f["patched_sha256"], old_diff[f["path"]]) for f in old["files"]]
            earlier.append(Patch(f"{entry['name']} ({old['file']})", old.get("note", ""), bool(entry.get("optional")), old_files))
        series.append(Patch(entry["name"], entry["description"], bool(entry.get("optional")), files, earlier))
    by_path: dict[str, list[FilePatch]] = {}
    for patch in series:
        for f in patch.files:
            by_path.setdefault(f.path, []).append(f)
    for path, group in by_path.items():
        if len(group) < 2:
            continue
        if len({f.original_sha256 for f in group}) != 1:
            raise PatchError(f"the patches of {path} are written against different originals")
        _spans(group)  # they must not overlap
        for f in group:
            f.shared_with = [g for g in group if g is not f]
    return series


def locate_unilab(root: str | Path | None) -> Path:
    """The directory holding the `unilab` package: a checkout's src/, site-packages, ..."""
    if root is None:
        spec = importlib.util.find_spec("unilab")
        if spec is None or spec.origin is None:
            raise PatchError("UniLab is not installed here; pass --root PATH (a checkout or a unilab package)")
        return Path(spec.origin).resolve().parent.parent
    root = Path(root).resolve()
    for base in (root / "src", root, root.parent):
        if (base / "unilab" / "__init__.py").is_file() and (base / "unilab" / "rl").is_dir():
            return base
    raise PatchError(f"{root}: no UniLab here (looked for src/unilab/, unilab/ and a unilab package directory)")


def unilab_version(base: Path) -> str | None:
    """Version from the installed metadata or a checkout's pyproject.toml (None if unknown)."""
    return _declared_version(base)[0]


def _declared_version(base: Path) -> tuple[str | None, str]:
    """(version, where it was read) from package metadata or pyproject.toml; (None, "") if neither."""
    for meta in sorted(base.glob("unilab-*.dist-info/METADATA")):
        for line in meta.read_text().splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip(), "from package metadata"
    for pyproject in (base.parent / "pyproject.toml", base / "pyproject.toml"):
        if pyproject.is_file():
            match = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M)
            if match:
                return match.group(1), "from pyproject.toml"
    return None, ""


def identify_version(base: Path, series: list[Patch] | None = None) -> tuple[str | None, str]:
    """(version, how it was identified). Without package metadata or a pyproject.toml, the
    files the patches touch decide: each matching a known UniLab 1.5.2 hash (original, patched,
    or patched by an earlier version of a patch) identifies 1.5.2; otherwise the reason says
    which files did not match."""
    version, source = _declared_version(base)
    if version is not None:
        return version, source
    series = load_series() if series is None else series
    known: dict[str, set[str]] = {}
    for patch in series:
        for f in patch.files:
            known.setdefault(f.path, set()).update((f.original_sha256, f.patched_sha256))
        for old in patch.earlier:
            for f in old.files:
                known.setdefault(f.path, set()).add(f.patched_sha256)
    shared = {f.path: f for patch in series for f in patch.files if f.shared_with}
    unmatched = []
    for path, hashes in known.items():
        digest = _sha(base / path)
        if digest in hashes or (digest is not None and path in shared and carried_patches((base / path).read_bytes(), shared[path])):
            continue
        unmatched.append(f"{path} ({'missing' if digest is None else 'unknown hash'})")
    if not unmatched:
        return SUPPORTED_VERSION, "identified by file hashes"
    return None, (
        f"no package metadata or pyproject.toml, and {len(unmatched)} of the {len(known)} files the "
        f"patches touch match no UniLab {SUPPORTED_VERSION} hash: {', '.join(unmatched)}"
    )


def _sha(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def file_state(base: Path, f: FilePatch) -> str:
    digest = _sha(base / f.path)
    if digest is None:
        return "missing"
    if f.shared_with:  # whether this patch is among those the file carries
        found = carried_patches((base / f.path).read_bytes(), f)
        return "modified" if found is None else "applied" if any(g is f for g in found[1]) else "original"
    if digest == f.original_sha256:
        return "original"
    if digest == f.patched_sha256:
        return "applied"
    return "modified"


def patch_state(base: Path, patch: Patch) -> tuple[str, dict[str, str]]:
    states = {f.path: file_state(base, f) for f in patch.files}
    values = set(states.values())
    if values == {"original"}:
        return "not applied", states
    if values == {"applied"}:
        return "applied", states
    if values <= {"original", "applied"}:
        return "half-applied", states
    for old in patch.earlier:  # left as an earlier flashsac_opt version of this patch wrote it?
        old_state, old_states = patch_state(base, old)
        if old_state == "applied":
            return "applied-earlier", {path: "applied-earlier" for path in old_states}
    return "conflict", states


def status(root: str | Path | None = None) -> dict:
    base = locate_unilab(root)
    series = load_series()
    version, version_source = identify_version(base, series)
    report = {"unilab_dir": str(base / "unilab"), "version": version, "version_source": version_source, "patches": []}
    for patch in series:
        state, files = patch_state(base, patch)
        report["patches"].append({"name": patch.name, "optional": patch.optional, "state": state, "files": files, "description": patch.description})
    return report


def _check_version(base: Path) -> None:
    version = unilab_version(base)
    if version is not None and version != SUPPORTED_VERSION:
        raise PatchError(f"UniLab {version} at {base / 'unilab'}: flashsac_opt's patches are for UniLab {SUPPORTED_VERSION} only; nothing changed")


def _plan(base: Path, patches: list[Patch], reverse: bool) -> dict[Path, tuple[bytes, bytes]]:
    """{path: (current bytes, new bytes)} for every file that must change; raises on any refusal."""
    plan: dict[Path, tuple[bytes, bytes]] = {}
    for patch in patches:
        state, files = patch_state(base, patch)
        if state == "conflict":
            bad = ", ".join(f"{p} ({s})" for p, s in files.items() if s in ("modified", "missing"))
            raise PatchError(f"patch {patch.name}: {bad}: locally modified or not UniLab {SUPPORTED_VERSION}; nothing changed")
        if state == "half-applied":
            detail = ", ".join(f"{p}: {s}" for p, s in files.items())
            raise PatchError(f"patch {patch.name} is half-applied ({detail}); restore these files from UniLab {SUPPORTED_VERSION} first; nothing changed")
        if state == "applied-earlier":  # upgrade (apply) or revert via the originals
            old = next(p for p in patch.earlier if patch_state(base, p)[0] == "applied")
            old_files = {f.path: f for f in old.files}
            for f in patch.files:
                old_file = old_files[f.path]
                path = base / f.path
                current = path.read_bytes()
                original = _apply_hunks(current.decode(), old_file.hunks, reverse=True).encode()
                new = original if reverse else _apply_hunks(original.decode(), f.hunks, reverse=False).encode()
                if hashlib.sha256(original).hexdigest() != f.original_sha256 or (
                    not reverse and hashlib.sha256(new).hexdigest() != f.patched_sha256
                ):
                    raise PatchError(f"patch {patch.name}: upgrading {f.path} gave an unexpected hash; nothing changed")
                plan[path] = (current, new)
            continue
        if (state == "applied") != reverse:
            continue  # already in the wanted state
        for f in patch.files:
            path = base / f.path
            if f.shared_with:  # from the original, with the other patches the file carries (as planned so far) kept
                on_disk = plan[path][0] if path in plan else path.read_bytes()
                found = carried_patches(plan[path][1] if path in plan else on_disk, f)
                if found is None:
                    raise PatchError(f"patch {patch.name}: {f.path} carries no known combination of its patches; nothing changed")
                original, carried = found
                keep = [g for g in carried if g is not f] + ([] if reverse else [f])
                new = (_splice(original, keep, reverse=False) if keep else original).encode()
                if len(keep) == 1 and keep[0] is f and hashlib.sha256(new).hexdigest() != f.patched_sha256:
                    raise PatchError(f"patch {patch.name}: result for {f.path} has an unexpected hash; nothing changed")
                plan[path] = (on_disk, new)
                continue
            current = path.read_bytes()
            new = _apply_hunks(current.decode(), f.hunks, reverse).encode()
            expected = f.original_sha256 if reverse else f.patched_sha256
            if hashlib.sha256(new).hexdigest() != expected:
                raise PatchError(f"patch {patch.name}: result for {f.path} has an unexpected hash; nothing changed")
            plan[path] = (current, new)
    return plan


def _write_all(plan: dict[Path, tuple[bytes, bytes]]) -> None:
    """Replace every file or none; an OSError becomes a PatchWriteError naming the file."""
    done: list[Path] = []
    current: Path | None = None
    try:
        for path, (_old, new) in plan.items():
            current = path
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".flashsac_opt")
            try:
                with os.fdopen(fd, "wb") as handle:
                    handle.write(new)
                os.chmod(tmp, path.stat().st_mode & 0o7777)
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):  # the replace did not happen: leave no temp file behind
                    os.unlink(tmp)
            done.append(path)
    except BaseException as exc:
        unrestored = []
        for path in done:  # roll back: all files or none
            try:
                path.write_bytes(plan[path][0])
            except OSError as again:
                unrestored.append((path, again.strerror or str(again)))
        if isinstance(exc, OSError) and current is not None:
            raise PatchWriteError(current, exc.strerror or str(exc), unrestored) from exc
        raise


def _select(names: list[str] | None, include_optional: bool) -> list[Patch]:
    series = load_series()
    if names:
        unknown = set(names) - {p.name for p in series}
        if unknown:
            raise PatchError(f"unknown patch(es) {sorted(unknown)}; known: {[p.name for p in series]}")
        return [p for p in series if p.name in names]
    return [p for p in series if include_optional or not p.optional]


def apply(root: str | Path | None = None, names: list[str] | None = None, include_optional: bool = False, dry_run: bool = False) -> list[str]:
    """Apply the series; returns the changed files (relative). Idempotent."""
    base = locate_unilab(root)
    _check_version(base)
    plan = _plan(base, _select(names, include_optional), reverse=False)
    if not dry_run:
        _write_all(plan)
    return [str(p.relative_to(base)) for p in plan]


def revert(root: str | Path | None = None, names: list[str] | None = None, dry_run: bool = False) -> list[str]:
    """Restore the byte-identical UniLab originals of every applied patch."""
    base = locate_unilab(root)
    _check_version(base)
    selected = _select(names, include_optional=True)
    plan = _plan(base, list(reversed(selected)), reverse=True)
    if not dry_run:
        _write_all(plan)
    return [str(p.relative_to(base)) for p in plan]
