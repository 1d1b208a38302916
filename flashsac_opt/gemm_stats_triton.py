"""The Triton kernels of flashsac_opt/gemm_stats.py (their docstring says what and why). A module of
their own, imported only when a kernel is launched: Triton resolves a jitted function's callees
among its module's globals, and flashsac_opt must import without Triton."""

import triton
import triton.language as tl


@triton.jit
def scale_shift(s_ptr, m2_ptr, gamma_ptr, beta_ptr, member, cols, col_ok, eps,
                width: tl.constexpr, rows: tl.constexpr, TILES: tl.constexpr, TILE_M: tl.constexpr):
    """The batch mean and biased variance of ``cols`` of one member, from a layer's partials, and
    BatchNorm's affine as x * scale + shift."""
    base = member * TILES * width + cols
    total = tl.zeros(cols.shape, dtype=tl.float32)
    for t in tl.static_range(TILES):
        total += tl.load(s_ptr + base + t * width, mask=col_ok, other=0.0)
    mean = total / rows
    m2 = tl.zeros(cols.shape, dtype=tl.float32)
    for t in tl.static_range(TILES):
        n_t = tl.minimum(TILE_M, rows - t * TILE_M).to(tl.float32)
        d = tl.load(s_ptr + base + t * width, mask=col_ok, other=0.0) / n_t - mean
        m2 += tl.load(m2_ptr + base + t * width, mask=col_ok, other=0.0) + n_t * d * d
    var = m2 / rows
    scale = tl.load(gamma_ptr + member * width + cols, mask=col_ok, other=0.0) / tl.sqrt(var + eps)
    shift = tl.load(beta_ptr + member * width + cols, mask=col_ok, other=0.0) - mean * scale
    return mean, var, scale, shift


@triton.jit
def finalize_kernel(s_ptr, m2_ptr, gamma_ptr, beta_ptr, mean_ptr, var_ptr, scale_ptr, shift_ptr, eps,
                    features: tl.constexpr, rows: tl.constexpr, TILES: tl.constexpr, TILE_M: tl.constexpr,
                    BLOCK: tl.constexpr):
    member = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < features
    mean, var, scale, shift = scale_shift(s_ptr, m2_ptr, gamma_ptr, beta_ptr, member, cols, ok, eps, features, rows, TILES, TILE_M)
    at = member * features + cols
    tl.store(mean_ptr + at, mean, mask=ok)
    tl.store(var_ptr + at, var, mask=ok)
    tl.store(scale_ptr + at, scale, mask=ok)
    tl.store(shift_ptr + at, shift, mask=ok)


@triton.jit
def gemm_stats_kernel(
    a_ptr, w_ptr, h_ptr, s_ptr, m2_ptr, in_scale_ptr, in_shift_ptr,
    sa_n, sa_b, sa_k, sw_n, sw_o, sw_k,
    rows: tl.constexpr, features: tl.constexpr, inputs: tl.constexpr, PROLOGUE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    member, tile_m, tile_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rm < rows, rn < features
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inputs, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < inputs
        a = tl.load(a_ptr + member * sa_n + rm[:, None] * sa_b + rk[None, :] * sa_k,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if PROLOGUE:  # the producer's BatchNorm + ReLU on the tile as it arrives (its finalized affine)
            scale = tl.load(in_scale_ptr + member * inputs + rk, mask=k_ok, other=0.0)
            shift = tl.load(in_shift_ptr + member * inputs + rk, mask=k_ok, other=0.0)
            a = tl.maximum(a.to(tl.float32) * scale[None, :] + shift[None, :], 0.0)
            a = tl.where(row_ok[:, None], a, 0.0).to(w_ptr.dtype.element_ty)  # padding rows stay out of the sums
        b = tl.load(w_ptr + member * sw_n + rn[None, :] * sw_o + rk[:, None] * sw_k,
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.dot(a, b, input_precision=PRECISION)
    # this tile's partials: padding rows are zeros in acc, and out of the centred sum
    n_rows = tl.sum(row_ok.to(tl.float32), axis=0)
    s = tl.sum(acc, axis=0)
    centred = tl.where(row_ok[:, None], acc - (s / n_rows)[None, :], 0.0)
    tiles = tl.num_programs(1)
    part = (member * tiles + tile_m) * features + rn
    tl.store(s_ptr + part, s, mask=col_ok)
    tl.store(m2_ptr + part, tl.sum(centred * centred, axis=0), mask=col_ok)
    out = member * rows * features + rm[:, None] * features + rn[None, :]
    tl.store(h_ptr + out, acc.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def bn_relu_apply_kernel(
    h_ptr, s_ptr, m2_ptr, gamma_ptr, beta_ptr, res_ptr, y_ptr, mean_ptr, var_ptr, eps,
    rows: tl.constexpr, features: tl.constexpr, TILES: tl.constexpr, TILE_M: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    member, tile_m, tile_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = rn < features
    ok = (rm < rows)[:, None] & col_ok[None, :]
    mean, var, scale, shift = scale_shift(s_ptr, m2_ptr, gamma_ptr, beta_ptr, member, rn, col_ok, eps, features, rows, TILES, TILE_M)
    if tile_m == 0:  # the batch statistics, for the running statistics and the backward
        tl.store(mean_ptr + member * features + rn, mean, mask=col_ok)
        tl.store(var_ptr + member * features + rn, var, mask=col_ok)
    at = member * rows * features + rm[:, None] * features + rn[None, :]
    y = tl.maximum(tl.load(h_ptr + at, mask=ok, other=0.0).to(tl.float32) * scale[None, :] + shift[None, :], 0.0)
    if HAS_RESIDUAL:
        y += tl.load(res_ptr + at, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + at, y.to(y_ptr.dtype.element_ty), mask=ok)
