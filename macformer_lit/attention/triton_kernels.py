"""The Triton kernels of triton_fused.py (docs/maths.md §14, fused products). Imported on
first use: ``triton.jit`` reads ``TRITON_INTERPRET`` when this module is imported, and the
interpreter looks the helpers up among the module's globals."""

import triton
import triton.language as tl


@triton.jit
def _x_tile(X, rows, cols, L, d, c):
    """Rows ``rows`` of X (L, d), times c, zero outside (L, d)."""
    mask = (rows[:, None] < L) & (cols[None, :] < d)
    return tl.load(X + rows[:, None] * d + cols[None, :], mask=mask, other=0.0) * c


@triton.jit
def _y_tile(Y, rows, cols, L, d):
    """Rows ``rows`` of Y (L, d + 1): columns 0..d-1 as a tile, column d as a vector."""
    e = d + 1
    main = tl.load(
        Y + rows[:, None] * e + cols[None, :],
        mask=(rows[:, None] < L) & (cols[None, :] < d),
        other=0.0,
    )
    last = tl.load(Y + rows * e + d, mask=rows < L, other=0.0)
    return main, last


@triton.jit
def _dot(a, b, BF16: tl.constexpr, EXACT_BF16: tl.constexpr):
    """a @ b accumulating in float32: float32 products (no TF32), or with BF16 the inputs
    rounded to bfloat16. EXACT_BF16 (the interpreter, whose bfloat16 dot multiplies the raw
    bits): bfloat16 values multiplied in float32, the same products (8 × 8 significant bits
    are exact in float32's 24) and the same sums."""
    if BF16:
        if EXACT_BF16:
            a = a.to(tl.bfloat16).to(tl.float32)
            b = b.to(tl.bfloat16).to(tl.float32)
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def state_kernel(
    X, Y, S, L, d, c,
    BD: tl.constexpr, BL: tl.constexpr, BF16: tl.constexpr, EXACT_BF16: tl.constexpr,
):  # fmt: skip
    """S (G, 1 + d + d², d + 1) = Σ_l ψ(x_l) y_lᵀ. Program (g, a): the d rows of x'_a·x'
    (a < d), or the rows of 1 and x' (a = d)."""
    g, a = tl.program_id(0), tl.program_id(1)
    e = d + 1
    X += g * L * d
    Y += g * L * e
    S += g * (1 + d + d * d) * e
    cols = tl.arange(0, BD)
    acc = tl.zeros((BD, BD), dtype=tl.float32)
    acc_last = tl.zeros((BD,), dtype=tl.float32)
    ones = tl.zeros((BD,), dtype=tl.float32)
    ones_last = tl.zeros((1,), dtype=tl.float32)
    for start in range(0, L, BL):
        rows = start + tl.arange(0, BL)
        x = _x_tile(X, rows, cols, L, d, c)
        y, y_last = _y_tile(Y, rows, cols, L, d)
        if a < d:
            xa = tl.load(X + rows * d + a, mask=rows < L, other=0.0) * c
            x = xa[:, None] * x
        else:
            ones += tl.sum(y, 0)
            ones_last += tl.sum(y_last[:, None], 0)
        acc += _dot(tl.trans(x), y, BF16, EXACT_BF16)
        acc_last += tl.sum(x * y_last[:, None], 0)
    first = tl.where(a < d, 1 + d + a * d, 1)
    out = S + (first + cols[:, None]) * e + cols[None, :]
    tl.store(out, acc, mask=(cols[:, None] < d) & (cols[None, :] < d))
    tl.store(S + (first + cols) * e + d, acc_last, mask=cols < d)
    if a == d:
        tl.store(S + cols, ones, mask=cols < d)
        tl.store(S + d + tl.arange(0, 1), ones_last)


@triton.jit
def _s_tile(S, first, cols, d, BF16: tl.constexpr):
    """Rows first..first+d-1 of S: columns 0..d-1 (d, d) and column d (d,)."""
    e = d + 1
    mask = (cols[:, None] < d) & (cols[None, :] < d)
    main = tl.load(S + (first + cols[:, None]) * e + cols[None, :], mask=mask, other=0.0)
    last = tl.load(S + (first + cols) * e + d, mask=cols < d, other=0.0)
    if BF16:
        main = main.to(tl.bfloat16).to(tl.float32)
        last = last.to(tl.bfloat16).to(tl.float32)
    return main, last


@triton.jit
def apply_kernel(
    X, S, OUT, L, d, c, a0, a1, a2,
    BD: tl.constexpr, BL: tl.constexpr, BF16: tl.constexpr, EXACT_BF16: tl.constexpr,
):  # fmt: skip
    """OUT (G, L, d + 1) = Σ_j a_j ψ_j(x_l)ᵀ S_j for a tile of BL rows."""
    g, block = tl.program_id(0), tl.program_id(1)
    e = d + 1
    X += g * L * d
    S += g * (1 + d + d * d) * e
    OUT += g * L * e
    cols = tl.arange(0, BD)
    rows = block * BL + tl.arange(0, BL)
    x = _x_tile(X, rows, cols, L, d, c)
    s0 = tl.load(S + cols, mask=cols < d, other=0.0)
    s0_last = tl.sum(tl.load(S + d + tl.arange(0, 1)), 0)
    if BF16:
        s0 = s0.to(tl.bfloat16).to(tl.float32)
        s0_last = s0_last.to(tl.bfloat16).to(tl.float32)
    s1, s1_last = _s_tile(S, 1, cols, d, BF16)
    acc = a1 * _dot(x, s1, BF16, EXACT_BF16)
    acc_last = a1 * tl.sum(x * s1_last[None, :], 1)
    for a in range(0, d):
        xa = tl.load(X + rows * d + a, mask=rows < L, other=0.0) * c
        s2, s2_last = _s_tile(S, 1 + d + a * d, cols, d, BF16)
        acc += a2 * _dot(xa[:, None] * x, s2, BF16, EXACT_BF16)
        acc_last += a2 * xa * tl.sum(x * s2_last[None, :], 1)
    acc += a0 * s0[None, :]
    acc_last += a0 * s0_last
    keep = rows < L
    tl.store(OUT + rows[:, None] * e + cols[None, :], acc, mask=keep[:, None] & (cols[None, :] < d))
    tl.store(OUT + rows * e + d, acc_last, mask=keep)


@triton.jit
def pullback_kernel(
    X, S, Y, GX, L, d, c, a1, a2,
    BD: tl.constexpr, BL: tl.constexpr, BF16: tl.constexpr, EXACT_BF16: tl.constexpr,
):  # fmt: skip
    """GX (G, L, d) = J_ψ(x_l)ᵀ (a ⊙ S y_l), times c, for a tile of BL rows:
    ∂/∂x'_c = a1 (S1 y)_c + a2 Σ_b x'_b (U[c, b] + U[b, c]), U[a, b] = S2[a, b]·y."""
    g, block = tl.program_id(0), tl.program_id(1)
    e = d + 1
    X += g * L * d
    S += g * (1 + d + d * d) * e
    Y += g * L * e
    GX += g * L * d
    cols = tl.arange(0, BD)
    rows = block * BL + tl.arange(0, BL)
    x = _x_tile(X, rows, cols, L, d, c)
    y, y_last = _y_tile(Y, rows, cols, L, d)
    s1, s1_last = _s_tile(S, 1, cols, d, BF16)
    acc = a1 * (_dot(y, tl.trans(s1), BF16, EXACT_BF16) + y_last[:, None] * s1_last[None, :])
    for a in range(0, d):
        xa = tl.load(X + rows * d + a, mask=rows < L, other=0.0) * c
        s2, s2_last = _s_tile(S, 1 + d + a * d, cols, d, BF16)
        u = _dot(y, tl.trans(s2), BF16, EXACT_BF16) + y_last[:, None] * s2_last[None, :]  # U[a, :]
        acc += a2 * xa[:, None] * u
        acc += tl.where(cols[None, :] == a, a2 * tl.sum(u * x, 1)[:, None], 0.0)
    keep = (rows[:, None] < L) & (cols[None, :] < d)
    tl.store(GX + rows[:, None] * d + cols[None, :], acc * c, mask=keep)
