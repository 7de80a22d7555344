"""ppSBN's passes in eager torch (docs/maths.md §10): pre-SBN with batch statistics as one
autograd Function with a closed-form backward, post-SBN's power as another, and the
statistics' helpers (real-row weights, per-(head, channel) totals, the all-reduce over DDP
ranks). native_sbn.py and triton_sbn.py run the same maths as native loops and Triton
kernels; ppsbn.py chooses between them. Eager on the CPU, every pass runs over the batch in
pieces (``pieces.batch_slices``), summed in the same order as one piece: the same bits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .pieces import batch_slices


def all_reduce(t: torch.Tensor, differentiable: bool) -> torch.Tensor:
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return t
    if differentiable:
        from torch.distributed.nn.functional import all_reduce

        return all_reduce(t)
    t = t.clone()
    dist.all_reduce(t)
    return t


def reduced(t: torch.Tensor) -> torch.Tensor:
    """t summed over DDP ranks, without a graph: the native and Triton passes' ``reduce``."""
    return all_reduce(t, False)


def row_weights(x: torch.Tensor, mask: torch.Tensor | None, dtype: torch.dtype | None = None):
    """(w, n): the (B, 1, L, 1) weights of real rows of x (B, H, L, d), None when all are
    real, and their number summed over DDP ranks (at least 1), in ``dtype`` (x's if None)."""
    dtype = dtype or x.dtype
    if mask is None:
        w, n = None, x.new_tensor(float(x.shape[0] * x.shape[2]), dtype=dtype)
    else:
        w, n = mask[:, None, :, None].to(dtype), mask.sum().to(dtype)
    return w, all_reduce(n, False).clamp_min(1.0)


def _cut(w: torch.Tensor | None, sl: slice) -> torch.Tensor | None:
    return None if w is None else w[sl]


def _entry_totals(t: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    """Σ over positions of (b, H, L, d), rows weighted by w: (b, H, d), one per entry."""
    return (t if w is None else t * w).sum(2)


def batch_total(x, w, slices: list[slice], fn=None) -> torch.Tensor:
    """Σ over the batch and positions of fn(x) (default x), rows weighted by w, per (head,
    channel): (H, 1, d). Over positions first (contiguous rows), then the batch; over the
    batch ``slices`` (``batch_slices``), each piece's per-entry sums kept and the batch
    summed once: the same order, so the same bits, as in one piece."""
    parts = [_entry_totals(x[sl] if fn is None else fn(x[sl]), _cut(w, sl)) for sl in slices]
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).sum(0)[:, None]


class BatchStandardiseNormalise(torch.autograd.Function):
    """Pre-SBN with batch statistics: z = (x − μ)/σ per (head, channel) over the batch and the
    real positions (μ, σ² of this batch, summed over DDP ranks), y = z/‖z‖ per row, with the
    closed-form backward (BatchNorm's, then the row normalisation's; the two per-channel sums
    of the batch-norm backward reduced over ranks like the forward's). It saves only y and
    ‖z‖, where autograd through the same steps kept x, z and their intermediates.

    Eager on the CPU, every pass runs over the batch in pieces (``pieces.batch_slices``):
    at the Text preset's shape each of the ~10 full-size temporaries of the two functions
    was a fresh mmap read back from memory (docs/pitfalls.md §2). Per-entry sums are taken
    piece by piece and summed over the batch once, in the same order as in one piece: the
    same bits (tests/attention/test_attention_ppsbn.py)."""

    @staticmethod
    def forward(ctx, x, w, n, eps):
        # x (B, H, L, d); w None or the (B, 1, L, 1) mask of real rows; n their count.
        slices = batch_slices(x)
        mean = all_reduce(batch_total(x, w, slices), False) / n
        var = all_reduce(batch_total(x, w, slices, lambda t: (t - mean).square_()), False) / n
        inv_std = torch.rsqrt(var + eps)
        shift = -mean * inv_std
        if len(slices) == 1:
            z = torch.addcmul(shift, x, inv_std)
            norm = torch.linalg.vector_norm(z, dim=-1, keepdim=True).clamp_min_(1e-12)
            y = z.div_(norm)
        else:
            y = torch.empty_like(x)
            norm = x.new_empty(*x.shape[:-1], 1)
            for sl in slices:
                z = torch.addcmul(shift, x[sl], inv_std)
                torch.linalg.vector_norm(z, dim=-1, keepdim=True, out=norm[sl])
                torch.div(z, norm[sl].clamp_min_(1e-12), out=y[sl])
        ctx.save_for_backward(y, norm, inv_std, w, n)
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var

    @staticmethod
    def backward(ctx, gy, _gmean, _gvar):
        y, norm, inv_std, w, n = ctx.saved_tensors
        slices = batch_slices(y)
        # Row normalisation: gz = (gy − y⟨y, gy⟩)/‖z‖. Batch norm: gx = (gz − w·(Σ gz +
        # ẑ·Σ gz·ẑ)/n)/σ with ẑ = (x − μ)/σ = y‖z‖. μ and σ come from the real rows (w = 1)
        # only, but every row, padded ones included, is standardised with them, so the sums
        # run over all rows and the correction reaches the real rows only.
        gx = torch.empty_like(y) if len(slices) > 1 else None
        sums_g, sums_gz = [], []
        for sl in slices:
            ys, ns = y[sl], norm[sl]
            dot = torch.linalg.vecdot(ys, gy[sl]).unsqueeze(-1)
            out = None if gx is None else gx[sl]  # gz of the piece, kept in gx's place
            gz = torch.addcmul(gy[sl], ys, dot, value=-1.0, out=out).div_(ns)
            sums_g.append(gz.sum(2))
            sums_gz.append((gz * (ys * ns)).sum(2))
        if gx is None:
            gx = gz
        sums = torch.cat([torch.cat(sums_g).sum(0), torch.cat(sums_gz).sum(0)])  # (2H, d)
        sums = all_reduce(sums, False) / n
        mean_g, mean_gz = sums.view(2, -1, 1, sums.shape[-1]).unbind(0)
        for sl in slices:
            corr = torch.addcmul(mean_g, y[sl] * norm[sl], mean_gz)
            if w is not None:
                corr = corr.mul_(w[sl])
            gx[sl].sub_(corr).mul_(inv_std)
        return gx, None, None, None


class PostSBN(torch.autograd.Function):
    """sign(y)·|y|^β with y = γ·out, as y·exp((β−1)·log|y|). The cost is the transcendental
    functions, not memory passes (docs/pitfalls.md §2): autograd's ``pow`` ran three of
    them forward and backward; here one log and one exp forward, one exp backward, and
    log|y| is kept for the backward pass. Eager on the CPU over the batch in pieces, as
    above; the parameters' gradients sum over positions per entry, then over the batch."""

    @staticmethod
    def forward(ctx, out, gamma, log_beta):
        beta = log_beta.exp()
        tiny = torch.finfo(out.dtype).tiny
        slices = batch_slices(out) if out.dim() == 4 else [slice(None)]
        if len(slices) == 1:
            y = gamma * out
            log_abs = y.abs().clamp_min_(tiny).log_()
            result = y.mul_(log_abs.mul(beta - 1.0).exp_())
        else:
            result, log_abs = torch.empty_like(out), torch.empty_like(out)
            for sl in slices:
                y = gamma * out[sl]
                la = torch.log(y.abs().clamp_min_(tiny), out=log_abs[sl])
                torch.mul(y, la.mul(beta - 1.0).exp_(), out=result[sl])
        ctx.save_for_backward(out, log_abs, gamma, log_beta)
        return result

    @staticmethod
    def backward(ctx, g):
        out, log_abs, gamma, log_beta = ctx.saved_tensors
        shared = gamma.shape[0] == 1  # one γ and β for all heads
        beta = log_beta.exp()
        slices = batch_slices(out) if out.dim() == 4 else [slice(None)]
        # ∂r/∂y = β|y|^(β−1); ∂r/∂β = r·log|y| = γ·out·|y|^(β−1)·log|y|; ∂/∂log β = β·∂/∂β.
        g_out = torch.empty_like(g) if len(slices) > 1 else None
        t_parts, tl_parts = [], []
        for sl in slices:
            gp = log_abs[sl].mul(beta - 1.0).exp_().mul_(g[sl])  # g·|y|^(β−1)
            if g_out is None:
                g_out = gp * (beta * gamma)
            else:
                torch.mul(gp, beta * gamma, out=g_out[sl])
            t = gp.mul_(out[sl])
            t_parts.append(t.sum(-2))
            tl_parts.append(t.mul_(log_abs[sl]).sum(-2))

        def total(parts):  # Σ over positions, then over the leading dims: (H, 1, d)
            t = torch.cat(parts)
            if t.dim() > 2:
                t = t.sum(tuple(range(t.dim() - 2)))
            return t[:, None]

        g_gamma = total(t_parts) * beta
        g_log_beta = total(tl_parts) * (beta * gamma)
        if shared:
            g_gamma, g_log_beta = g_gamma.sum(0, keepdim=True), g_log_beta.sum(0, keepdim=True)
        return g_out, g_gamma, g_log_beta
