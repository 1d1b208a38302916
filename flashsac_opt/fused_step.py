"""Issue 45, item 3: a network's post-backward step as one Triton launch (FlashSACConfig.fused_gated_step).

optim.GatedStep is the whole work after a network's backward: the finite guard, Adam, the unit
renormalization, the commit, and for the critic the Polyak update of its target. Inductor fuses it
into several kernels per network, each a pass over the flat buffers: the renormalization's norms
are reductions over the Adam proposal that must end before any row is rescaled, and its kernels
for a flat buffer are not shaped by the units' boundaries (how many launches and passes it makes
on the GPU is what experiments/bench/gated_step.py counts). Here one
program per *renormalization unit* (a unit linear's row; a BatchNorm weight row with its bias row;
an RMSNorm scale; a span of unnormalized parameters) computes its Adam proposal, reduces the unit's
squared norm, recomputes the proposal from the now cached inputs, rescales it and, if the step is
finite, writes parameter, moments and target: each flat array crosses HBM once. The guard's
reduction (every gradient element finite) stays an Inductor kernel before it: it must finish before
any unit may write. The scalar work (step counters, the next step's coefficients, BatchNorm
statistics) stays in PyTorch.

The kernel is a `torch.library.custom_op` with a Triton body that mutates its buffers (like
kernels.py's and gemm_stats.py's: traced as one node, launched in Inductor's graph, captured with
the rest); one fixed configuration, no autotuning. Numerics: the norms' float32 sums are ordered
differently from Inductor's and eager's reductions, so values agree with GatedStep's composite to
float32 rounding, not bit for bit; CPU eager (the oracle path) never uses it.
"""

from __future__ import annotations

import torch

from flashsac_opt.flat import FlatLayout

# elements per loop step of a program (the units are 29 to 1024 wide) and its warps: fixed, no autotuning
CHUNK, NUM_WARPS = 256, 2
NONE_SPAN = 1024  # unnormalized parameters are cut into units of at most this many elements
KIND = {"none": 0, "rows": 1, "affine": 2, "scale": 2}

_registered = False


def require(device: torch.device) -> None:
    """Register the op for a learner that asked for it; a clear error where it cannot run."""
    from flashsac_opt import kernels

    kernels.check_runnable("fused_gated_step", device)
    register()


def renorm_units(layout: FlatLayout, groups: list[tuple[str, str, str, int]]) -> torch.Tensor:
    """The units of a network's flat buffer, as the kernel reads them: an int32 (units, 4) table of
    (first offset, offset of the second segment from the first or 0, segment length, kind), covering
    every element exactly once. ``groups`` are networks.class_ordered_layout's (kind, first slot,
    last slot, count), each a contiguous block: "rows" of one width; "affine" (weight, bias) pairs
    of tensors of shape (..., D), normalized jointly per row of D; "scale" tensors normalized per row
    of D."""
    units: list[tuple[int, int, int, int]] = []
    covered: list[tuple[int, int]] = []
    for kind, first, last, count in groups:
        slot = layout.slots[first]
        start, end = slot.offset, layout.slots[last].offset + layout.slots[last].numel
        width = slot.shape[-1]
        if kind in ("rows", "scale"):  # each row of D alone
            units += [(at, 0, width, KIND[kind]) for at in range(start, end, width)]
        elif kind == "affine":  # pair i: weight = tensor 2i, bias = tensor 2i + 1, each of slot.numel
            numel = slot.numel
            for pair in range(count // 2):
                base = start + 2 * pair * numel
                units += [(base + row * width, numel, width, KIND[kind]) for row in range(numel // width)]
        else:
            raise ValueError(f"unknown renormalization class {kind!r}")
        covered.append((start, end))
    covered.sort()
    gaps, at = [], 0
    for start, end in covered + [(layout.numel, layout.numel)]:
        if start > at:
            gaps.append((at, start))
        at = max(at, end)
    for start, end in gaps:
        units += [(s, 0, min(NONE_SPAN, end - s), KIND["none"]) for s in range(start, end, NONE_SPAN)]
    if max(u[0] + u[1] + u[2] for u in units) > 2**31 - 1:
        raise ValueError("fused_gated_step: a flat buffer over 2**31 elements does not fit the kernel's int32 table")
    return torch.tensor(sorted(units), dtype=torch.int32)


def gated_adam_(param, grad, exp_avg, exp_avg_sq, coefficients, ok, units, target, polyak_weight, beta1, beta2, eps, renorm_eps):
    """Launch the kernel (fused_step_triton.gated_adam_kernel): see the module docstring. ``ok``: the
    float32 finite flag (1 or 0, one element); ``target`` (or None) moves toward the new parameters
    by ``polyak_weight`` (one float32 element: tau, or 0 when the step is skipped)."""
    from flashsac_opt import fused_step_triton

    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)) + (
        (("target", target),) if target is not None else ()
    ):
        if t.dtype != torch.float32 or t.shape != param.shape or not t.is_contiguous():
            raise ValueError(f"fused_gated_step: {name} must be a contiguous float32 tensor of shape {tuple(param.shape)}")
    if target is not None and (polyak_weight is None or polyak_weight.numel() != 1):
        raise ValueError("fused_gated_step: a Polyak target needs its weight as a one-element tensor")
    if units.dtype != torch.int32 or units.dim() != 2 or units.shape[1] != 4:
        raise ValueError(f"fused_gated_step: units must be an int32 (units, 4) table, got {units.dtype} {tuple(units.shape)}")
    fused_step_triton.gated_adam_kernel[(units.shape[0],)](
        param, grad, exp_avg, exp_avg_sq, target if target is not None else param, coefficients, ok, units,
        polyak_weight if polyak_weight is not None else ok, beta1, beta2, eps, renorm_eps,
        HAS_TARGET=target is not None, CHUNK=CHUNK, num_warps=NUM_WARPS,
    )


def register():
    """Register the custom op (once; needs Triton). A registration cannot be traced: the learner
    calls this at construction."""
    global _registered
    if _registered:
        return

    @torch.library.custom_op("flashsac_opt::gated_adam_step", mutates_args=("param", "exp_avg", "exp_avg_sq", "target"))
    def gated_adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                        coefficients: torch.Tensor, ok: torch.Tensor, units: torch.Tensor, target: torch.Tensor | None,
                        polyak_weight: torch.Tensor | None, beta1: float, beta2: float, eps: float, renorm_eps: float) -> None:
        gated_adam_(param, grad, exp_avg, exp_avg_sq, coefficients, ok, units, target, polyak_weight, beta1, beta2, eps, renorm_eps)

    @gated_adam_step.register_fake
    def _(param, grad, exp_avg, exp_avg_sq, coefficients, ok, units, target, polyak_weight, beta1, beta2, eps, renorm_eps):
        return None

    _registered = True
