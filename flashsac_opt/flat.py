"""Named tensors stored in one contiguous buffer.

Every network keeps its parameters in a single flat fp32 tensor (and its BatchNorm
running statistics in a second one). Forward passes read named *views* of that buffer,
so the optimizer step, the post-step renormalization and the Polyak target update each
touch one tensor instead of dozens: that is what turns ~20 per-tensor kernels into one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Slot:
    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class FlatLayout:
    """Offsets of named tensors inside one flat buffer (declaration order)."""

    def __init__(self, shapes: list[tuple[str, tuple[int, ...]]]):
        self.slots: dict[str, Slot] = {}
        offset = 0
        for name, shape in shapes:
            if name in self.slots:
                raise ValueError(f"duplicate slot name {name!r}")
            slot = Slot(name, tuple(int(s) for s in shape), offset)
            self.slots[name] = slot
            offset += slot.numel
        self.numel = offset

    def __contains__(self, name: str) -> bool:
        return name in self.slots

    def names(self) -> list[str]:
        return list(self.slots)

    def view(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        slot = self.slots[name]
        return flat[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every slot as a view of ``flat`` (which must hold exactly this layout).

        One ``split_with_sizes`` rather than a slice per slot: autograd then returns the
        flat gradient as one concatenation, where per-slot slices would each zero-fill a
        full-size buffer and add it in (~30 full-buffer passes per network in eager).
        """
        if flat.numel() != self.numel:
            raise ValueError(f"flat tensor has {flat.numel()} elements, the layout {self.numel}")
        pieces = flat.split_with_sizes([slot.numel for slot in self.slots.values()])
        return {name: piece.view(slot.shape) for (name, slot), piece in zip(self.slots.items(), pieces, strict=True)}

    def pack(self, tensors: dict[str, torch.Tensor], out: torch.Tensor) -> None:
        """Copy named tensors into ``out`` (shapes must match the layout exactly)."""
        missing = set(self.slots) - set(tensors)
        extra = set(tensors) - set(self.slots)
        if missing or extra:
            raise KeyError(f"layout mismatch: missing {sorted(missing)}, unexpected {sorted(extra)}")
        with torch.no_grad():
            for name, slot in self.slots.items():
                src = tensors[name]
                if tuple(src.shape) != slot.shape:
                    raise ValueError(
                        f"slot {name!r}: expected shape {slot.shape}, got {tuple(src.shape)}"
                    )
                self.view(out, name).copy_(src)
