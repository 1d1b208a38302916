"""Issue 45, item 1: a row-split GEMM that reduces BatchNorm's batch statistics in its epilogue,
and applies the previous layer's BatchNorm + ReLU in its prologue. A measured study, off
(FlashSACConfig.gemm_stats_block). On one H100 (2026-12-07) a SimbaV2 block's forward + backward
took 0.81x of the composite's time alone (experiments/bench/gemm_stats_block.py), but the learner
took 1.056x / 1.060x of graph mode's at W1 / W2 with as many kernels: in the learner Inductor
already folds a block's statistics and apply into neighbouring kernels, and nothing folds into
these launches (results/learner_benchmark/gemm_stats_block_2026-12-07).

Why row-split. kernels.member_linear_bn_relu holds every row of a block of features in one
program, so the statistics are a reduction inside it; but its down projection has 32 programs,
each reading the whole input (rows x 1024), and in the learner it was slower than cuBLAS +
Inductor. Here a program owns one (TILE_M rows) x (BLOCK_N features) tile, as a GEMM's would, and
writes, besides its tile of h = a @ w^T, each feature's sum and centred sum of squares over its
rows ("partials", float32, from the accumulator). The statistics combine a layer's few row tiles
(Chan's parallel formula: no E[h^2] - E[h]^2 cancellation):

    mean = sum_t s_t / rows;  M2 = sum_t (m2_t + n_t (s_t / n_t - mean)^2);  var = M2 / rows

`finalize` does that once per layer (a small launch) and gives BatchNorm's affine as a scale and a
shift per feature; the next GEMM applies them and the ReLU to each input tile in its prologue,
before the dot, so the BatchNorm output is never written and read back. `bn_relu_apply` combines
the partials itself for a layer whose consumer is not a GEMM of ours (a block's output: BatchNorm,
ReLU and the skip connection), and writes the batch statistics.

`block` puts a SimbaV2 block's training forward through them (four launches: up GEMM, finalize,
down GEMM, apply) with a PyTorch backward (Inductor's kernels, as the composite's).
"""

from __future__ import annotations

import torch

# Rows per program of every gemm_stats launch, hence per row tile of the partials their consumers
# combine; 32 beat 64 for both of the critic's GEMMs at 256 rows (one H100, 2026-12-07: up 4.02 against
# 4.32 us, results/learner_benchmark/gemm_stats_block_2026-12-07/gemm_stats_sweep.json, `best`).
TILE_M = 32
# (BLOCK_N, BLOCK_K, num_warps, num_stages) by a layer's (inputs, features), from that sweep: fixed, no
# autotuning at start-up; DEFAULT_CONFIG for shapes the table does not name (the actor's).
CONFIGS: dict[tuple[int, int], tuple[int, int, int, int]] = {(256, 1024): (128, 64, 4, 4), (1024, 256): (32, 128, 4, 3)}
DEFAULT_CONFIG = (64, 64, 4, 3)
# finalize and the apply combine every row tile of a layer's partials (an unrolled loop): issue 45's
# small batches only; larger ones keep the composite path.
MAX_ROWS = 1024


def supports(rows: int) -> bool:
    return 2 <= rows <= MAX_ROWS


def require(device: torch.device) -> None:
    """Register the ops for a learner that asked for them; a clear error where they cannot run."""
    from flashsac_opt import kernels

    kernels.check_runnable("gemm_stats_block", device)
    register()


def row_tiles(rows: int) -> int:
    return -(-rows // TILE_M)


def _kernels():
    from flashsac_opt import gemm_stats_triton

    return gemm_stats_triton


def _check_partials(name, s, m2, gamma, beta, members, rows, width):
    want = (members, row_tiles(rows), width)
    if s.shape != want or m2.shape != want or s.dtype != torch.float32 or m2.dtype != torch.float32:
        raise ValueError(f"{name}: partials {tuple(s.shape)}/{tuple(m2.shape)} must be float32 {want} (gemm_stats' for {rows} rows)")
    if gamma.shape != (members, width) or beta.shape != (members, width):
        raise ValueError(f"{name}: gamma {tuple(gamma.shape)} and beta {tuple(beta.shape)} must be {(members, width)}")


def gemm_stats(a: torch.Tensor, w: torch.Tensor, affine_in=None, config=None):
    """h[n] = f(a[n]) @ w[n]^T for every member n, with f = identity, or with ``affine_in = (scale,
    shift)`` (members, in) float32 (the producer's finalized BatchNorm) f = relu(a * scale + shift).
    a (members, rows, in) (stride 0 over members allowed), w (members, out, in) in one dtype.
    Returns h (members, rows, out) in a's dtype and its partials s, m2 (members, row_tiles(rows),
    out) float32. ``config`` (BLOCK_N, BLOCK_K, num_warps, num_stages) overrides the table (the
    offline sweep)."""
    if a.dim() != 3 or w.dim() != 3 or a.shape[0] != w.shape[0] or a.shape[2] != w.shape[2]:
        raise ValueError(f"gemm_stats: a {tuple(a.shape)} and w {tuple(w.shape)} must be (members, rows, in) and (members, out, in)")
    if a.dtype != w.dtype:
        raise ValueError(f"gemm_stats: a is {a.dtype}, w is {w.dtype}: one GEMM dtype")
    members, rows, inputs = a.shape
    if rows < 2:
        raise ValueError("gemm_stats: BatchNorm's batch statistics need at least 2 rows")
    if affine_in is not None and any(t.shape != (members, inputs) or t.dtype != torch.float32 for t in affine_in):
        raise ValueError(f"gemm_stats: the input's scale and shift must be float32 {(members, inputs)}, got "
                         f"{[(tuple(t.shape), t.dtype) for t in affine_in]}")
    features = w.shape[1]
    block_n, block_k, warps, stages = config or CONFIGS.get((inputs, features), DEFAULT_CONFIG)
    tiles = row_tiles(rows)
    h = torch.empty((members, rows, features), dtype=a.dtype, device=a.device)
    s = torch.empty((members, tiles, features), dtype=torch.float32, device=a.device)
    m2 = torch.empty_like(s)
    scale, shift = (t.contiguous() for t in affine_in) if affine_in is not None else (s, s)  # unread without the prologue
    _kernels().gemm_stats_kernel[(members, tiles, -(-features // block_n))](
        a, w, h, s, m2, scale, shift,
        a.stride(0), a.stride(1), a.stride(2), w.stride(0), w.stride(1), w.stride(2),
        rows=rows, features=features, inputs=inputs, PROLOGUE=affine_in is not None,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",  # float32 as PyTorch's bmm computes it (no TF32)
        BLOCK_M=TILE_M, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )
    return h, s, m2


def finalize(s: torch.Tensor, m2: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, rows: int, eps: float = 1e-5):
    """A layer's batch mean, biased variance and BatchNorm affine (scale = gamma / sqrt(var + eps),
    shift = beta - mean * scale), each (members, features) float32, from its partials: one small
    launch, so the next GEMM's prologue loads two numbers a column instead of combining the tiles
    in every program (which made the down projection 2.5x cuBLAS's time, one H100, 2026-12-07)."""
    members, _, features = s.shape
    _check_partials("finalize", s, m2, gamma, beta, members, rows, features)
    mean, var, scale, shift = (torch.empty((members, features), dtype=torch.float32, device=s.device) for _ in range(4))
    block = 256
    _kernels().finalize_kernel[(members, -(-features // block))](
        s, m2, gamma.float().contiguous(), beta.float().contiguous(), mean, var, scale, shift, eps,
        features=features, rows=rows, TILES=s.shape[1], TILE_M=TILE_M, BLOCK=block, num_warps=4,
    )
    return mean, var, scale, shift


def bn_relu_apply(h: torch.Tensor, s: torch.Tensor, m2: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor,
                  residual: torch.Tensor | None = None, eps: float = 1e-5, out_dtype: torch.dtype | None = None):
    """relu(BN_train(h)) (+ residual) from gemm_stats' partials; h (members, rows, features). Returns
    (y, the batch mean, the biased variance)."""
    members, rows, features = h.shape
    _check_partials("bn_relu_apply", s, m2, gamma, beta, members, rows, features)
    if residual is not None and residual.shape != h.shape:
        raise ValueError(f"bn_relu_apply: residual {tuple(residual.shape)} is not h's shape {tuple(h.shape)}")
    h = h.contiguous()
    residual = residual.contiguous() if residual is not None else None
    y = torch.empty(h.shape, dtype=out_dtype or (residual.dtype if residual is not None else h.dtype), device=h.device)
    mean, var = (torch.empty((members, features), dtype=torch.float32, device=h.device) for _ in range(2))
    block_m, block_n = 32, 64
    _kernels().bn_relu_apply_kernel[(members, -(-rows // block_m), -(-features // block_n))](
        h, s, m2, gamma.float().contiguous(), beta.float().contiguous(), residual if residual is not None else h, y, mean, var, eps,
        rows=rows, features=features, TILES=row_tiles(rows), TILE_M=TILE_M, HAS_RESIDUAL=residual is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4,
    )
    return y, mean, var


_registered = False


def register():
    """Register the three custom ops (once; needs Triton): torch.compile traces each as one node, our
    CUDA graph captures its launch (a registration itself cannot be traced: the learner calls this at
    construction)."""
    global _registered
    if _registered:
        return

    @torch.library.custom_op("flashsac_opt::gemm_stats", mutates_args=())
    def gemm_stats_op(a: torch.Tensor, w: torch.Tensor, in_scale: torch.Tensor | None,
                      in_shift: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return gemm_stats(a, w, (in_scale, in_shift) if in_scale is not None else None)

    @gemm_stats_op.register_fake
    def _(a, w, in_scale, in_shift):
        members, rows, _ = a.shape
        part = a.new_empty((members, row_tiles(rows), w.shape[1]), dtype=torch.float32)
        return a.new_empty((members, rows, w.shape[1])), part, torch.empty_like(part)

    @torch.library.custom_op("flashsac_opt::gemm_stats_finalize", mutates_args=())
    def finalize_op(s: torch.Tensor, m2: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, rows: int,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return finalize(s, m2, gamma, beta, rows, eps)

    @finalize_op.register_fake
    def _(s, m2, gamma, beta, rows, eps):
        return tuple(s.new_empty((s.shape[0], s.shape[2])) for _ in range(4))

    @torch.library.custom_op("flashsac_opt::bn_relu_apply", mutates_args=())
    def bn_relu_apply_op(h: torch.Tensor, s: torch.Tensor, m2: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor,
                         residual: torch.Tensor | None, eps: float,
                         out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return bn_relu_apply(h, s, m2, gamma, beta, residual, eps, out_dtype)

    @bn_relu_apply_op.register_fake
    def _(h, s, m2, gamma, beta, residual, eps, out_dtype):
        stats = h.new_empty((h.shape[0], h.shape[2]), dtype=torch.float32)
        return h.new_empty(h.shape, dtype=out_dtype), stats, torch.empty_like(stats)

    _registered = True


class _Block(torch.autograd.Function):
    """A SimbaV2 block in training mode through the two GEMMs with statistics and the last apply:
    y = relu(BN(relu(BN(x @ w_up^T)) @ w_down^T)) + residual. Its backward is PyTorch (Inductor
    fuses it as it fuses the composite's), from the saved pre-BatchNorm outputs and statistics: the up
    layer's output after its ReLU, which the forward never wrote, is recomputed for the down
    weights' gradient. An autograd.Function with setup_context: the fused update differentiates
    through torch.func."""

    @staticmethod
    def forward(x, residual, w_up, w_down, g_up, b_up, g_down, b_down, eps):
        ops = torch.ops.flashsac_opt
        rows = x.shape[1]
        h_up, s_up, m2_up = ops.gemm_stats(x, w_up, None, None)
        mean_up, var_up, scale_up, shift_up = ops.gemm_stats_finalize(s_up, m2_up, g_up, b_up, rows, eps)
        h_down, s_down, m2_down = ops.gemm_stats(h_up, w_down, scale_up, shift_up)
        y, mean_down, var_down = ops.bn_relu_apply(h_down, s_down, m2_down, g_down, b_down, x if residual is None else residual,
                                                   eps, torch.float32)
        return y, h_up, mean_up, var_up, h_down, mean_down, var_down

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, residual, w_up, w_down, g_up, b_up, g_down, b_down, eps = inputs
        _y, h_up, mean_up, var_up, h_down, mean_down, var_down = output
        ctx.save_for_backward(x, w_up, w_down, g_up, b_up, g_down, b_down, h_up, mean_up, var_up, h_down, mean_down, var_down)
        ctx.eps = eps
        ctx.residual_dtype = residual.dtype if residual is not None else None  # None: x is the residual
        ctx.mark_non_differentiable(h_up, mean_up, var_up, h_down, mean_down, var_down)

    @staticmethod
    def backward(ctx, grad_y, *_unused):
        x, w_up, w_down, g_up, b_up, g_down, b_down, h_up, mean_up, var_up, h_down, mean_down, var_down = ctx.saved_tensors
        rows = x.shape[1]

        def normalized(h, mean, var):
            rstd = torch.rsqrt(var + ctx.eps)
            return (h.float() - mean.unsqueeze(1)) * rstd.unsqueeze(1), rstd

        def bn_backward(dz, xhat, rstd, gamma):  # dz: the gradient at BatchNorm's output, ReLU mask applied
            d_beta, d_gamma = dz.sum(1), (dz * xhat).sum(1)
            dh = (gamma * rstd).unsqueeze(1) * (dz - (d_beta.unsqueeze(1) + xhat * d_gamma.unsqueeze(1)) / rows)
            return dh.to(x.dtype), d_gamma, d_beta

        xhat_down, rstd_down = normalized(h_down, mean_down, var_down)
        dz_down = grad_y.float() * (xhat_down * g_down.unsqueeze(1) + b_down.unsqueeze(1) > 0)
        dh_down, d_g_down, d_b_down = bn_backward(dz_down, xhat_down, rstd_down, g_down)
        xhat_up, rstd_up = normalized(h_up, mean_up, var_up)
        z_up = xhat_up * g_up.unsqueeze(1) + b_up.unsqueeze(1)
        a_up = torch.relu(z_up).to(x.dtype)
        d_w_down = torch.bmm(dh_down.transpose(1, 2), a_up)
        dz_up = torch.bmm(dh_down, w_down).float() * (z_up > 0)
        dh_up, d_g_up, d_b_up = bn_backward(dz_up, xhat_up, rstd_up, g_up)
        d_x = torch.bmm(dh_up, w_up) if ctx.needs_input_grad[0] else None
        d_residual = None
        if ctx.residual_dtype is None:
            d_x = d_x + grad_y.to(x.dtype) if d_x is not None else None
        elif ctx.needs_input_grad[1]:
            d_residual = grad_y.to(ctx.residual_dtype)
        d_w_up = torch.bmm(dh_up.transpose(1, 2), x)
        return (d_x, d_residual, d_w_up, d_w_down, d_g_up, d_b_up, d_g_down, d_b_down, None)


def block(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, g_up: torch.Tensor, b_up: torch.Tensor,
          g_down: torch.Tensor, b_down: torch.Tensor, eps: float = 1e-5, residual: torch.Tensor | None = None):
    """A training-mode SimbaV2 block for every member: relu(BN(relu(BN(x @ w_up^T)) @ w_down^T)) +
    residual (x where None), four launches. x (members, rows, hidden) and the weights in the GEMM
    dtype; the affines (members, width); the output float32.
    Returns (y, (mean, var) of the up layer, (mean, var) of the down layer)."""
    if x.dim() != 3 or w_up.dim() != 3 or w_down.dim() != 3 or w_down.shape[1:] != w_up.shape[1:][::-1]:
        raise ValueError(f"gemm_stats.block: x {tuple(x.shape)}, w_up {tuple(w_up.shape)}, w_down {tuple(w_down.shape)} "
                         "must be (members, rows, hidden), (members, wide, hidden), (members, hidden, wide)")
    if not _registered:  # eager callers; a compiled learner registered the ops at construction
        register()
    y, _h_up, mean_up, var_up, _h_down, mean_down, var_down = _Block.apply(
        x, residual, w_up, w_down, g_up.float().contiguous(), b_up.float().contiguous(), g_down.float().contiguous(),
        b_down.float().contiguous(), float(eps))
    return y, (mean_up, var_up), (mean_down, var_down)
