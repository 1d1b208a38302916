"""The ``flashsac-opt`` command line."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import platform
import sys


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def info(_args: argparse.Namespace) -> int:
    """Versions, device and whether UniLab's FlashSAC learner is importable."""
    import torch

    from rich.console import Console
    from rich.table import Table

    import flashsac_opt

    table = Table(title="flashsac-opt info", show_header=False)
    table.add_row("flashsac_opt", flashsac_opt.__version__)
    table.add_row("python", platform.python_version())
    table.add_row("torch", torch.__version__)
    table.add_row("triton", _version("triton") or "not installed")
    if torch.cuda.is_available():
        device = f"cuda: {torch.cuda.get_device_name(0)} (x{torch.cuda.device_count()}), CUDA {torch.version.cuda}"
    else:
        device = "cpu (no CUDA device)"
    table.add_row("device", device)
    unilab_version = _version("unilab")
    if unilab_version is None:
        status = "not installed (pip install 'flashsac-opt[unilab]')"
    elif importlib.util.find_spec("unilab.rl.algos.flash_sac") is None:
        status = f"{unilab_version}, but unilab.rl.algos.flash_sac is missing"
    else:
        status = f"{unilab_version}, FlashSAC learner importable"
        if unilab_version != "1.5.2":
            status += " (flashsac_opt targets 1.5.2)"
    table.add_row("unilab", status)
    Console().print(table)
    return 0


WIDTH = 80  # `flashsac-opt unilab` output fits an 80-column terminal


def _wrap(text: str, first: str = "", indent: str = "  ") -> list[str]:
    """``text`` in lines of at most WIDTH characters, the first starting with ``first``, the
    others with ``indent``. A word longer than a line (a long path) is split after a '/'
    where it can be, so each piece still reads as part of the path."""
    lines, line = [], first
    for word in text.split():
        while word:
            sep = "" if line == "" or line.endswith(" ") else " "
            room = WIDTH - len(line) - len(sep)
            if len(word) <= room:
                line += sep + word
                break
            if len(word) > WIDTH - len(indent) and room > 0:  # too long for any line: split it here
                cut = word.rfind("/", 0, room) + 1 or room
                line += sep + word[:cut]
                word = word[cut:]
            lines.append(line)
            line = indent
    lines.append(line)
    return lines


def _status_lines(report: dict) -> list[str]:
    if report["version"] is not None:
        head = f"UniLab {report['version']} ({report['version_source']}) at {report['unilab_dir']}"
    else:
        head = f"UniLab (version unknown: {report['version_source']}) at {report['unilab_dir']}"
    lines = _wrap(head)
    for p in report["patches"]:
        lines.append("")
        lines += _wrap(f"{p['name']}{' (optional)' if p['optional'] else ''}: {p['state']}")
        lines += _wrap(p["description"], first="  ", indent="  ")
        width = max(len(state) for state in p["files"].values())
        for path, state in p["files"].items():
            lines += _wrap(path, first=f"    {state:<{width}}  ", indent=" " * (width + 6))
    return lines


def _one_line(message: str) -> str:
    return " ".join(str(message).split())


PLACEHOLDER_HELP = """\
placeholder-meshes: for running UniLab's G1 tasks offline. UniLab downloads
the G1 robot's STL meshes from a model hub at first use; without a connection
training fails on pelvis.STL. This creates, under unilab/assets/robots/g1/,
one tiny placeholder mesh (a 1-mm tetrahedron) per mesh file that scene_flat.xml
uses (assets/*.STL) and textures/floor.png (UniLab's marker that the G1 assets
are complete). It writes only files that are missing: real meshes, if present,
are never overwritten. Before writing, it compiles every G1 model XML that uses
those meshes with MuJoCo and refuses unless each geom using them is visual only
(contype 0, conaffinity 0, no contact pair, no mass, and a short simulation
identical with tiny and large meshes), so physics is unchanged. Renders and
videos will show no robot body. Delete the created files (or put the real
meshes over them) to undo.
"""


def _placeholder_meshes(args: argparse.Namespace) -> int:
    from flashsac_opt.unilab import assets
    from flashsac_opt.unilab.patch import PatchError

    try:
        report = assets.placeholder_meshes(args.root, dry_run=args.dry_run)
    except assets.AssetWriteError as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 1
    except (assets.AssetError, PatchError) as exc:
        print(f"refused: {_one_line(exc)}", file=sys.stderr)
        return 2
    lines = _wrap(f"G1 model directory: {report.g1_dir}")
    lines += _wrap(
        f"checked with MuJoCo: {', '.join(report.models)}: all {report.mesh_geoms} geoms using these "
        "meshes are visual only (no collision, no contact pair, no mass; a short simulation is the "
        "same with tiny and large meshes), so physics is unchanged.")
    verb = "would create" if report.dry_run else "created"
    lines += [f"{verb}: {path.relative_to(report.g1_dir)}" for path in report.created]
    if report.kept:
        lines += _wrap(f"kept, never overwritten: {len(report.kept)} existing file(s) that are not "
                       f"placeholders (real meshes), e.g. {report.kept[0].relative_to(report.g1_dir)}")
    if report.already:
        lines.append(f"already there from an earlier run, left as they are: {len(report.already)} file(s)")
    if report.created or report.already:
        lines += _wrap(
            "Renders and videos will show no robot body for the placeholder meshes. To undo, "
            "delete the created files or put the real meshes over them.")
    lines += _wrap(f"G1 scene for env.scene.model_file: {report.scene}")
    print("\n".join(lines))
    return 0


def unilab(args: argparse.Namespace) -> int:
    """status | apply | revert the patch series on a UniLab 1.5.2 tree; placeholder-meshes."""
    from flashsac_opt.unilab import patch as unilab_patch

    if args.action == "placeholder-meshes":
        return _placeholder_meshes(args)
    try:
        if args.action == "status":
            report = unilab_patch.status(args.root)
        elif args.action == "apply":
            changed = unilab_patch.apply(args.root, args.patch, include_optional=args.with_cpu_smoke, dry_run=args.dry_run)
        else:
            changed = unilab_patch.revert(args.root, args.patch, dry_run=args.dry_run)
    except unilab_patch.PatchError as exc:
        print(f"refused: {_one_line(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:  # a PatchWriteError names the file; another OSError (a read) names its own
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 1
    if args.action == "status":
        print("\n".join(_status_lines(report)))
        return 0
    verb = {"apply": "patched", "revert": "restored"}[args.action]
    prefix = "would be " if args.dry_run else ""
    if not changed:
        print(f"nothing to do: already {'applied' if args.action == 'apply' else 'original'}")
    for path in changed:
        print(f"{prefix}{verb}: {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashsac-opt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="print versions, device and UniLab availability").set_defaults(func=info)
    patch = sub.add_parser(
        "unilab",
        help="status / apply / revert flashsac_opt's patches on UniLab 1.5.2; placeholder G1 meshes",
        description="\n".join(_wrap(
            "status: UniLab's version and which of flashsac_opt's patches are applied. apply / "
            "revert: the patch series (atomic: all files or none; revert restores the "
            "byte-identical originals).", indent="")),
        epilog=PLACEHOLDER_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    patch.add_argument("action", choices=["status", "apply", "revert", "placeholder-meshes"])
    patch.add_argument("--root", help="a UniLab checkout (src/unilab/), a unilab package dir; default: the installed one")
    patch.add_argument("--dry-run", action="store_true", help="say what would change, change nothing")
    patch.add_argument("--patch", action="append", help="only this patch (repeatable); default: the required ones")
    patch.add_argument("--with-cpu-smoke", action="store_true", help="apply: also the optional patch admitting CPU off-policy runs")
    patch.set_defaults(func=unilab)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
