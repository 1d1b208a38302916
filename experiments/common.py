"""Shared command-line plumbing of the GPU experiments."""

from __future__ import annotations

import argparse
import json
from typing import Callable


def plot_only_or_require_cuda(parser: argparse.ArgumentParser, args: argparse.Namespace, plot: Callable) -> bool:
    """Handle --plot-only (returns True: done) or fail cleanly without a CUDA device."""
    if args.plot_only:
        if not args.plot:
            parser.error("--plot-only needs --plot PATH")
        plot(json.loads(args.plot_only.read_text()), args.plot)
        return True
    import torch

    if not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA device")
    return False
