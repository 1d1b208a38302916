"""Adam over one flat parameter buffer, with the finite guard and renormalization fused in.

One ``GatedStep`` is the whole post-backward work for a network: the finite check, Adam,
the unit renormalization, the commit of the new BatchNorm statistics and, for the critic, the
Polyak update of its target. It is written
as plain tensor math on whole buffers (no per-tensor loops, no ``.item()``), so eager runs
it in ~20 kernels and Inductor fuses it into a few; a skipped step writes back the old
values, decided on the device.
"""

from __future__ import annotations

from typing import Callable

import torch

from flashsac_opt.networks import RENORM_EPS


class FlatAdam:
    """Adam state for one flat parameter tensor (betas 0.9/0.999, eps 1e-8, no decay).

    ``step`` counts *applied* updates (a skipped step does not advance bias correction,
    like fused Adam's ``found_inf``); ``schedule_step`` counts attempts and drives the LR
    schedule, which UniLab advances on every update whether it was applied or not.
    Scalars are float64 device tensors so bias corrections match Python-float Adam.

    ``coefficients`` holds the next step's two scalars (step size, sqrt of the second bias
    correction), computed once after each step (``GatedStep.refresh``) and read by the
    elementwise update. Computed inside it, Inductor inlined that float64 scalar math (the
    LR's cosine, two powers, a square root) into the loop over every parameter: the slowest
    kernel of the learner at W1 and W3 on an H200 (results/roofline/README.md). Derived from
    ``step``/``schedule_step``: not saved, refreshed on load.
    """

    def __init__(self, numel: int, device: torch.device, betas=(0.9, 0.999), eps: float = 1e-8):
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.exp_avg = torch.zeros(numel, device=device)
        self.exp_avg_sq = torch.zeros(numel, device=device)
        # Shape (1,), not 0-dim: torch.compile treats a 0-dim float64 tensor like a Python
        # float and silently drops in-place updates to it (seen with torch 2.13).
        self.step = torch.zeros(1, device=device, dtype=torch.float64)
        self.schedule_step = torch.zeros(1, device=device, dtype=torch.float64)
        self.coefficients = torch.zeros(2, device=device)  # the next step's [step size, sqrt(bias correction 2)]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            "exp_avg": self.exp_avg,
            "exp_avg_sq": self.exp_avg_sq,
            "step": self.step,
            "schedule_step": self.schedule_step,
        }

    def next_coefficients(self, lr: torch.Tensor) -> torch.Tensor:
        """[step size, sqrt(bias correction 2)] of the step after ``step`` applied ones, at ``lr``."""
        step = self.step + 1
        step_size = (lr / (1 - self.beta1**step)).float()
        correction2_sqrt = torch.sqrt(1 - self.beta2**step).float()
        return torch.cat([step_size, correction2_sqrt])

    def proposal(self, param: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return (new param, new exp_avg, new exp_avg_sq) for one Adam step; writes nothing."""
        exp_avg = torch.lerp(self.exp_avg, grad, 1 - self.beta1)
        exp_avg_sq = torch.addcmul(self.exp_avg_sq * self.beta2, grad, grad, value=1 - self.beta2)
        step_size, correction2_sqrt = self.coefficients[0:1], self.coefficients[1:2]
        denom = exp_avg_sq.sqrt() / correction2_sqrt + self.eps
        return param - (step_size * exp_avg) / denom, exp_avg, exp_avg_sq


class GatedStep:
    """Finite-guarded Adam + renormalization + BN-statistics commit (+ Polyak) for one network.

    ``fused_units``: the network's renormalization units (fused_step.renorm_units); given, the
    proposal, renormalization, commit and Polyak run as fused_step's one Triton launch
    (FlashSACConfig.fused_gated_step), the finite check and the scalars as before."""

    def __init__(
        self,
        param: torch.Tensor,
        bn_stats: torch.Tensor | None,
        adam: FlatAdam,
        renormalize: Callable[[torch.Tensor], torch.Tensor] | None,
        lr_fn: Callable[[torch.Tensor], torch.Tensor],
        fused_units: torch.Tensor | None = None,
    ):
        self.param, self.bn_stats, self.adam = param, bn_stats, adam
        self.renormalize, self.lr_fn = renormalize, lr_fn
        self.fused_units = fused_units
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """Recompute the Adam coefficients of the next step from the step counters (after a
        checkpoint load, which writes the counters)."""
        self.adam.coefficients.copy_(self.adam.next_coefficients(self.lr_fn(self.adam.schedule_step)))

    @torch.no_grad()
    def __call__(
        self,
        grad: torch.Tensor,
        loss: torch.Tensor,
        new_stats: torch.Tensor | None = None,
        polyak: tuple[torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        """Apply one step if loss and gradient are finite; return the 0-dim ``ok`` flag (bool).
        ``polyak = (target, tau)``: then ``target`` moves toward the new parameters by ``tau`` (not
        at all when the step is skipped)."""
        ok = torch.isfinite(loss).all() & torch.isfinite(grad).all()
        adam = self.adam
        if self.fused_units is not None:
            ok_f = ok.to(torch.float32)
            # the Polyak weight as a tensor: Dynamo may trace tau as a symbolic float, which an op's float argument refuses
            target, weight = (polyak[0], polyak[1] * ok_f) if polyak is not None else (None, None)
            torch.ops.flashsac_opt.gated_adam_step(
                self.param, grad, adam.exp_avg, adam.exp_avg_sq, adam.coefficients, ok_f, self.fused_units,
                target, weight, adam.beta1, adam.beta2, adam.eps, RENORM_EPS,
            )
        else:
            new_param, exp_avg, exp_avg_sq = adam.proposal(self.param, grad)
            if self.renormalize is not None:
                new_param = self.renormalize(new_param)
            self.param.copy_(torch.where(ok, new_param, self.param))
            adam.exp_avg.copy_(torch.where(ok, exp_avg, adam.exp_avg))
            adam.exp_avg_sq.copy_(torch.where(ok, exp_avg_sq, adam.exp_avg_sq))
            if polyak is not None:
                polyak[0].lerp_(self.param, polyak[1] * ok)
        adam.step.add_(ok.to(adam.step.dtype))
        adam.schedule_step.add_(1)
        self.refresh()
        if new_stats is not None and self.bn_stats is not None:
            self.bn_stats.copy_(torch.where(ok, new_stats, self.bn_stats))
        return ok
