"""The learner's input boundary: a large batch of UniLab's replay fields, checked whole.

A bad batch is refused before any state changes (a wrong width, dtype or device would fail, or
round silently, in the middle of an iteration, with half of its updates applied).
"""

from __future__ import annotations

from typing import Mapping

import torch

BATCH_FIELDS = ("obs", "actions", "rewards", "next_obs", "dones", "truncated", "critic", "next_critic")


def check_batch(batch: dict[str, torch.Tensor], updates_per_step: int, dims: Mapping[str, int], device: torch.device) -> int:
    """Check a large batch of ``updates_per_step`` x batch-size rows for a learner of ``dims``
    (obs, critic_obs, action) on ``device``; return the per-update batch size.

    Raises ValueError naming the field, the expected and the actual shape/dtype/device.
    """
    if not isinstance(batch, dict):
        raise ValueError(f"batch must be a dict of tensors, got {type(batch).__name__}")
    missing = [k for k in BATCH_FIELDS if k not in batch]
    if missing:
        raise ValueError(f"batch is missing field(s) {missing}; expected fields {list(BATCH_FIELDS)}")
    for name in BATCH_FIELDS:
        if not isinstance(batch[name], torch.Tensor):
            raise ValueError(f"batch[{name!r}]: expected a torch.Tensor, got {type(batch[name]).__name__}")
    rows = batch["actions"].shape[0] if batch["actions"].ndim else 0
    if rows == 0 or rows % updates_per_step:
        raise ValueError(
            f"batch['actions']: expected rows = updates_per_step ({updates_per_step}) x batch_size, "
            f"got shape {tuple(batch['actions'].shape)}"
        )
    widths = {
        "obs": dims["obs"],
        "next_obs": dims["obs"],
        "actions": dims["action"],
        "critic": dims["critic_obs"],
        "next_critic": dims["critic_obs"],
    }
    for name in BATCH_FIELDS:
        t = batch[name]
        if name in widths:
            expected: tuple[tuple[int, ...], ...] = ((rows, widths[name]),)
        else:
            expected = ((rows,), (rows, 1))
        if tuple(t.shape) not in expected:
            raise ValueError(
                f"batch[{name!r}]: expected shape {' or '.join(str(e) for e in expected)}, got {tuple(t.shape)}"
            )
        # float32 only, checked before any state changes: another dtype would fail (float64
        # in batch_norm) or round silently (bfloat16) in the middle of an iteration.
        if t.dtype != torch.float32:
            raise ValueError(f"batch[{name!r}]: expected dtype torch.float32, got {t.dtype} (convert with .float())")
        if t.device != device:
            raise ValueError(f"batch[{name!r}]: expected device {device}, got {t.device}")
    return rows // updates_per_step

