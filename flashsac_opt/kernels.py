"""Hand-written Triton kernels inside the compiled objectives (issue 45): one launch where Inductor
makes several. Off (FlashSACConfig.fused_linear_bn_relu): on one H100 it made graph mode slower,
1.061x at W1 and 1.103x at W2 (results/learner_benchmark/fused_linear_bn_relu_2026-12-07).

`member_linear_bn_relu(x, w, gamma, beta[, residual])`: for every ensemble member n, a critic or
actor block's projection h = x[n] @ w[n]^T, its training-mode BatchNorm over the rows, the ReLU and,
for the down projection, the block's skip connection, in one kernel: a SimbaV2 block is two
launches. A program holds every row (up to MAX_ROWS) of a block of output features, so the batch
statistics are a reduction inside the program: the GEMM's result is normalized where it was
accumulated, never written and read back. Graph mode without it runs a layer's forward as a cuBLAS
GEMM and about one Inductor kernel for the statistics and their apply; the measurement above found
that cheaper than this kernel, whose grid (members x features / BLOCK_N) is small. Larger batches
keep the composite path.

It is a `torch.library.custom_op` with a Triton body, a fake implementation and a registered
autograd: torch.compile traces it as one node whatever the device, Inductor calls it in its graph
and our CUDA graph captures its launch; one fixed configuration per shape class, no autotuning at
start-up. (A `triton_op` would let Inductor emit the launch itself, but under Triton's interpreter,
which runs the kernel in CI, `wrap_triton` cannot be traced, so the compiled path could not be
tested off the GPU.) Its backward is PyTorch: the ReLU mask, BatchNorm's backward from the saved
normalized values, and the two GEMMs, which Inductor fuses as it fuses today's.

Numerics: the statistics come from the float32 accumulator (the composite path reduces the GEMM's
output rounded to autocast's dtype), so the two agree to that rounding, not bit for bit.
"""

from __future__ import annotations

import functools
import os

import torch

MAX_ROWS = 512  # a program holds rows x BLOCK_N float32 accumulators
# (BLOCK_N, BLOCK_K, num_warps) by rows per program, chosen offline by experiments/bench/fused_kernel_configs.py
# (one H100, results/learner_benchmark/fused_linear_bn_relu_2026-12-07/fused_kernel_configs.json, `best`)
# and fixed here: no autotuning at start-up.
CONFIGS = {256: (16, 64, 8), 512: (16, 64, 8)}


def config_for(rows: int) -> tuple[int, int, int]:
    """The fixed launch configuration for a layer of ``rows`` rows (<= MAX_ROWS)."""
    return CONFIGS[256 if rows <= 256 else 512]


def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def check_runnable(switch: str, device: torch.device) -> None:
    """A clear error where a Triton switch's kernels cannot run: without Triton, or on a CPU device
    outside Triton's interpreter (TRITON_INTERPRET=1, the tests' way), where the first launch would
    fail deep inside Triton ("0 active drivers")."""
    if not available():
        raise ValueError(f"{switch}=true needs Triton (its kernels are Triton kernels); install triton or leave it off")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{switch}=true needs a CUDA device (its Triton kernels run on the CPU only in Triton's interpreter, "
                         f"TRITON_INTERPRET=1); got {device}")


def require(device: torch.device) -> None:
    """Register the op for a learner that asked for the fused kernel; a clear error where it cannot run."""
    check_runnable("fused_linear_bn_relu", device)
    register()


def supports(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the fused kernel takes these shapes: x (members, rows, in), w (members, out, in)."""
    return x.dim() == 3 and w.dim() == 3 and x.shape[0] == w.shape[0] and x.shape[2] == w.shape[2] and 2 <= x.shape[1] <= MAX_ROWS


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def member_linear_bn_relu_kernel(
        x_ptr, w_ptr, gamma_ptr, beta_ptr, res_ptr, y_ptr, xhat_ptr, mean_ptr, var_ptr,
        eps, sx_n, sx_b, sx_k, sw_n, sw_o, sw_k, sr_n, sr_b, sr_f,
        rows: tl.constexpr, features: tl.constexpr, inputs: tl.constexpr,  # the layer's static shape
        HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        member, block = tl.program_id(0), tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        rn = block * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rm < rows, rn < features
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inputs, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < inputs
            a = tl.load(x_ptr + member * sx_n + rm[:, None] * sx_b + rk[None, :] * sx_k,
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptr + member * sw_n + rn[None, :] * sw_o + rk[:, None] * sw_k,
                        mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc += tl.dot(a, b)
        # batch statistics over the valid rows (padding rows are zeros: masked out of both sums)
        mean = tl.sum(acc, axis=0) / rows
        centered = tl.where(row_ok[:, None], acc - mean[None, :], 0.0)
        var = tl.sum(centered * centered, axis=0) / rows
        rstd = 1.0 / tl.sqrt(var + eps)
        xhat = centered * rstd[None, :]
        gamma = tl.load(gamma_ptr + member * features + rn, mask=col_ok, other=0.0)
        beta = tl.load(beta_ptr + member * features + rn, mask=col_ok, other=0.0)
        y = tl.maximum(xhat * gamma[None, :] + beta[None, :], 0.0)
        out = member * rows * features + rm[:, None] * features + rn[None, :]
        ok = row_ok[:, None] & col_ok[None, :]
        if HAS_RESIDUAL:  # the block's skip connection, added after the ReLU
            y += tl.load(res_ptr + member * sr_n + rm[:, None] * sr_b + rn[None, :] * sr_f, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + out, y.to(y_ptr.dtype.element_ty), mask=ok)
        tl.store(xhat_ptr + out, xhat, mask=ok)
        tl.store(mean_ptr + member * features + rn, mean, mask=col_ok)
        tl.store(var_ptr + member * features + rn, var, mask=col_ok)

    return member_linear_bn_relu_kernel


def _launch(x, w, gamma, beta, residual, eps, y_in_input_dtype, config=None):
    """The kernel's launch, outside autograd; ``config`` (BLOCK_N, BLOCK_K, num_warps) overrides the
    table for the offline sweep."""
    members, rows, inputs = x.shape
    block_n, block_k, num_warps = config or config_for(rows)
    features = w.shape[1]
    y = torch.empty((members, rows, features), dtype=x.dtype if y_in_input_dtype else torch.float32, device=x.device)
    xhat = torch.empty((members, rows, features), dtype=torch.float32, device=x.device)
    mean = torch.empty((members, features), dtype=torch.float32, device=x.device)
    var = torch.empty_like(mean)
    block_m = max(16, 1 << (rows - 1).bit_length())
    grid = (members, -(-features // block_n))
    res_strides = residual.stride() if residual is not None else (0, 0, 0)
    _kernel()[grid](
        x, w, gamma, beta, residual if residual is not None else y, y, xhat, mean, var, eps,
        x.stride(0), x.stride(1), x.stride(2), w.stride(0), w.stride(1), w.stride(2), *res_strides,
        rows=rows, features=features, inputs=inputs, HAS_RESIDUAL=residual is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps,
    )
    return y, xhat, mean, var


_registered = False


@functools.cache
def register():
    """Register the custom op (once; needs Triton). The learner calls it at construction: torch.compile
    then finds the op as torch.ops.flashsac_opt.member_linear_bn_relu (a registration cannot be traced)."""
    global _registered

    @torch.library.custom_op("flashsac_opt::member_linear_bn_relu", mutates_args=())
    def member_linear_bn_relu_op(x: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor,
                                 residual: torch.Tensor | None, eps: float,
                                 y_in_input_dtype: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return _launch(x, w, gamma, beta, residual, eps, y_in_input_dtype)

    @member_linear_bn_relu_op.register_fake
    def _(x, w, gamma, beta, residual, eps, y_in_input_dtype):
        members, rows, _ = x.shape
        xhat = x.new_empty((members, rows, w.shape[1]), dtype=torch.float32)
        stats = x.new_empty((members, w.shape[1]), dtype=torch.float32)
        return xhat.to(x.dtype) if y_in_input_dtype else torch.empty_like(xhat), xhat, stats, torch.empty_like(stats)

    _registered = True
    return member_linear_bn_relu_op


class _MemberLinearBNReLU(torch.autograd.Function):
    """The op's autograd. An autograd.Function with setup_context, not the op's register_autograd:
    the fused update differentiates through torch.func, which takes only the former (as for
    networks._MemberLinear)."""

    @staticmethod
    def forward(x, w, gamma, beta, residual, eps, y_in_input_dtype):
        return torch.ops.flashsac_opt.member_linear_bn_relu(x, w, gamma, beta, residual, eps, y_in_input_dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w, gamma, beta, residual, eps, _y_in_input_dtype = inputs
        _y, xhat, _mean, var = output
        ctx.save_for_backward(x, w, gamma, beta, xhat, var)
        ctx.eps = eps
        ctx.residual_dtype = residual.dtype if residual is not None else None
        ctx.mark_non_differentiable(xhat)

    @staticmethod
    def backward(ctx, grad_y, _grad_xhat, _grad_mean, _grad_var):
        x, w, gamma, beta, xhat, var = ctx.saved_tensors
        rstd = torch.rsqrt(var + ctx.eps).unsqueeze(1)
        # the ReLU's mask from its input, recomputed (y holds the residual where there is one)
        dz = grad_y.float() * (xhat * gamma.unsqueeze(1) + beta.unsqueeze(1) > 0)
        dxhat = dz * gamma.unsqueeze(1)
        dh = rstd * (dxhat - dxhat.mean(dim=1, keepdim=True) - xhat * (dxhat * xhat).mean(dim=1, keepdim=True))
        dh = dh.to(x.dtype)
        grad_x = torch.bmm(dh, w) if ctx.needs_input_grad[0] else None
        grad_w = torch.bmm(dh.transpose(1, 2), x) if ctx.needs_input_grad[1] else None
        grad_gamma = (dz * xhat).sum(dim=1) if ctx.needs_input_grad[2] else None
        grad_beta = dz.sum(dim=1) if ctx.needs_input_grad[3] else None
        grad_residual = grad_y.to(ctx.residual_dtype) if ctx.residual_dtype is not None and ctx.needs_input_grad[4] else None
        return grad_x, grad_w, grad_gamma, grad_beta, grad_residual, None, None


def member_linear_bn_relu(x: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor,
                          eps: float = 1e-5, y_in_input_dtype: bool = False,
                          residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """relu(BN_train(x[n] @ w[n]^T) * gamma[n] + beta[n]) for every member n: (y (members, rows, out),
    the batch mean and biased variance (members, out) float32). x and w in one dtype (the GEMM's:
    autocast's where it is on); gamma and beta (members, out) float32. y is float32, or in x's dtype
    with y_in_input_dtype: rounded once from the float32 result, so the next GEMM reads half the bytes
    and no cast kernel runs (what relu_in_autocast_dtype does on the composite path). ``residual``
    (members, rows, out), any dtype, is added after the ReLU (a SimbaV2 block's down projection and
    its skip connection in one launch)."""
    if not supports(x, w):
        raise ValueError(f"member_linear_bn_relu: x {tuple(x.shape)} and w {tuple(w.shape)} must be (members, rows, in) and "
                         f"(members, out, in) with 2..{MAX_ROWS} rows")
    if x.dtype != w.dtype:
        raise ValueError(f"member_linear_bn_relu: x is {x.dtype}, w is {w.dtype}: one GEMM dtype")
    if residual is not None and residual.shape != (x.shape[0], x.shape[1], w.shape[1]):
        raise ValueError(f"member_linear_bn_relu: residual {tuple(residual.shape)} is not the output's shape {(x.shape[0], x.shape[1], w.shape[1])}")
    if not _registered:  # eager callers; a compiled learner registered it at construction
        register()
    y, _xhat, mean, var = _MemberLinearBNReLU.apply(x, w, gamma.float().contiguous(), beta.float().contiguous(), residual,
                                                    float(eps), bool(y_in_input_dtype))
    return y, mean, var
