"""The Triton kernel of flashsac_opt/fused_step.py (its docstring says what and why). A module of its
own, imported only when the kernel is launched: Triton resolves a jitted function's callees among its
module's globals, and flashsac_opt must import without Triton."""

import triton
import triton.language as tl


@triton.jit
def adam_proposal(param_ptr, grad_ptr, m_ptr, v_ptr, at, mask, step_size, correction2_sqrt, beta1, beta2, eps):
    """FlatAdam.proposal on one chunk: (new param, new exp_avg, new exp_avg_sq), op for op."""
    g = tl.load(grad_ptr + at, mask=mask, other=0.0)
    m = tl.load(m_ptr + at, mask=mask, other=0.0)
    v = tl.load(v_ptr + at, mask=mask, other=0.0)
    p = tl.load(param_ptr + at, mask=mask, other=0.0)
    m_new = m + (1.0 - beta1) * (g - m)  # torch.lerp(m, g, 1 - beta1), weight < 0.5
    v_new = v * beta2 + (1.0 - beta2) * g * g  # torch.addcmul(v * beta2, g, g, value=1 - beta2)
    denom = tl.sqrt(v_new) / correction2_sqrt + eps
    return p - (step_size * m_new) / denom, m_new, v_new


@triton.jit
def gated_adam_kernel(param_ptr, grad_ptr, m_ptr, v_ptr, target_ptr, coefficients_ptr, ok_ptr, units_ptr, weight_ptr,
                      beta1, beta2, eps, renorm_eps, HAS_TARGET: tl.constexpr, CHUNK: tl.constexpr):
    """One program per renormalization unit (units row: first offset, offset of the second segment
    from the first or 0, segment length, kind). Pass 1 reduces the squared norm of the unit's Adam
    proposal; pass 2 recomputes the proposal (its inputs are in L1/L2 by then), rescales it and, if the
    step is finite, writes parameter, moments and the Polyak-averaged target."""
    unit = tl.program_id(0)
    first = tl.load(units_ptr + unit * 4).to(tl.int64)
    second = tl.load(units_ptr + unit * 4 + 1).to(tl.int64)
    length = tl.load(units_ptr + unit * 4 + 2)
    kind = tl.load(units_ptr + unit * 4 + 3)
    segments = 1 + (second > 0).to(tl.int32)
    step_size = tl.load(coefficients_ptr)
    correction2_sqrt = tl.load(coefficients_ptr + 1)
    ok_f = tl.load(ok_ptr)
    written = tl.where(ok_f != 0.0, length, 0)  # a skipped step writes nothing (a mask, not `mask & ok`: the interpreter has no bool and)
    lanes = tl.arange(0, CHUNK)

    # while loops, not range(): their bounds are loaded, which Triton's interpreter (the CPU tests)
    # cannot take in a range
    squares = tl.zeros([CHUNK], dtype=tl.float32)
    if kind != 0:
        seg = 0
        while seg < segments:
            start = 0
            while start < length:
                mask = start + lanes < length
                at = first + seg * second + start + lanes
                p_new, _, _ = adam_proposal(param_ptr, grad_ptr, m_ptr, v_ptr, at, mask, step_size, correction2_sqrt, beta1, beta2, eps)
                squares += tl.where(mask, p_new * p_new, 0.0)
                start += CHUNK
            seg += 1
    sqsum = tl.sum(squares, axis=0)
    # kind 1, a unit linear's row: F.normalize, x / max(|x|, eps); kind 2, a BatchNorm (weight, bias)
    # pair or an RMSNorm scale: x * sqrt(D) * rsqrt(sum of squares + eps); kind 0: unchanged
    divisor = tl.where(kind == 1, tl.maximum(tl.sqrt(sqsum), renorm_eps), 1.0)
    factor = tl.where(kind == 2, tl.sqrt(length.to(tl.float32)) * tl.rsqrt(sqsum + renorm_eps), 1.0)

    weight = tl.load(weight_ptr)  # Polyak's tau * ok
    seg = 0
    while seg < segments:
        start = 0
        while start < length:
            mask = start + lanes < length
            at = first + seg * second + start + lanes
            p_new, m_new, v_new = adam_proposal(param_ptr, grad_ptr, m_ptr, v_ptr, at, mask, step_size, correction2_sqrt, beta1, beta2, eps)
            p_new = p_new * factor / divisor
            write = start + lanes < written
            tl.store(param_ptr + at, p_new, mask=write)
            tl.store(m_ptr + at, m_new, mask=write)
            tl.store(v_ptr + at, v_new, mask=write)
            if HAS_TARGET:  # torch.lerp(target, param, tau * ok), both of its branches
                t = tl.load(target_ptr + at, mask=write, other=0.0)
                diff = p_new - t
                t_new = tl.where(weight < 0.5, t + weight * diff, p_new - diff * (1.0 - weight))
                tl.store(target_ptr + at, t_new, mask=write)
            start += CHUNK
        seg += 1
