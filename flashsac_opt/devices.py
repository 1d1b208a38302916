"""Device names as tensors report them."""

from __future__ import annotations

import torch


def resolve_device(device: str | torch.device) -> torch.device:
    """The canonical ``torch.device``: the one tensors on it report.

    CUDA gets its index filled in ("cuda" -> "cuda:N", the current one) and CPU loses any
    index ("cpu:0" -> "cpu"), so device checks against ``tensor.device`` compare equal.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    elif device.type == "cpu":
        device = torch.device("cpu")
    return device
