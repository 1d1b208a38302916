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


def unilab(args: argparse.Namespace) -> int:
    """status | apply | revert the patch series on a UniLab 1.5.2 tree."""
    from rich.console import Console
    from rich.table import Table

    from flashsac_opt.unilab import patch as unilab_patch

    console = Console()
    try:
        if args.action == "status":
            report = unilab_patch.status(args.root)
            table = Table(title=f"UniLab {report['version'] or '(version unknown)'} at {report['unilab_dir']}")
            for col in ("patch", "state", "files", "what it does"):
                table.add_column(col)
            for p in report["patches"]:
                files = "\n".join(f"{path}: {state}" for path, state in p["files"].items())
                name = p["name"] + (" (optional)" if p["optional"] else "")
                table.add_row(name, p["state"], files, p["description"])
            console.print(table)
            return 0
        if args.action == "apply":
            changed = unilab_patch.apply(args.root, args.patch, include_optional=args.with_cpu_smoke, dry_run=args.dry_run)
        else:
            changed = unilab_patch.revert(args.root, args.patch, dry_run=args.dry_run)
    except unilab_patch.PatchError as exc:
        console.print(f"[red]refused:[/red] {exc}")
        return 2
    verb = {"apply": "patched", "revert": "restored"}[args.action]
    prefix = "would be " if args.dry_run else ""
    if not changed:
        console.print(f"nothing to do: already {'applied' if args.action == 'apply' else 'original'}")
    for path in changed:
        console.print(f"{prefix}{verb}: {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashsac-opt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="print versions, device and UniLab availability").set_defaults(func=info)
    patch = sub.add_parser("unilab", help="status / apply / revert flashsac_opt's patches on UniLab 1.5.2")
    patch.add_argument("action", choices=["status", "apply", "revert"])
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
