"""The Triton kernels of triton_sbn.py (ppSBN's passes, docs/maths.md §10.5). Imported on first
use: ``triton.jit`` reads ``TRITON_INTERPRET`` when this module is imported, and the
interpreter looks the helpers up among the module's globals.

A row is (b, h, l) of a (B, H, L, d) tensor; program (g, ·) works on the rows of group
g = b·H + h, a tile of BL rows × BD columns at a time (d padded to a power of two, masked).
Tensors from outside (x and ∂x, post-SBN's input and result, the incoming gradients) are
read and written by their (b, h, l) strides, d contiguous; those the Functions allocate for
themselves (y, ‖z‖, log|y|, post-SBN's ∂out) are contiguous. The summing kernels write one
partial sum a program: a chunk of TILES tiles of one group, each tile summed in float32 and
the tiles in float64.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _at(g, H, sb, sh, sl, rows):
    """Where rows ``rows`` of group g start in a tensor with strides (sb, sh, sl), in int64."""
    b = (g // H).to(tl.int64)
    h = (g % H).to(tl.int64)
    return b * sb + h * sh + rows.to(tl.int64) * sl


@triton.jit
def _tile(X, at, cols, keep):
    """The (BL, BD) tile of X whose rows start at ``at``, in float32 (bfloat16 converted
    exactly), zero outside ``keep``."""
    return tl.load(X + at[:, None] + cols[None, :], mask=keep, other=0.0).to(tl.float32)


@triton.jit
def _keep(rows, cols, L, d):
    """The (BL, BD) mask of a tile's real entries: rows below L, columns below d."""
    return (rows[:, None] < L) & (cols[None, :] < d)


@triton.jit
def _block(block, L, d, BL: tl.constexpr, BD: tl.constexpr):
    """(rows, cols, keep) of tile ``block`` of a group's rows: BL rows from block·BL, BD
    columns, and the mask of the real ones."""
    rows = block * BL + tl.arange(0, BL)
    cols = tl.arange(0, BD)
    return rows, cols, _keep(rows, cols, L, d)


@triton.jit
def _own(g, L, d, rows, cols):
    """Offsets of rows ``rows`` of group g in a contiguous (B, H, L, d) tensor."""
    return (g.to(tl.int64) * L + rows)[:, None] * d + cols[None, :]


@triton.jit
def _bfloat16(v):
    """v rounded to bfloat16 to nearest even, a NaN quiet (c10::BFloat16's rule: a cast of the
    float32 value), in integer arithmetic: the interpreter's own conversion truncates."""
    u = v.to(tl.uint32, bitcast=True)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    bits = tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, rounded)
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _exp(x, INTERPRETED: tl.constexpr):
    """exp of float32 x within 2 ulp: CUDA's expf (libdevice; tl.exp is ex2.approx of a float32
    x·log₂e, another |x|·u off); under the interpreter NumPy's in float64, rounded (its
    float32 exp is up to 2.4 ulp off)."""
    if INTERPRETED:
        return tl.exp(x.to(tl.float64)).to(tl.float32)
    else:
        return libdevice.exp(x)


@triton.jit
def _log(x, INTERPRETED: tl.constexpr):
    """log of float32 x within 1 ulp: CUDA's logf (libdevice); under the interpreter NumPy's
    in float64, rounded (its float32 log is up to 2.7 ulp off)."""
    if INTERPRETED:
        return tl.log(x.to(tl.float64)).to(tl.float32)
    else:
        return libdevice.log(x)


@triton.jit
def moment_kernel(
    X, W, MEAN, PART, sb, sh, sl, H, L, d,
    HAS_W: tl.constexpr, HAS_MEAN: tl.constexpr,
    BD: tl.constexpr, BL: tl.constexpr, TILES: tl.constexpr,
):  # fmt: skip
    """PART (G, T, d) float64: Σ w·x, or with HAS_MEAN Σ w·(x − mean)² (MEAN (H, d)), over
    chunk t of group g's rows. W: the (B, L) weights of real positions (HAS_W)."""
    g, t = tl.program_id(0), tl.program_id(1)
    cols = tl.arange(0, BD)
    acc = tl.zeros((BD,), dtype=tl.float64)
    if HAS_MEAN:
        mean = tl.load(MEAN + (g % H) * d + cols, mask=cols < d, other=0.0)
    for i in range(TILES):
        rows = (t * TILES + i) * BL + tl.arange(0, BL)
        keep = _keep(rows, cols, L, d)
        x = _tile(X, _at(g, H, sb, sh, sl, rows), cols, keep)
        if HAS_MEAN:
            x = tl.where(keep, x - mean[None, :], 0.0)
            x = x * x
        if HAS_W:
            w = tl.load(W + (g // H).to(tl.int64) * L + rows, mask=rows < L, other=0.0)
            x = x * w[:, None]
        acc += tl.sum(x, 0).to(tl.float64)
    tl.store(PART + (g * tl.num_programs(1) + t) * d + cols, acc, mask=cols < d)


@triton.jit
def normalise_kernel(
    X, SHIFT, INV_STD, TAU, Y, Y_TAU, NORM, sb, sh, sl, H, L, d,
    HAS_TAU: tl.constexpr, BD: tl.constexpr, BL: tl.constexpr,
):  # fmt: skip
    """y = z/‖z‖ per row with z = shift + x·inv_std ((H, d) each), ‖z‖ (NORM (B, H, L)) at
    least 1e-12, for tile ``block`` of group g; with HAS_TAU also Y_TAU = τ_h·y (TAU (H,))."""
    g, block = tl.program_id(0), tl.program_id(1)
    h = g % H
    rows, cols, keep = _block(block, L, d, BL, BD)
    x = _tile(X, _at(g, H, sb, sh, sl, rows), cols, keep)
    shift = tl.load(SHIFT + h * d + cols, mask=cols < d, other=0.0)
    inv_std = tl.load(INV_STD + h * d + cols, mask=cols < d, other=0.0)
    z = shift[None, :] + x * inv_std[None, :]  # 0 in the padded columns
    norm = tl.maximum(tl.sqrt_rn(tl.sum(z * z, 1)), 1e-12)
    y = tl.div_rn(z, norm[:, None])
    own = _own(g, L, d, rows, cols)
    tl.store(Y + own, y, mask=keep)
    tl.store(NORM + g.to(tl.int64) * L + rows, norm, mask=rows < L)
    if HAS_TAU:
        tl.store(Y_TAU + own, y * tl.load(TAU + h), mask=keep)


@triton.jit
def _row_grad(Y, NORM, G, TAU, g, H, L, d, sb, sh, sl, rows, cols, keep, HAS_TAU: tl.constexpr):
    """(gz, ẑ, ⟨g, y⟩) of the rows: gz = (gy − y⟨y, gy⟩)/‖z‖ with gy = τ_h·g (g itself
    without τ), ẑ = y·‖z‖; zero outside ``keep``."""
    y = tl.load(Y + _own(g, L, d, rows, cols), mask=keep, other=0.0)
    norm = tl.load(NORM + g.to(tl.int64) * L + rows, mask=rows < L, other=1.0)
    grad = _tile(G, _at(g, H, sb, sh, sl, rows), cols, keep)
    gdot = tl.sum(grad * y, 1)
    if HAS_TAU:
        tau = tl.load(TAU + g % H)
        gz = tl.div_rn(grad * tau - y * (gdot * tau)[:, None], norm[:, None])
    else:
        gz = tl.div_rn(grad - y * gdot[:, None], norm[:, None])
    return gz, y * norm[:, None], gdot


@triton.jit
def backward_sums_kernel(
    Y, NORM, G, TAU, PART, sb, sh, sl, H, L, d,
    HAS_TAU: tl.constexpr, BD: tl.constexpr, BL: tl.constexpr, TILES: tl.constexpr,
):  # fmt: skip
    """PART (G, T, 2d + 1) float64 over chunk t of group g's rows, every row (padded ones
    included): [Σ gz, Σ gz·ẑ, Σ⟨g, y⟩] (the last τ's gradient). G: the gradient of the
    output, strides (sb, sh, sl)."""
    g, t = tl.program_id(0), tl.program_id(1)
    cols = tl.arange(0, BD)
    acc_g = tl.zeros((BD,), dtype=tl.float64)
    acc_gz = tl.zeros((BD,), dtype=tl.float64)
    acc_tau = tl.zeros((1,), dtype=tl.float64)
    for i in range(TILES):
        rows = (t * TILES + i) * BL + tl.arange(0, BL)
        keep = _keep(rows, cols, L, d)
        gz, z, gdot = _row_grad(Y, NORM, G, TAU, g, H, L, d, sb, sh, sl, rows, cols, keep, HAS_TAU)
        acc_g += tl.sum(gz, 0).to(tl.float64)
        acc_gz += tl.sum(gz * z, 0).to(tl.float64)
        acc_tau += tl.sum(gdot[:, None], 0).to(tl.float64)
    out = PART + (g * tl.num_programs(1) + t) * (2 * d + 1)
    tl.store(out + cols, acc_g, mask=cols < d)
    tl.store(out + d + cols, acc_gz, mask=cols < d)
    tl.store(out + 2 * d + tl.arange(0, 1), acc_tau)


@triton.jit
def backward_apply_kernel(
    Y, NORM, G, TAU, W, MEANS, INV_STD, GX,
    sgb, sgh, sgl, sb, sh, sl, H, L, d,
    HAS_TAU: tl.constexpr, HAS_W: tl.constexpr, BF16: tl.constexpr,
    BD: tl.constexpr, BL: tl.constexpr,
):  # fmt: skip
    """∂x = (gz − w·(mean_g + ẑ·mean_gz))·inv_std for tile ``block`` of group g, MEANS
    (2, H, d) = [Σ gz, Σ gz·ẑ]/n over the ranks; G read by its strides (sgb, sgh, sgl), GX
    written by its own (sb, sh, sl), in bfloat16 with BF16."""
    g, block = tl.program_id(0), tl.program_id(1)
    h = g % H
    rows, cols, keep = _block(block, L, d, BL, BD)
    gz, z, _ = _row_grad(Y, NORM, G, TAU, g, H, L, d, sgb, sgh, sgl, rows, cols, keep, HAS_TAU)
    mean_g = tl.load(MEANS + h * d + cols, mask=cols < d, other=0.0)
    mean_gz = tl.load(MEANS + (H + h) * d + cols, mask=cols < d, other=0.0)
    inv_std = tl.load(INV_STD + h * d + cols, mask=cols < d, other=0.0)
    corr = mean_g[None, :] + z * mean_gz[None, :]
    if HAS_W:
        corr = corr * tl.load(W + (g // H).to(tl.int64) * L + rows, mask=rows < L)[:, None]
    gx = (gz - corr) * inv_std[None, :]
    if BF16:
        gx = _bfloat16(gx)
    tl.store(GX + _at(g, H, sb, sh, sl, rows)[:, None] + cols[None, :], gx, mask=keep)


@triton.jit
def post_forward_kernel(
    OUT, GAMMA, BETA, RESULT, LOG_ABS, sob, soh, sol, srb, srh, srl, H, L, d,
    SHARED: tl.constexpr, INTERPRETED: tl.constexpr, BD: tl.constexpr, BL: tl.constexpr,
):  # fmt: skip
    """result = y·exp((β − 1)·log|y|), y = γ·out, γ and β (Hg, d) per head or SHARED (Hg = 1),
    for tile ``block`` of group g; LOG_ABS = log|y| (|y| at least float32's smallest normal),
    kept for the backward. OUT read by its strides (sob, soh, sol), RESULT written by its
    own (srb, srh, srl): the heads' merged layout."""
    g, block = tl.program_id(0), tl.program_id(1)
    hg = 0 if SHARED else g % H
    rows, cols, keep = _block(block, L, d, BL, BD)
    out = _tile(OUT, _at(g, H, sob, soh, sol, rows), cols, keep)
    gamma = tl.load(GAMMA + hg * d + cols, mask=cols < d, other=0.0)
    beta = tl.load(BETA + hg * d + cols, mask=cols < d, other=0.0)
    y = gamma[None, :] * out
    log_abs = _log(tl.maximum(tl.abs(y), 1.17549435e-38), INTERPRETED)
    tl.store(LOG_ABS + _own(g, L, d, rows, cols), log_abs, mask=keep)
    result = y * _exp(log_abs * (beta[None, :] - 1.0), INTERPRETED)
    tl.store(RESULT + _at(g, H, srb, srh, srl, rows)[:, None] + cols[None, :], result, mask=keep)


@triton.jit
def post_backward_kernel(
    G, OUT, LOG_ABS, GAMMA, BETA, G_OUT, PART, sgb, sgh, sgl, sob, soh, sol, H, L, d,
    SHARED: tl.constexpr, INTERPRETED: tl.constexpr,
    BD: tl.constexpr, BL: tl.constexpr, TILES: tl.constexpr,
):  # fmt: skip
    """Post-SBN's backward over chunk t of group g's rows: with p = g·|y|^(β−1), G_OUT =
    p·(β·γ) (contiguous), and PART (G, T, 2d) float64 = [Σ p·out, Σ p·out·log|y|] (γ's and
    log β's gradients but for their factors β and β·γ). G read by its strides (sgb, sgh,
    sgl), as the merged heads' gradient arrives; OUT by its own."""
    g, t = tl.program_id(0), tl.program_id(1)
    hg = 0 if SHARED else g % H
    cols = tl.arange(0, BD)
    gamma = tl.load(GAMMA + hg * d + cols, mask=cols < d, other=0.0)
    beta = tl.load(BETA + hg * d + cols, mask=cols < d, other=0.0)
    acc = tl.zeros((BD,), dtype=tl.float64)
    acc_log = tl.zeros((BD,), dtype=tl.float64)
    for i in range(TILES):
        rows = (t * TILES + i) * BL + tl.arange(0, BL)
        keep = _keep(rows, cols, L, d)
        own = _own(g, L, d, rows, cols)
        grad = _tile(G, _at(g, H, sgb, sgh, sgl, rows), cols, keep)
        out = _tile(OUT, _at(g, H, sob, soh, sol, rows), cols, keep)
        log_abs = tl.load(LOG_ABS + own, mask=keep, other=0.0)
        p = _exp(log_abs * (beta[None, :] - 1.0), INTERPRETED) * grad
        tl.store(G_OUT + own, p * (beta * gamma)[None, :], mask=keep)
        term = p * out
        acc += tl.sum(term, 0).to(tl.float64)
        acc_log += tl.sum(term * log_abs, 0).to(tl.float64)
    part = PART + (g * tl.num_programs(1) + t) * (2 * d)
    tl.store(part + cols, acc, mask=cols < d)
    tl.store(part + d + cols, acc_log, mask=cols < d)
