"""Issue 45, item 1: a row-split GEMM that reduces BatchNorm's batch statistics in its epilogue,
and applies the previous layer's BatchNorm + ReLU in its prologue. A measured study: not wired
into the networks (experiments/bench/gemm_stats_block.py times a SimbaV2 block's forward with it
against the composite block).

Why row-split. kernels.member_linear_bn_relu holds every row of a block of features in one
program, so the statistics are a reduction inside it; but its down projection has 32 programs,
each reading the whole input (rows x 1024), and in the learner it was slower than cuBLAS +
Inductor. Here a program owns one (BLOCK_M rows) x (BLOCK_N features) tile, as a GEMM's would, and
writes, besides its tile of h = a @ w^T, each feature's sum and centred sum of squares over its
rows ("partials", float32, from the accumulator). Whoever needs the statistics combines a layer's
few row tiles (Chan's parallel formula: no E[h^2] - E[h]^2 cancellation):

    mean = sum_t s_t / rows;  M2 = sum_t (m2_t + n_t (s_t / n_t - mean)^2);  var = M2 / rows

The next GEMM does that in its prologue for the K columns it loads, then normalizes, scales,
shifts and ReLUs the tile before the dot: the BatchNorm output is never written and read back.
`bn_relu_apply` is the same prologue as a kernel of its own, for a layer whose consumer is not a
GEMM of ours (a block's output: BatchNorm, ReLU and the skip connection).

Forward only: a learner would need a backward to match (item 1's "backward to match"); the study
first measures whether the forward pays on the GPU.
"""

from __future__ import annotations

import torch

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps): fixed, no autotuning; BLOCK_M also sets the partials' row tiles.
CONFIG = (64, 64, 64, 4)


def row_tiles(rows: int, block_m: int = CONFIG[0]) -> int:
    return -(-rows // block_m)


def _kernels():
    from flashsac_opt import gemm_stats_triton

    return gemm_stats_triton.gemm_stats_kernel, gemm_stats_triton.bn_relu_apply_kernel


def _check_statistics(name, stats, members, rows, width):
    s, m2, gamma, beta = stats
    want = (members, row_tiles(rows), width)
    if s.shape != want or m2.shape != want or s.dtype != torch.float32 or m2.dtype != torch.float32:
        raise ValueError(f"{name}: partials {tuple(s.shape)}/{tuple(m2.shape)} must be float32 {want} (gemm_stats' for {rows} rows)")
    if gamma.shape != (members, width) or beta.shape != (members, width):
        raise ValueError(f"{name}: gamma {tuple(gamma.shape)} and beta {tuple(beta.shape)} must be {(members, width)}")


def gemm_stats(a: torch.Tensor, w: torch.Tensor, bn_in=None, eps: float = 1e-5):
    """h[n] = f(a[n]) @ w[n]^T for every member n, with f = identity, or with ``bn_in = (s, m2, gamma,
    beta)`` (the producer's partials and BatchNorm affine) f = relu(BN_train(.)). a (members, rows,
    in) (stride 0 over members allowed), w (members, out, in) in one dtype. Returns h (members, rows,
    out) in a's dtype and its partials s, m2 (members, row_tiles(rows), out) float32."""
    if a.dim() != 3 or w.dim() != 3 or a.shape[0] != w.shape[0] or a.shape[2] != w.shape[2]:
        raise ValueError(f"gemm_stats: a {tuple(a.shape)} and w {tuple(w.shape)} must be (members, rows, in) and (members, out, in)")
    if a.dtype != w.dtype:
        raise ValueError(f"gemm_stats: a is {a.dtype}, w is {w.dtype}: one GEMM dtype")
    members, rows, inputs = a.shape
    if rows < 2:
        raise ValueError("gemm_stats: BatchNorm's batch statistics need at least 2 rows")
    features = w.shape[1]
    block_m, block_n, block_k, warps = CONFIG
    tiles = row_tiles(rows)
    h = torch.empty((members, rows, features), dtype=a.dtype, device=a.device)
    s = torch.empty((members, tiles, features), dtype=torch.float32, device=a.device)
    m2 = torch.empty_like(s)
    if bn_in is not None:
        _check_statistics("gemm_stats bn_in", bn_in, members, rows, inputs)
    in_s, in_m2, in_gamma, in_beta = bn_in if bn_in is not None else (s, m2, s, s)  # unread without the prologue
    gemm_stats_kernel, _ = _kernels()
    gemm_stats_kernel[(members, tiles, -(-features // block_n))](
        a, w, h, s, m2, in_s, in_m2, in_gamma.float().contiguous(), in_beta.float().contiguous(), eps,
        a.stride(0), a.stride(1), a.stride(2), w.stride(0), w.stride(1), w.stride(2),
        rows=rows, features=features, inputs=inputs, PROLOGUE=bn_in is not None, IN_TILES=tiles, IN_TILE_M=block_m,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",  # float32 as PyTorch's bmm computes it (no TF32)
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
    )
    return h, s, m2


def bn_relu_apply(h: torch.Tensor, stats, residual: torch.Tensor | None = None, eps: float = 1e-5,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """relu(BN_train(h)) (+ residual) from gemm_stats' partials, ``stats = (s, m2, gamma, beta)``;
    h contiguous (members, rows, features)."""
    members, rows, features = h.shape
    _check_statistics("bn_relu_apply", stats, members, rows, features)
    if residual is not None and residual.shape != h.shape:
        raise ValueError(f"bn_relu_apply: residual {tuple(residual.shape)} is not h's shape {tuple(h.shape)}")
    s, m2, gamma, beta = stats
    h = h.contiguous()
    residual = residual.contiguous() if residual is not None else None
    y = torch.empty(h.shape, dtype=out_dtype or (residual.dtype if residual is not None else h.dtype), device=h.device)
    block_m, block_n = 32, 64
    _, bn_relu_apply_kernel = _kernels()
    bn_relu_apply_kernel[(members, -(-rows // block_m), -(-features // block_n))](
        h, s, m2, gamma.float().contiguous(), beta.float().contiguous(), residual if residual is not None else h, y, eps,
        rows=rows, features=features, TILES=row_tiles(rows), TILE_M=CONFIG[0], HAS_RESIDUAL=residual is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4,
    )
    return y


def moments(s: torch.Tensor, m2: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's batch mean and biased variance (members, features) from its partials, in PyTorch
    (the running statistics' update)."""
    block_m = CONFIG[0]
    n_t = torch.tensor([min(block_m, rows - t * block_m) for t in range(s.shape[1])], dtype=torch.float32, device=s.device)
    mean = s.sum(1) / rows
    d = s / n_t[:, None] - mean[:, None, :]
    return mean, (m2 + n_t[:, None] * d * d).sum(1) / rows
