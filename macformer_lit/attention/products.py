"""The products of feature attention, docs/maths.md §8: φ(q)ᵀ[φ(k) v1] for every query and
key at once (``feature_products``), and the causal one chunk by chunk (``causal_product``:
quadratic inside a chunk, the state of the chunks before it carried in as one GEMM with a
0/1 matrix, ``before_each_chunk``), with a backward written out. v1 is [v, 1]: numerator and
denominator from the same products. Shared by ``FeatureAttention`` and the fused causal path.
"""

from __future__ import annotations

import torch


def feature_products(phi_q: torch.Tensor, phi_k: torch.Tensor, v1: torch.Tensor) -> torch.Tensor:
    """φ(q)ᵀ[φ(k) v1]: φ (B, H, D', L), v1 (B, H, M, e) -> (B, H, N, e) in v1's dtype. The
    products run in the rows' dtype (bfloat16 rows: bfloat16 GEMMs, which accumulate in
    float32); with rows in v1's dtype the casts are no-ops."""
    low = v1.to(phi_k.dtype)
    return (phi_q.transpose(-1, -2) @ (phi_k @ low)).to(v1.dtype)


def _strictly_lower(n: int, like: torch.Tensor) -> torch.Tensor:
    """(n, n) ones below the diagonal: row c sums the rows before c."""
    return torch.ones(n, n, dtype=like.dtype, device=like.device).tril(-1)


def _chunk_prefix(state: torch.Tensor, later: bool) -> torch.Tensor:
    """Σ over the chunks before each (``later``: after each) of state (..., nc, D', e), as one
    batched GEMM with a 0/1 matrix: ``cumsum`` over a middle dimension, and its backward's
    two flips, ran at a fraction of memory speed on a CPU, and the GEMM is one launch where
    the backward of ``cumsum`` is three. The products by 0 and 1 are exact and the sums run in
    chunk order, so a chunk's entry depends on the chunks before it only (on finite states;
    a non-finite state reaches every chunk, through 0·inf)."""
    nc = state.shape[-3]
    tri = _strictly_lower(nc, state)
    flat = state.reshape(*state.shape[:-2], -1)  # (..., nc, D'·e)
    return ((tri.T if later else tri) @ flat).view(state.shape)


class _ExclusivePrefix(torch.autograd.Function):
    """``_chunk_prefix(state, later=False)``, whose gradient is the same sum the other way."""

    @staticmethod
    def forward(ctx, state):
        return _chunk_prefix(state, later=False)

    @staticmethod
    def backward(ctx, grad):
        return _chunk_prefix(grad, later=True)


def before_each_chunk(state: torch.Tensor) -> torch.Tensor:
    """The chunks' states (..., nc, D', e) summed over the chunks before each (an exclusive
    prefix: chunk c sees the keys of chunks < c; chunk 0 sees none)."""
    return _ExclusivePrefix.apply(state)


def _batched(t: torch.Tensor) -> torch.Tensor:
    """(..., a, b) as (n, a, b) for ``baddbmm``: a view where the layout allows."""
    return t.reshape(-1, t.shape[-2], t.shape[-1])


class _CausalProduct(torch.autograd.Function):
    """``causal_product`` with a backward written out: each gradient comes from one GEMM and
    one GEMM accumulated into it (``baddbmm``), in the layout it is returned in. Autograd
    through the eager expression added two activation-sized gradients for each of φ(q) and
    φ(k) (one through the chunk's own scores, one through the state), ran one of its GEMMs
    on a transposed output, and reversed the states' ``cumsum`` with two flips: about half of
    a causal layer's time on a CPU (docs/maths.md §8)."""

    @staticmethod
    def forward(ctx, phi_q, phi_k, v1):
        rows, out_dtype = phi_k.dtype, v1.dtype  # products in the rows' dtype, sums in v1's
        chunk = v1.shape[-2]
        keep = torch.ones(chunk, chunk, dtype=torch.bool, device=v1.device).tril()
        low = v1.to(rows)
        scores = (phi_q.transpose(-1, -2) @ phi_k).masked_fill_(~keep, 0.0)  # (..., C, C)
        state = _chunk_prefix((phi_k @ low).to(out_dtype), later=False).to(rows)
        out = (scores @ low).to(out_dtype) + (phi_q.transpose(-1, -2) @ state).to(out_dtype)
        ctx.save_for_backward(phi_q, phi_k, low, scores, state, keep)
        ctx.out_dtype = out_dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        phi_q, phi_k, low, scores, state, keep = ctx.saved_tensors
        out_dtype = ctx.out_dtype  # v1's
        g = grad.to(low.dtype)  # (..., C, e)
        d_scores = (g @ low.transpose(-1, -2)).masked_fill_(~keep, 0.0)  # (..., C, C)
        d_state = (phi_q @ g).to(out_dtype)  # (..., D', e): the gradient of each chunk's prefix
        d_kv = _chunk_prefix(d_state, later=True).to(low.dtype)  # of each chunk's own Σ φ(k) v1ᵀ
        d_phi_q = phi_k @ d_scores.transpose(-1, -2)
        _batched(d_phi_q).baddbmm_(_batched(state), _batched(g.transpose(-1, -2)))
        d_phi_k = phi_q @ d_scores
        _batched(d_phi_k).baddbmm_(_batched(d_kv), _batched(low.transpose(-1, -2)))
        d_low = scores.transpose(-1, -2) @ g
        _batched(d_low).baddbmm_(_batched(phi_k.transpose(-1, -2)), _batched(d_kv))
        return d_phi_q, d_phi_k, d_low.to(out_dtype)


def causal_product(phi_q: torch.Tensor, phi_k: torch.Tensor, v1: torch.Tensor) -> torch.Tensor:
    """Σ_{j≤i} (φ_qi·φ_kj) v1_j, chunked: φ (B, H, nc, D', C), v1 (B, H, nc, C, e) -> like v1.
    Products in the rows' dtype as in ``feature_products``; the sums over chunks in v1's."""
    return _CausalProduct.apply(phi_q, phi_k, v1)
