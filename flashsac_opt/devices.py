"""Device names as tensors report them."""

from __future__ import annotations

import torch


def resolve_device(device: str | torch.device) -> torch.device:
    """``torch.device`` with the CUDA index filled in ("cuda" -> "cuda:N", the current one).

    Tensors report "cuda:0", never "cuda": resolving once lets device checks compare equal.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device
