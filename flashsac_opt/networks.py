"""FlashSAC networks (SimbaV2-style, unit-normalized) over flat parameter buffers.

Each network owns ``params`` (one flat fp32 ``nn.Parameter``) and ``bn_stats`` (one flat
buffer of BatchNorm running means/variances). ``forward`` takes the flat tensors as
arguments so the objectives can pass detached parameters (frozen critic: no weight
gradients at all) and so the optimizer, renormalization and Polyak update work on one
tensor each.

Training-mode forwards return the *new* running statistics instead of writing them, so
the learner can commit them only when the step is finite (see ``objectives``).

Layers:
- unit linear: bias-free, rows renormalized to unit L2 norm after every optimizer step;
- unit BatchNorm: momentum 0.01, (weight, bias) jointly rescaled to squared norm D;
- unit RMSNorm: scale rescaled to norm sqrt(D);
- block: linear(h->4h) -> BN -> ReLU -> linear(4h->h) -> BN -> ReLU, plus the residual.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from flashsac_opt import gemm_stats, kernels
from flashsac_opt.flat import FlatLayout

BN_MOMENTUM = 0.01
BN_EPS = 1e-5
RMS_EPS = 1e-6
RENORM_EPS = 1e-8
EXPANSION = 4


def tanh_log_det_jacobian(x: torch.Tensor) -> torch.Tensor:
    """log|d tanh(x)/dx| in the softplus form, finite for large |x|."""
    return 2.0 * (math.log(2.0) - x - F.softplus(-2.0 * x))


def class_ordered_layout(
    classes: list[tuple[str, list[tuple[str, tuple[int, ...]]]]],
) -> tuple[FlatLayout, list[tuple[str, str, str, int]]]:
    """Lay out parameters class by class so each renormalization class is one contiguous block.

    ``classes``: (kind, [(name, shape), ...]) with kind "rows" (unit-norm rows, all of one
    width), "affine" (BatchNorm weight, bias, weight, bias, ... of one width), "scale"
    (RMSNorm weights of one width) or "none". Returns the layout and the groups as
    (kind, first slot, last slot, count of tensors). One reduction per class instead of
    one per layer: 7 per critic step and 7 per actor step instead of 12 and 16.
    """
    shapes: list[tuple[str, tuple[int, ...]]] = []
    groups: list[tuple[str, str, str, int]] = []
    for kind, members in classes:
        if not members:
            continue
        shapes += members
        if kind != "none":
            groups.append((kind, members[0][0], members[-1][0], len(members)))
    return FlatLayout(shapes), groups


def gemm_prefix_layout(layout: FlatLayout, groups: list[tuple[str, str, str, int]]) -> FlatLayout:
    """Layout of the leading "rows" slots (the GEMM weights), which must come first."""
    names = layout.names()
    count = 0
    for kind, first, last, _ in groups:
        if kind != "rows" or names.index(first) != count:
            break
        count = names.index(last) + 1
    prefix = FlatLayout([(name, layout.slots[name].shape) for name in names[:count]])
    assert all(prefix.slots[n].offset == layout.slots[n].offset for n in prefix.slots)
    return prefix


def _renormalize(layout: FlatLayout, groups: list[tuple[str, str, str, int]], flat: torch.Tensor) -> torch.Tensor:
    """Return a renormalized copy of ``flat`` (``flat`` itself is not modified).

    Functional so that the learner can keep the old parameters when a step is skipped.
    Each group is a contiguous block; per row the arithmetic is UniLab's, op for op.
    """
    out = flat.clone()
    for kind, first, last, count in groups:
        start = layout.slots[first].offset
        end = layout.slots[last].offset + layout.slots[last].numel
        shape = layout.slots[first].shape
        block = out[start:end]
        if kind == "rows":  # unit linear: every output row to unit L2 norm
            rows = block.view(-1, shape[-1])
            rows.copy_(F.normalize(rows, dim=-1, eps=RENORM_EPS))
            continue
        dim = shape[-1]
        if kind == "affine":  # BatchNorm (weight, bias) pairs: w^2 + b^2 summed to D
            pairs = block.view(count // 2, 2, *shape)
            weight, bias = pairs[:, 0], pairs[:, 1]
            sqsum = torch.sum(weight * weight + bias * bias, dim=-1, keepdim=True)
            factor = math.sqrt(float(dim)) * torch.rsqrt(sqsum + RENORM_EPS)
            weight.mul_(factor)
            bias.mul_(factor)
        else:  # "scale": RMSNorm weight to norm sqrt(D)
            scales = block.view(count, *shape)
            sqsum = torch.sum(scales * scales, dim=-1, keepdim=True)
            scales.mul_(math.sqrt(float(dim)) * torch.rsqrt(sqsum + RENORM_EPS))
    return out


def _commit_statistics(s, name, mean, var, rows, new_stats):
    """A training-mode BN layer's running statistics as the composite path commits them (the
    variance unbiased), from batch moments a kernel computed."""
    new_stats.append(torch.lerp(s[f"{name}.mean"], mean, BN_MOMENTUM))
    new_stats.append(torch.lerp(s[f"{name}.var"], var * (rows / max(rows - 1, 1)), BN_MOMENTUM))


class _FlatNetwork(nn.Module):
    """Shared plumbing: flat parameters, BN statistics and their renormalization."""

    layout: FlatLayout
    renorm_groups: list[tuple[str, str, str, int]]

    bn_stats: torch.Tensor
    params: nn.Parameter
    stats_layout: FlatLayout
    gemm_layout: FlatLayout  # the "rows" (GEMM weight) slots: a prefix of ``layout``
    cast_gemm_weights_once = True
    # Each block layer's GEMM, training-mode BN, ReLU (and skip connection) in one Triton kernel
    # (EngineOptions.fused_linear_bn_relu).
    fused_linear_bn_relu = False
    # Each block through gemm_stats.block: two GEMMs with the statistics in their epilogues, the
    # up layer's BN + ReLU in the down GEMM's prologue (EngineOptions.gemm_stats_block).
    gemm_stats_block = False
    relu_in_autocast_dtype = False  # the critic's option; the actor's up projections stay float32

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Orthogonal weight matrices (per ensemble member), BN/RMS scales 1, biases 0."""
        matrices = set()
        for kind, first, last, _count in self.renorm_groups:
            if kind == "rows":
                names = self.layout.names()
                matrices.update(names[names.index(first) : names.index(last) + 1])
        for name, v in self.layout.views(self.params.data).items():
            if name in matrices:
                for matrix in v.reshape(-1, *v.shape[-2:]):
                    nn.init.orthogonal_(matrix)
            elif name.endswith("bias"):
                v.zero_()
            else:
                v.fill_(1.0)
        for name, v in self.stats_layout.views(self.bn_stats).items():
            v.fill_(1.0 if name.endswith(".var") else 0.0)
        self.params.data.copy_(self.renormalized(self.params.data))

    def gemm_weights(self, flat: torch.Tensor, views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The GEMM weights as the matmuls will read them.

        Under autocast every matmul casts its fp32 weight to the low-precision dtype: one
        small kernel per weight and call (~20 per update, ~2 us each at batch 256). The
        weights are the "rows" blocks at the front of the flat buffer, so one cast of that
        prefix gives all of them at once (the same values, bit for bit). Without autocast,
        or with casting per matmul (``cast_gemm_weights_once = False``), the fp32 views.
        """
        low_dtype = autocast_dtype(flat.device.type)
        if not (self.cast_gemm_weights_once and flat.dtype == torch.float32 and low_dtype is not None):
            return views
        return self.gemm_layout.views(flat[: self.gemm_layout.numel].to(low_dtype))

    def _fused_linear_bn_relu(self, x, w, p, s, name, new_stats, residual=None):
        """relu(BN_train(x @ w^T)) (+ residual) in one kernel (kernels.member_linear_bn_relu), for
        an ensemble's (members, rows, in) or one network's (rows, in) rows: the GEMM on autocast's
        dtype where it is on, as autocast would cast it; the output rounded to that dtype in the
        kernel under relu_in_autocast_dtype (the composite path's cast); the running statistics
        committed as the composite path commits them."""
        one = x.dim() == 2  # the actor: one member
        gamma, beta = p[f"{name}.weight"], p[f"{name}.bias"]
        if one:
            x, w, gamma, beta = x.unsqueeze(0), w.unsqueeze(0), gamma.unsqueeze(0), beta.unsqueeze(0)
            residual = residual.unsqueeze(0) if residual is not None else None
        low_dtype = autocast_dtype(x.device.type)
        dtype = low_dtype or torch.promote_types(x.dtype, w.dtype)
        with torch.autocast(device_type=x.device.type, enabled=False):
            y, mean, var = kernels.member_linear_bn_relu(
                x.to(dtype), w.to(dtype), gamma, beta, BN_EPS,
                y_in_input_dtype=residual is None and self.relu_in_autocast_dtype and low_dtype is not None, residual=residual)
        if one:
            y, mean, var = y.squeeze(0), mean.squeeze(0), var.squeeze(0)
        rows = x.shape[1]
        _commit_statistics(s, name, mean, var, rows, new_stats)
        return y

    def _gemm_stats_block(self, x, w, p, s, b, new_stats):
        """A training-mode block through gemm_stats.block (four launches), for an ensemble's
        (members, rows, hidden) or one network's (rows, hidden) rows: the GEMMs on autocast's dtype
        where it is on, the skip connection and the output in float32 as the composite's."""
        one = x.dim() == 2  # the actor: one member
        names = (f"{b}.up_bn.weight", f"{b}.up_bn.bias", f"{b}.down_bn.weight", f"{b}.down_bn.bias")
        w_up, w_down, affines = w[f"{b}.up"], w[f"{b}.down"], [p[n] for n in names]
        if one:
            x, w_up, w_down, affines = x.unsqueeze(0), w_up.unsqueeze(0), w_down.unsqueeze(0), [a.unsqueeze(0) for a in affines]
        dtype = autocast_dtype(x.device.type) or torch.promote_types(x.dtype, w_up.dtype)
        with torch.autocast(device_type=x.device.type, enabled=False):
            x_gemm = x.to(dtype)
            y, (mean_up, var_up), (mean_down, var_down) = gemm_stats.block(
                x_gemm, w_up.to(dtype), w_down.to(dtype), *affines, eps=BN_EPS, residual=None if x_gemm is x else x)
        if one:
            y, mean_up, var_up, mean_down, var_down = (t.squeeze(0) for t in (y, mean_up, var_up, mean_down, var_down))
        rows = x.shape[1]
        _commit_statistics(s, f"{b}.up_bn", mean_up, var_up, rows, new_stats)
        _commit_statistics(s, f"{b}.down_bn", mean_down, var_down, rows, new_stats)
        return y

    def _block(self, x, w, p, s, i, training, new_stats):
        """One SimbaV2 block in training mode through gemm_stats.block (four launches) or the fused
        kernel (two: up: GEMM, BN, ReLU; down: GEMM, BN, ReLU, skip connection). None where neither
        is on or applies (the composite path then runs)."""
        b = f"block{i}"
        if training and self.gemm_stats_block and gemm_stats.supports(x.shape[-2]):
            return self._gemm_stats_block(x, w, p, s, b, new_stats)
        rows_in = x if x.dim() == 3 else x.unsqueeze(0)
        w_up = w[f"{b}.up"] if x.dim() == 3 else w[f"{b}.up"].unsqueeze(0)
        if not (training and self.fused_linear_bn_relu and kernels.supports(rows_in, w_up)):
            return None
        y = self._fused_linear_bn_relu(x, w[f"{b}.up"], p, s, f"{b}.up_bn", new_stats)
        return self._fused_linear_bn_relu(y, w[f"{b}.down"], p, s, f"{b}.down_bn", new_stats, residual=x)

    def renormalized(self, flat: torch.Tensor) -> torch.Tensor:
        """Post-step renormalization of a flat parameter tensor (returns a new tensor).

        One reduction per class of same-width rows. (A single scatter-add over all layers was
        tried and measured 8x slower on the H200: Inductor's atomic adds serialize on each
        row's accumulator. See FLASH_SAC_OPTIMIZATION.md.)
        """
        return _renormalize(self.layout, self.renorm_groups, flat)


class FlashSACActor(_FlatNetwork):
    """Tanh-Gaussian policy: BN -> linear -> blocks -> RMSNorm -> (mean, log-std) heads."""

    zeta_cdf: torch.Tensor
    bn_stats: torch.Tensor

    def __init__(
        self,
        obs_dim: int,
        action_dim: int,
        hidden_dim: int = 128,
        num_blocks: int = 2,
        log_std_min: float = -10.0,
        log_std_max: float = 2.0,
        noise_zeta_mu: float = 2.0,
        noise_zeta_max: int = 16,
    ):
        super().__init__()
        self.obs_dim, self.action_dim, self.hidden_dim = obs_dim, action_dim, hidden_dim
        self.num_blocks = num_blocks
        self.log_std_min, self.log_std_max = float(log_std_min), float(log_std_max)
        h, e = hidden_dim, hidden_dim * EXPANSION
        blocks = [f"block{i}" for i in range(num_blocks)]
        self.layout, self.renorm_groups = class_ordered_layout(
            [
                ("rows", [("in_proj", (h, obs_dim))]),
                ("rows", [(f"{b}.up", (e, h)) for b in blocks] + [("mean.weight", (action_dim, h)), ("log_std.weight", (action_dim, h))]),
                ("rows", [(f"{b}.down", (h, e)) for b in blocks]),
                ("affine", [("in_bn.weight", (obs_dim,)), ("in_bn.bias", (obs_dim,))]),
                ("affine", [(f"{b}.up_bn.{p}", (e,)) for b in blocks for p in ("weight", "bias")]),
                ("affine", [(f"{b}.down_bn.{p}", (h,)) for b in blocks for p in ("weight", "bias")]),
                ("scale", [("out_rms", (h,))]),
                ("none", [("mean.bias", (action_dim,)), ("log_std.bias", (action_dim,))]),
            ]
        )
        self.gemm_layout = gemm_prefix_layout(self.layout, self.renorm_groups)
        stats: list[tuple[str, tuple[int, ...]]] = [("in_bn.mean", (obs_dim,)), ("in_bn.var", (obs_dim,))]
        for b in blocks:
            stats += [(f"{b}.up_bn.mean", (e,)), (f"{b}.up_bn.var", (e,))]
            stats += [(f"{b}.down_bn.mean", (h,)), (f"{b}.down_bn.var", (h,))]
        self.stats_layout = FlatLayout(stats)

        self.params = nn.Parameter(torch.zeros(self.layout.numel))
        self.register_buffer("bn_stats", torch.zeros(self.stats_layout.numel))
        ns = torch.arange(1, noise_zeta_max + 1, dtype=torch.float32)
        pmf = ns.pow(-noise_zeta_mu)
        self.register_buffer("zeta_cdf", torch.cumsum(pmf / pmf.sum(), dim=0))
        self.reset_parameters()
        # Collection-time exploration state, sized on first use (not checkpointed).
        self._held_noise: torch.Tensor | None = None
        self._hold_count: torch.Tensor | None = None
        self._hold_target: torch.Tensor | None = None
        # an explore_graph.CapturedExplore when the learner runs in graph mode (CUDA); networks
        # know nothing of graphs: anything with usable(obs, dones) and __call__(obs, dones)
        self.captured_explore: Any = None

    def _bn(self, x, p, s, name, training, new_stats):
        w, b = p[f"{name}.weight"], p[f"{name}.bias"]
        mean, var = s[f"{name}.mean"], s[f"{name}.var"]
        if not training:
            return F.batch_norm(x, mean, var, w, b, False, BN_MOMENTUM, BN_EPS)
        # F.batch_norm updates the running statistics it is given in place: hand it
        # copies, and report them as the new statistics for a gated commit.
        mean, var = mean.clone(), var.clone()
        out = F.batch_norm(x, mean, var, w, b, True, BN_MOMENTUM, BN_EPS)
        new_stats += [mean, var]
        return out

    def distribution_params(
        self, obs: torch.Tensor, params: torch.Tensor, stats: torch.Tensor, training: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Return (mean, std, new_bn_stats or None)."""
        p = self.layout.views(params)
        w = self.gemm_weights(params, p)
        s = self.stats_layout.views(stats)
        new_stats: list[torch.Tensor] = []
        x = F.linear(self._bn(obs, p, s, "in_bn", training, new_stats), w["in_proj"])
        for i in range(self.num_blocks):
            if (fused := self._block(x, w, p, s, i, training, new_stats)) is not None:
                x = fused
                continue
            b = f"block{i}"
            y = F.relu(self._bn(F.linear(x, w[f"{b}.up"]), p, s, f"{b}.up_bn", training, new_stats))
            y = F.relu(self._bn(F.linear(y, w[f"{b}.down"]), p, s, f"{b}.down_bn", training, new_stats))
            x = y + x
        # Kept as x / sqrt(.) (not x * rsqrt(.)) so eager results match UniLab bit for bit.
        x = (x / torch.sqrt(torch.mean(x * x, dim=-1, keepdim=True) + RMS_EPS)) * p["out_rms"]
        mean = F.linear(x, w["mean.weight"], p["mean.bias"])
        squashed = 1.0 + torch.tanh(F.linear(x, w["log_std.weight"], p["log_std.bias"]))
        log_std = self.log_std_min + 0.5 * (self.log_std_max - self.log_std_min) * squashed
        std = torch.exp(log_std)
        packed = torch.cat([t.reshape(-1) for t in new_stats]) if training else None
        return mean, std, packed

    def forward(
        self,
        obs: torch.Tensor,
        noise: torch.Tensor,
        training: bool,
        params: torch.Tensor | None = None,
        stats: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Reparameterized sample with the given standard-normal ``noise``.

        Returns (tanh action, log-prob summed over action dims, new BN stats or None).
        """
        params = self.params if params is None else params
        stats = self.bn_stats if stats is None else stats
        mean, std, new_stats = self.distribution_params(obs, params, stats, training)
        raw = mean + noise.to(mean.dtype) * std
        # The order of these ops is deliberate: autograd sums the gradients reaching `raw`
        # and `std` in the order their consumers were recorded, so recording them exactly
        # as torch.distributions.Normal does (rsample, tanh, log_prob) keeps eager gradients
        # bit-identical to UniLab's. Adam turns any rounding difference in a near-zero
        # gradient into a full +-lr step, so "close" here would not stay close.
        action = torch.tanh(raw)
        var = std**2
        log_std = std.log()
        log_prob = -((raw - mean) ** 2) / (2 * var) - log_std - math.log(math.sqrt(2 * math.pi))
        log_prob = (log_prob - tanh_log_det_jacobian(raw)).sum(dim=-1)
        return action, log_prob, new_stats

    @torch.no_grad()
    def explore(
        self, obs: torch.Tensor, dones: torch.Tensor | None = None, deterministic: bool = False
    ) -> torch.Tensor:
        """Collection action with Zeta-held noise.

        Each env holds one Gaussian noise vector for k steps, k ~ truncated Zeta(mu) on
        [1, zeta_max]; it is redrawn when the hold expires or the episode ends. Branch-free
        (``torch.where``), so it never synchronizes with the host. With ``captured_explore``
        set (graph mode on CUDA, see explore_graph.py) the stochastic call is one graph replay.
        """
        self._check_collection_input(obs, dones)
        if deterministic:
            return torch.tanh(self.distribution_params(obs, self.params, self.bn_stats, training=False)[0])
        if self.captured_explore is not None and self.captured_explore.usable(obs, dones):
            return self.captured_explore(obs, dones)
        return self.explore_step(obs, dones)

    def _check_collection_input(self, obs: torch.Tensor, dones: torch.Tensor | None) -> None:
        """The collector's side of the learner boundary: a clear error before anything is
        captured or drawn (a wrong width would otherwise fail inside a GEMM, or be captured)."""
        if not isinstance(obs, torch.Tensor) or obs.dim() != 2 or obs.shape[1] != self.obs_dim:
            shape = tuple(obs.shape) if isinstance(obs, torch.Tensor) else type(obs).__name__
            raise ValueError(f"explore: obs must be a (num_envs, {self.obs_dim}) tensor, got {shape}")
        if not obs.is_floating_point():
            raise ValueError(f"explore: obs must be floating point, got {obs.dtype}")
        if dones is not None and (not isinstance(dones, torch.Tensor) or dones.numel() != obs.shape[0]):
            got = tuple(dones.shape) if isinstance(dones, torch.Tensor) else type(dones).__name__
            raise ValueError(f"explore: dones must hold one flag per env ({obs.shape[0]}), got {got}")

    def explore_step(self, obs: torch.Tensor, dones: torch.Tensor | None) -> torch.Tensor:
        """One stochastic collection step; the held-noise state is updated in place (a captured
        graph reads and writes it by address)."""
        mean, std, _ = self.distribution_params(obs, self.params, self.bn_stats, training=False)
        n = mean.shape[0]
        held, count, target = self.ensure_exploration_state(n, mean.device, mean.dtype)
        redraw = (count <= 0) | (count >= target)
        if dones is not None:
            redraw = redraw | (dones.to(mean.device).reshape(-1) > 0.5)
        # drawn every step, whether or not an env redraws (UniLab draws only then, after a host
        # sync on torch.any): the same law, other numbers
        fresh_target = torch.searchsorted(self.zeta_cdf, torch.rand(n, device=mean.device)).to(torch.int32) + 1
        held.copy_(torch.where(redraw.unsqueeze(-1), torch.randn_like(mean), held))
        target.copy_(torch.where(redraw, fresh_target, target))
        count.copy_(torch.where(redraw, torch.ones_like(count), count + 1))
        return torch.tanh(mean + std * held)

    def ensure_exploration_state(
        self, n: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(held noise, hold count, hold target) for ``n`` envs: kept while the shape, device
        and dtype stay, new zeros (every env redraws) otherwise."""
        held = self._held_noise
        if held is None or held.shape != (n, self.action_dim) or held.device != device or held.dtype != dtype:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                # new state inside a capture would live in the graph's pool and be re-zeroed by every replay
                raise RuntimeError("the exploration state must exist before the collection forward is captured")
            self.use_exploration_state(
                (torch.zeros(n, self.action_dim, device=device, dtype=dtype),
                 torch.zeros(n, dtype=torch.int32, device=device), torch.zeros(n, dtype=torch.int32, device=device))
            )
        assert self._held_noise is not None and self._hold_count is not None and self._hold_target is not None
        return self._held_noise, self._hold_count, self._hold_target

    def exploration_state(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        if self._held_noise is None or self._hold_count is None or self._hold_target is None:
            return None
        return self._held_noise, self._hold_count, self._hold_target

    def use_exploration_state(self, state: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        self._held_noise, self._hold_count, self._hold_target = state


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast casts GEMM inputs to on ``device_type`` right now, None when it is off."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


class _MemberLinear(torch.autograd.Function):
    """y[n] = x[n] @ w[n]^T for every ensemble member n (x (n, B, in), w (n, out, in)), with the
    weight gradient formed as g^T x: it comes out (n, out, in), the weight's own layout.

    einsum's backward forms x^T g, (n, in, out), and returns its transpose: the flat gradient's
    assembly (one buffer for every weight) then reads each GEMM weight's gradient transposed, a
    strided gather of ~2.2 M elements per critic step (13 us a launch at W2 on the H200, about 2%
    of the iteration; results/roofline/README.md). The same sums; cuBLAS may round them in
    another order. Grads are formed only for the inputs that need them, so a frozen critic in the
    actor step still does no weight-gradient GEMM."""

    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x, w.transpose(1, 2))

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # setup_context: torch.func transforms need it
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w = ctx.saved_tensors
        grad_x = torch.bmm(grad, w) if ctx.needs_input_grad[0] else None
        grad_w = torch.bmm(grad.transpose(1, 2), x) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


def member_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``einsum("nbi,noi->nbo", x, w)`` through _MemberLinear. Under autocast both operands are
    cast first, as autocast would cast them for the bmm, and the Function runs with autocast
    off, so its backward sees the same dtypes as its forward."""
    dtype = autocast_dtype(x.device.type)
    if dtype is None:
        return _MemberLinear.apply(x, w)
    with torch.autocast(device_type=x.device.type, enabled=False):
        return _MemberLinear.apply(x.to(dtype), w.to(dtype))


def batch_moments(x: torch.Tensor, chunk_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and biased variance of ``x`` (members, rows, features) over the rows, keepdim.

    ``chunk_rows`` > 0 (dividing the rows into two or more chunks): per-chunk mean and variance,
    combined exactly (equal chunks: the variance is the chunks' mean variance plus the variance
    of their means). Same statistics up to rounding, but a reduction with members x chunks x
    features outputs, which Inductor spreads over many more thread blocks than one with
    members x features outputs and a loop over every row (the critic's input BN at W3:
    2 x 130 outputs, 4096 rows each, the slowest BN kernel; results/roofline/README.md).
    0, or rows it does not split evenly: one pass, UniLab's order (eager bit-identical).
    The chunks are combined in float32 (or x's wider dtype) and rounded to ``x``'s dtype once
    (under bf16 autocast per-chunk bf16 results would add a rounding per stage).
    """
    n, rows, d = x.shape
    if chunk_rows <= 0 or rows % chunk_rows or rows // chunk_rows < 2:
        return x.mean(dim=1, keepdim=True), x.var(dim=1, correction=0, keepdim=True)
    parts = x.reshape(n, rows // chunk_rows, chunk_rows, d).to(torch.promote_types(x.dtype, torch.float32))
    part_mean = parts.mean(dim=2, keepdim=True)
    part_var = parts.var(dim=2, correction=0, keepdim=True)
    mean = part_mean.mean(dim=1)
    var = (part_var + (part_mean - mean.unsqueeze(1)) ** 2).mean(dim=1)
    return mean.to(x.dtype), var.to(x.dtype)


class FlashSACCritic(_FlatNetwork):
    """Ensemble (default 2) of categorical critics with batched weights.

    Input cat(critic_obs, action) is shared by the members; every weight has a leading
    ensemble dimension. Output: Q (n, B) and atom log-probabilities (n, B, num_atoms).
    """

    support: torch.Tensor
    bn_stats: torch.Tensor

    def __init__(
        self,
        obs_dim: int,
        action_dim: int,
        hidden_dim: int = 256,
        num_blocks: int = 2,
        num_atoms: int = 101,
        v_min: float = -5.0,
        v_max: float = 5.0,
        num_members: int = 2,
    ):
        super().__init__()
        n, d, h, e = num_members, obs_dim + action_dim, hidden_dim, hidden_dim * EXPANSION
        self.num_members, self.num_blocks, self.num_atoms = n, num_blocks, num_atoms
        self.obs_dim, self.action_dim, self.hidden_dim = obs_dim, action_dim, hidden_dim
        blocks = [f"block{i}" for i in range(num_blocks)]
        self.layout, self.renorm_groups = class_ordered_layout(
            [
                ("rows", [("in_proj", (n, h, d))]),
                ("rows", [(f"{b}.up", (n, e, h)) for b in blocks] + [("logits.weight", (n, num_atoms, h))]),
                ("rows", [(f"{b}.down", (n, h, e)) for b in blocks]),
                ("affine", [("in_bn.weight", (n, d)), ("in_bn.bias", (n, d))]),
                ("affine", [(f"{b}.up_bn.{p}", (n, e)) for b in blocks for p in ("weight", "bias")]),
                ("affine", [(f"{b}.down_bn.{p}", (n, h)) for b in blocks for p in ("weight", "bias")]),
                ("scale", [("out_rms", (n, h))]),
                ("none", [("logits.bias", (n, num_atoms))]),
            ]
        )
        self.gemm_layout = gemm_prefix_layout(self.layout, self.renorm_groups)
        stats: list[tuple[str, tuple[int, ...]]] = [("in_bn.mean", (n, d)), ("in_bn.var", (n, d))]
        for b in blocks:
            stats += [(f"{b}.up_bn.mean", (n, e)), (f"{b}.up_bn.var", (n, e))]
            stats += [(f"{b}.down_bn.mean", (n, h)), (f"{b}.down_bn.var", (n, h))]
        self.stats_layout = FlatLayout(stats)
        self.params = nn.Parameter(torch.zeros(self.layout.numel))
        self.register_buffer("bn_stats", torch.zeros(self.stats_layout.numel))
        self.register_buffer("support", torch.linspace(v_min, v_max, num_atoms), persistent=False)
        self.reset_parameters()

    # Rows per chunk of the input BN's training-mode statistics (EngineOptions.input_bn_chunk_rows); 0: one pass.
    input_bn_chunk_rows = 0
    # The members' GEMMs through member_linear (EngineOptions.contiguous_weight_grads); False: einsum.
    contiguous_weight_grads = False
    # The input BN's statistics reduced once for all members (EngineOptions.shared_input_bn_statistics).
    shared_input_bn_statistics = False
    # The up projections' ReLU on autocast's dtype (EngineOptions.relu_in_autocast_dtype).
    relu_in_autocast_dtype = False

    def _linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.contiguous_weight_grads:
            return member_linear(x, w)
        return torch.einsum("nbi,noi->nbo", x, w)

    def _bn(self, x, p, s, name, training, new_stats):
        w, b = p[f"{name}.weight"].unsqueeze(1), p[f"{name}.bias"].unsqueeze(1)
        if training:
            # Batch statistics per member over the batch axis (dim 1). The input layer's rows are
            # one tensor expanded over the members (stride 0): with shared_input_bn_statistics its
            # statistics are reduced once and broadcast, the same values as each member's.
            shared = name == "in_bn" and self.shared_input_bn_statistics
            if shared and x.stride(0) != 0:
                raise ValueError("shared_input_bn_statistics needs the input rows expanded over the members")
            mean, var = batch_moments(x[:1] if shared else x, self.input_bn_chunk_rows if name == "in_bn" else 0)
            rows = x.shape[1]
            unbiased = rows / max(rows - 1, 1)
            new_stats.append(torch.lerp(s[f"{name}.mean"], mean.squeeze(1).float(), BN_MOMENTUM))
            new_stats.append(torch.lerp(s[f"{name}.var"], (var.squeeze(1) * unbiased).float(), BN_MOMENTUM))
            return (x - mean) * torch.rsqrt(var + BN_EPS) * w + b
        mean, var = s[f"{name}.mean"].unsqueeze(1), s[f"{name}.var"].unsqueeze(1)
        return (x - mean) * torch.rsqrt(var + BN_EPS) * w + b

    def forward(
        self,
        obs: torch.Tensor,
        actions: torch.Tensor,
        training: bool,
        params: torch.Tensor | None = None,
        stats: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Returns (Q per member (n, B), atom log-probs (n, B, atoms), new BN stats or None)."""
        flat = self.params if params is None else params
        p = self.layout.views(flat)
        s = self.stats_layout.views(self.bn_stats if stats is None else stats)
        q, log_probs, new_stats = self._members(obs, actions, training, p, self.gemm_weights(flat, p), s)
        packed = torch.cat([t.reshape(-1) for t in new_stats]) if training else None
        return q, log_probs, packed

    def forward_stacked(
        self,
        obs: torch.Tensor,
        actions: torch.Tensor,
        params: tuple[torch.Tensor, torch.Tensor],
        stats: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Two critics of this architecture on the same rows as one ensemble of 2n members
        (training-mode BN): every layer is one batched GEMM and one statistics pass instead of
        two. The members are independent, so each half is what its own ``forward`` gives, up to
        the GEMMs' rounding (another batch count may pick another cuBLAS kernel). Returns Q
        (2n, B), log-probs (2n, B, atoms), each critic's new BN statistics packed. A detached
        ``params[1]`` (the target critic) gets no gradient, but the backward still runs the
        full-width layers (zeros for that half): the FLOPs double, which pays only where the
        kernels are latency-bound (EngineOptions.stack_target_critic)."""
        views = [self.layout.views(flat) for flat in params]
        weights = [self.gemm_weights(flat, v) for flat, v in zip(params, views)]
        stat_views = [self.stats_layout.views(flat) for flat in stats]
        p = {k: torch.cat([v[k] for v in views]) for k in views[0]}
        w = {k: torch.cat([v[k] for v in weights]) for k in weights[0]}
        s = {k: torch.cat([v[k] for v in stat_views]) for k in stat_views[0]}
        q, log_probs, new_stats = self._members(obs, actions, True, p, w, s)
        n = self.num_members
        packed = tuple(torch.cat([t[half].reshape(-1) for t in new_stats]) for half in (slice(None, n), slice(n, None)))
        return q, log_probs, packed

    def _members(self, obs, actions, training, p, w, s) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """The ensemble's forward on per-slot views whose leading dimension is the members."""
        new_stats: list[torch.Tensor] = []
        x = torch.cat((obs, actions), dim=-1)
        x = x.unsqueeze(0).expand(w["in_proj"].shape[0], -1, -1)
        x = self._linear(self._bn(x, p, s, "in_bn", training, new_stats), w["in_proj"])
        for i in range(self.num_blocks):
            if (fused := self._block(x, w, p, s, i, training, new_stats)) is not None:
                x = fused
                continue
            b = f"block{i}"
            y = self._linear(x, w[f"{b}.up"])
            y = self._bn(y, p, s, f"{b}.up_bn", training, new_stats)
            if self.relu_in_autocast_dtype and (low_dtype := autocast_dtype(y.device.type)) is not None:
                # Round before the ReLU, not after: rounding to nearest keeps order and sign, so
                # the down GEMM gets the same values, and the backward keeps this bf16 output
                # instead of an fp32 one (the fp32 comes from the BN affine's fp32 weights).
                y = y.to(low_dtype)
            y = F.relu(y)
            y = self._linear(y, w[f"{b}.down"])
            y = F.relu(self._bn(y, p, s, f"{b}.down_bn", training, new_stats))
            x = y + x
        x = (x / torch.sqrt(torch.mean(x * x, dim=-1, keepdim=True) + RMS_EPS)) * p["out_rms"].unsqueeze(1)
        logits = self._linear(x, w["logits.weight"]) + p["logits.bias"].unsqueeze(1)
        log_probs = F.log_softmax(logits, dim=-1)
        q = torch.sum(log_probs.exp() * self.support.view(1, 1, -1), dim=-1)
        return q, log_probs, new_stats


class FlashSACTemperature(nn.Module):
    """Entropy temperature alpha = exp(log_temp)."""

    def __init__(self, initial_value: float = 0.01):
        super().__init__()
        self.log_temp = nn.Parameter(torch.tensor([math.log(initial_value)], dtype=torch.float32))

    def forward(self) -> torch.Tensor:
        return torch.exp(self.log_temp)
