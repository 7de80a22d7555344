"""Random feature samplers and maps: pure functions, no training state.

Random Maclaurin features follow Kar & Karnick (2012) as used by Macformer (docs/maths.md §5);
the "official" and "h01" measures follow the dp-rfs code the SchoenbAt release builds on
(https://github.com/joneswack/dp-rfs, Wacker et al.). Orthogonal Gaussian features follow
Performer (Choromanski et al. 2021, docs/maths.md §6).

Degrees are geometric with P[N = n] = (p−1) p^{−(n−m+1)} for n ≥ m (m = 0 faithful,
1 official, 2 h01). At p = 2, m = 0 this is the papers' p^{−(n+1)}; for other p their
formula does not sum to one, so the (p−1) factor keeps the estimator unbiased for any p > 1.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from .kernels import Kernel
from .pieces import batch_slices

MIN_DEGREE = {"faithful": 0, "official": 1, "h01": 2}


def feature_seed(seed: int, layer: int, index: int) -> int:
    """A 63-bit seed from (seed, layer, redraw index): identical on every rank and run."""
    digest = hashlib.sha256(f"{seed}/{layer}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def sample_maclaurin(
    num_features: int, head_dim: int, *, p: float, measure: str, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted degrees (D,) and Rademacher ω (d, Σ degrees), feature-major columns."""
    u = torch.rand(num_features, generator=generator, dtype=torch.float64)
    # Inverse CDF of the geometric law: P[N ≥ m + n] = p^{−n}.
    degrees = MIN_DEGREE[measure] + torch.floor(-torch.log1p(-u) / math.log(p)).long()
    degrees = degrees.sort().values
    signs = torch.randint(0, 2, (head_dim, int(degrees.sum())), generator=generator)
    return degrees, (2 * signs - 1).float()


@dataclass
class MaclaurinLayout:
    """How a draw becomes feature rows: [constant, degree-1 rows, products of degree ≥ 2].

    All tensors are float64 on the CPU. ``omega`` (S, d) holds the degree-1 rows, then the
    factors of the product features by level: level j holds factor j of every feature of
    degree > j, features in descending degree, so each level's rows are a prefix of the
    level before. Every feature's scale is folded into its level-0 factor. The map is one
    matmul, then one product per level over all features that still have a factor there
    (``max_degree − 1`` products, not one per factor of every degree group).
    ``blocks`` lists (degree, count): the degree-1 block first, then the product features'
    groups in descending degree (their order in Φ's rows). ``first_degree`` (S,) is a
    feature's degree on its level-0 (or degree-1) row, else 0; ``row_degree`` (D',) is the
    degree of each feature row (constant first, when present).
    """

    const: float
    blocks: list[tuple[int, int]]
    omega: torch.Tensor
    first_degree: torch.Tensor
    is_first: torch.Tensor
    row_degree: torch.Tensor
    max_degree: int


def product_levels(blocks: list[tuple[int, int]]) -> tuple[int, list[int]]:
    """(rows of the degree-1 block, [rows at level j for j < max degree]) of a layout's
    ``blocks``: level j holds the product features of degree > j."""
    s1 = blocks[0][1] if blocks and blocks[0][0] == 1 else 0
    groups = [(n, c) for n, c in blocks if n >= 2]
    top = groups[0][0] if groups else 0  # descending degree (a generator trips dynamo)
    return s1, [sum(c for n, c in groups if n > j) for j in range(top)]


def maclaurin_layout(
    kernel: Kernel, degrees: torch.Tensor, omega: torch.Tensor, *, p: float, measure: str
) -> MaclaurinLayout:
    d, D, m = omega.shape[0], degrees.numel(), MIN_DEGREE[measure]
    a0 = kernel.coefficient(0)
    # All degree-0 features are the same constant: merged into one row (same dot product).
    if measure == "faithful":
        const = math.sqrt(int((degrees == 0).sum()) * a0 * p / (p - 1) / D)
    else:
        const = math.sqrt(a0)
    blocks, rows = [], []
    if measure == "h01" and kernel.coefficient(1) > 0:
        blocks.append((1, d))
        rows.append(torch.eye(d, dtype=torch.float64) * math.sqrt(kernel.coefficient(1)))
    products = []  # (n, c, factors (n, c, d)) of the degree ≥ 2 groups
    offset = 0
    for n, c in zip(*torch.unique_consecutive(degrees, return_counts=True)):
        n, c = int(n), int(c)
        block = omega[:, offset : offset + n * c].double()
        offset += n * c
        scale = math.sqrt(kernel.coefficient(n) * p ** (n - m + 1) / (p - 1) / D)
        if n == 0 or scale == 0.0:
            continue
        # feature-major columns (d, c, n) -> factors (n, c, d): factor j of each feature
        factors = block.view(d, c, n).permute(2, 1, 0).clone()
        factors[0] *= scale
        if n == 1:
            blocks.append((1, c))
            rows.append(factors[0])
        else:
            products.append((n, c, factors))
    products.sort(key=lambda g: -g[0])  # descending degree: each level a prefix of the last
    blocks += [(n, c) for n, c, _ in products]
    top = products[0][0] if products else 0
    for j in range(top):
        rows.append(torch.cat([f[j] for n, _, f in products if n > j]))
    first = [1] * (blocks[0][1] if blocks and blocks[0][0] == 1 else 0)
    first += [n for n, c, _ in products for _ in range(c)]
    first_degree = torch.tensor(first + [0] * (sum(r.shape[0] for r in rows) - len(first)))
    row_degree = [0] * (const > 0) + [n for n, c in blocks for _ in range(c)]
    return MaclaurinLayout(
        const=const,
        blocks=blocks,
        omega=torch.cat(rows) if rows else torch.zeros(0, d, dtype=torch.float64),
        first_degree=first_degree.double(),
        is_first=(first_degree > 0).double(),
        row_degree=torch.tensor(row_degree, dtype=torch.float64),
        max_degree=max([n for n, _ in blocks], default=0),
    )


def _fold(x, omega):
    """(x rows (..., G·L, d), ω (..., S, d), number of folded dims): the trailing batch dims
    of x that ω broadcasts over (the chunks of a causal pass) join x's rows, so one matmul
    reads ω once, where a batched matmul would copy ω once per chunk, which is slower
    (benchmarks/README.md, "Hot paths")."""
    lead = x.shape[:-2]
    extra = len(lead) - (omega.dim() - 2)
    if extra < 0:
        return x, omega, 0
    ob = (1,) * extra + tuple(omega.shape[:-2])
    g = len(lead)
    while g > 0 and ob[g - 1] == 1:
        g -= 1
    xf = x.reshape(*lead[:g], -1, x.shape[-1])
    return xf, omega.reshape(*ob[:g], *omega.shape[-2:]), len(lead) - g


def _unfold(t, shape, folded):
    """(..., S, G·L) -> (..., G, S, L) for x of ``shape`` (..., G, L, d), as a view."""
    if not folded:
        return t
    batch = t.shape[:-2]
    groups = shape[-2 - folded : -2]
    return t.view(*batch, t.shape[-2], *groups, shape[-2]).movedim(len(batch), -2)


def _pieces(xf, wf, const, x_dims, rows):
    """Slices of dim 0 (the batch) for the map: [(slice, x, ω, const)], each piece's
    projections ω·xᵀ (``rows`` per input row) ≤ ``pieces.PIECE_BYTES``, at least one batch
    entry a piece. ω and const are sliced where they carry the batch dimension, else shared.

    Whole-batch projections at the presets' shapes exceed glibc's mmap threshold: a fresh
    mmap every step, read back from memory instead of cache (pieces.py). CPU only
    (``batch_slices``): on a GPU every piece costs a kernel launch per level
    (docs/pitfalls.md §2)."""
    n = xf.shape[0] if xf.dim() >= 3 else 1
    per_entry = rows * xf[:1].numel() // max(xf.shape[-1], 1) * xf.element_size()
    slices = batch_slices(xf, per_entry) if xf.dim() >= 3 else [slice(None)]
    if len(slices) == 1:
        return [(slice(None), xf, wf, const)]

    def cut(t, sl, dims):
        if isinstance(t, torch.Tensor) and t.dim() == dims and t.shape[0] == n:
            return t[sl]
        return t

    return [(sl, xf[sl], cut(wf, sl, xf.dim()), cut(const, sl, x_dims)) for sl in slices]


class MaclaurinMap(torch.autograd.Function):
    """Φ(x) as feature rows (..., D', L) from x (..., L, d) and layout rows ω (..., S, d).

    Hand-written backward: autograd through ``prod``/``unbind`` over many small degree
    groups was several times slower than the matmuls on CPU (docs/pitfalls.md §2).
    ``const`` (broadcastable to (..., 1, L)) is the merged degree-0 row, or None.
    Eager on the CPU, both passes run over the batch in pieces (``pieces.PIECE_BYTES``): the
    S-row projections of one piece are made, used and dropped before the next.
    """

    @staticmethod
    def forward(ctx, x, omega, const, blocks):
        s1, levels = product_levels(blocks)
        c0 = int(const is not None)
        xf, wf, folded = _fold(x, omega)
        # x's rows (d wide; autograd keeps x anyway), not the S-row projections: backward
        # recomputes them with one matmul, so the map keeps d/S of the memory it did.
        ctx.save_for_backward(wf, xf)
        ctx.layout = (c0, s1, levels, folded, x.shape)
        if torch.compiler.is_compiling():
            # Traced: out-of-place products (``out=`` into slices breaks the graph), which
            # the compiler fuses anyway.
            flat = torch.matmul(wf, xf.transpose(-1, -2))  # (..., S, G·L)
            return _map_rows(_unfold(flat, x.shape, folded), const, s1, levels)
        rows = c0 + s1 + (levels[0] if levels else 0)
        batch = torch.broadcast_shapes(x.shape[:-2], omega.shape[:-2])
        dtype = torch.promote_types(x.dtype, omega.dtype)
        phi = x.new_empty(*batch, rows, x.shape[-2], dtype=dtype)  # (..., D', L)
        for sl, xc, wc, cc in _pieces(xf, wf, const, x.dim(), wf.shape[-2]):
            flat = torch.matmul(wc, xc.transpose(-1, -2))  # (..., S, G·L) of this piece
            proj = _unfold(flat, (*xc.shape[:-2], *x.shape[xf.dim() - 2 :]), folded)
            _fill_rows(phi[sl], proj, cc, c0, s1, levels)
        return phi

    @staticmethod
    def backward(ctx, grad):
        wf, xf = ctx.saved_tensors
        c0, s1, levels, folded, shape = ctx.layout
        if torch.compiler.is_compiling():
            flat = torch.matmul(wf, xf.transpose(-1, -2))  # the forward's projections, again
            proj = _unfold(flat, shape, folded)
            dflat = _map_rows_backward(grad, proj, c0, s1, levels, flat.shape, folded)
            dx = torch.matmul(dflat.transpose(-1, -2), wf)
            if folded:
                dx = dx.view(*dx.shape[:-2], *shape[-2 - folded :])
            return dx, None, None, None
        batch = torch.broadcast_shapes(wf.shape[:-2], xf.shape[:-2])
        dx = xf.new_empty(*batch, *xf.shape[-2:])  # (..., G·L, d)
        for sl, xc, wc, _ in _pieces(xf, wf, None, len(shape), wf.shape[-2]):
            flat = torch.matmul(wc, xc.transpose(-1, -2))  # the forward's projections, again
            piece_shape = (*xc.shape[:-2], *shape[xf.dim() - 2 :])
            proj = _unfold(flat, piece_shape, folded)
            dflat = torch.empty_like(flat)
            _fill_grad(_unfold(dflat, piece_shape, folded), grad[sl], proj, c0, s1, levels)
            torch.matmul(dflat.transpose(-1, -2), wc, out=dx[sl])
        if folded:
            dx = dx.view(*dx.shape[:-2], *shape[-2 - folded :])
        return dx, None, None, None


def _levels(t, s1, levels):
    """The per-level row slices [level 0, level 1, ...] of ``t`` (..., S, L) after ``s1``."""
    out, off = [], s1
    for r in levels:
        out.append(t[..., off : off + r, :])
        off += r
    return out


def _fill_rows(phi, proj, const, c0, s1, levels):
    """Write [const, degree-1 rows, products] of ``proj`` into the rows of ``phi``."""
    if c0:
        phi[..., :1, :] = const
    phi[..., c0 : c0 + s1, :] = proj[..., :s1, :]
    if not levels:
        return
    f = _levels(proj, s1, levels)
    out = phi[..., c0 + s1 : c0 + s1 + levels[0], :]
    torch.mul(f[0], f[1], out=out)
    for j in range(2, len(levels)):
        out[..., : levels[j], :].mul_(f[j])


def _fill_grad(dproj, grad, proj, c0, s1, levels):
    """∂/∂proj of the rows ``_fill_rows`` wrote, into ``dproj`` (every row of it). For a
    feature of degree n, ∂/∂f_j = g · Π_{i>j} f_i · Π_{i<j} f_i: the suffix products level
    by level from the top (in level 0's rows, which end as ∂/∂f_0), then the prefix."""
    dproj[..., :s1, :] = grad[..., c0 : c0 + s1, :]
    if not levels:
        return
    f, df = _levels(proj, s1, levels), _levels(dproj, s1, levels)
    top = len(levels)
    acc = df[0]
    acc.copy_(grad[..., c0 + s1 : c0 + s1 + levels[0], :])
    for j in range(top - 1, 0, -1):
        r = levels[j]
        df[j].copy_(acc[..., :r, :])  # g · Π_{i>j} f_i for the features of degree > j
        acc[..., :r, :].mul_(f[j])
    prefix = f[0].clone() if top > 2 else f[0]  # Π_{i<j} f_i, updated in place below
    for j in range(1, top):
        df[j].mul_(prefix[..., : levels[j], :])
        if j < top - 1:
            r = levels[j + 1]
            prefix[..., :r, :].mul_(f[j][..., :r, :])


def _map_rows(proj, const, s1, levels):
    """MaclaurinMap's forward without ``out=``: [const, degree-1 rows, products]."""
    parts = []
    if const is not None:
        parts.append(torch.ones_like(proj[..., :1, :]) * const)
    parts.append(proj[..., :s1, :])
    if levels:
        f = _levels(proj, s1, levels)
        prod = f[0] * f[1]
        for j in range(2, len(levels)):
            r = levels[j]
            prod = torch.cat([prod[..., :r, :] * f[j], prod[..., r:, :]], dim=-2)
        parts.append(prod)
    return torch.cat(parts, dim=-2)


def _map_rows_backward(grad, proj, c0, s1, levels, flat_shape, folded):
    """MaclaurinMap's backward without in-place writes: ∂/∂proj as one (..., S, G·L) tensor."""
    parts = [grad[..., c0 : c0 + s1, :]]
    if levels:
        f, top = _levels(proj, s1, levels), len(levels)
        acc = grad[..., c0 + s1 : c0 + s1 + levels[0], :]
        suffix = [None] * top
        for j in range(top - 1, 0, -1):
            r = levels[j]
            suffix[j] = acc[..., :r, :]
            acc = torch.cat([acc[..., :r, :] * f[j], acc[..., r:, :]], dim=-2)
        parts.append(acc)
        prefix = f[0]
        for j in range(1, top):
            parts.append(suffix[j] * prefix[..., : levels[j], :])
            if j < top - 1:
                r = levels[j + 1]
                prefix = prefix[..., :r, :] * f[j][..., :r, :]
    dproj = torch.cat(parts, dim=-2)
    return _refold(dproj, flat_shape, folded) if folded else dproj


def _refold(t, flat_shape, folded):
    """Inverse of ``_unfold``: (..., G, S, L) -> (..., S, G·L)."""
    batch_dims = t.dim() - 2 - folded
    return t.movedim(-2, batch_dims).reshape(flat_shape)


def sample_orthogonal_gaussian(
    num_features: int, head_dim: int, *, row_norm: str, generator: torch.Generator | None
) -> torch.Tensor:
    """(m, d) rows orthogonal in blocks of d (QR of a Gaussian), norms χ_d or √d (Performer)."""
    blocks = math.ceil(num_features / head_dim)
    g = torch.randn(blocks, head_dim, head_dim, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(g)
    # Sign fix of R's diagonal makes Q Haar-distributed; rows of Qᵀ are orthonormal.
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[:, None, :]
    w = q.transpose(-1, -2).reshape(blocks * head_dim, head_dim)[:num_features]
    if row_norm == "chi":
        norms = torch.randn(num_features, head_dim, generator=generator, dtype=torch.float64)
        w = w * norms.norm(dim=1, keepdim=True)
    else:
        w = w * math.sqrt(head_dim)
    return w.float()
