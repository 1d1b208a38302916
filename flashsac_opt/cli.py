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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashsac-opt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="print versions, device and UniLab availability").set_defaults(func=info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
