"""Slow, obviously correct building blocks for the backends' ``reference`` methods, for
tests and telemetry (fla ``ops/*/naive.py``).

Everything runs in float64 with dense (N, M) matrices, features one at a time, no
stabilisers, no chunking. Pure functions: a module's state (its feature draw, its
denominator policy, ppSBN's running estimates) comes in as arguments, and this file
imports none of the modules it checks. Each backend's ``reference`` lives with the
backend (``FeatureAttention`` derives it from the feature maps, ``PPSBNAttention``
composes ``pre_sbn_reference`` and ``post_sbn_reference`` around its core's);
``reference_forward`` calls it.
"""

from __future__ import annotations

import math

import torch

from .features import MIN_DEGREE
from .kernels import Kernel, get_kernel


def nmse(approx: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """‖approx − exact‖² / ‖exact‖² (docs/maths.md §13)."""
    return (approx.double() - exact.double()).pow(2).sum() / exact.double().pow(2).sum()


def keep_mask(q, k, key_padding_mask, causal):
    """(B, 1, N, M) bool: which key each query may see (not padded, and j ≤ i if causal)."""
    N, M = q.shape[2], k.shape[2]
    keep = torch.ones(q.shape[0], 1, N, M, dtype=torch.bool, device=q.device)
    if key_padding_mask is not None:
        keep = keep & key_padding_mask[:, None, None, :]
    if causal:
        keep = keep & torch.ones(N, M, dtype=torch.bool, device=q.device).tril()
    return keep


def weighted_average(weights, v, keep):
    """Σ_j w_ij v_j / Σ_j w_ij over kept pairs; rows with no kept key give 0."""
    weights = weights.masked_fill(~keep, 0.0)
    den = weights.sum(-1, keepdim=True)
    return (weights @ v.double()) / torch.where(den == 0, 1.0, den)


def kernelized_attention(
    q, k, v, kernel: str | Kernel = "exp", key_padding_mask=None, causal=False
):
    """Σ_j 𝒦(q_i·k_j/√d) v_j / Σ_j 𝒦(q_i·k_j/√d), dense."""
    kernel = get_kernel(kernel) if isinstance(kernel, str) else kernel
    keep = keep_mask(q, k, key_padding_mask, causal)
    logits = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    return weighted_average(kernel.exact(logits.masked_fill(~keep, 0.0)), v, keep)


def uniform_attention(q, k, v, key_padding_mask=None, causal=False):
    """Mean of the visible values: the limit of every kernel as q·k/√d -> 0."""
    keep = keep_mask(q, k, key_padding_mask, causal)
    return weighted_average(torch.ones_like(keep, dtype=torch.float64), v, keep)


def first_order_attention(q, k, v, kernel="exp", key_padding_mask=None, causal=False):
    """Kernelized attention with 𝒦 truncated to a₀ + a₁x (the deterministic [1, x] map)."""
    kernel = get_kernel(kernel) if isinstance(kernel, str) else kernel
    keep = keep_mask(q, k, key_padding_mask, causal)
    logits = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    return weighted_average(kernel.truncated(logits, 1), v, keep)


def prefix_sum_product(phi_q, phi_k, v):
    """Σ_{j≤i} (φ_qi·φ_kj) v_j by explicit prefix sums of outer products, φ (B, H, N, D')."""
    state = torch.cumsum(phi_k[..., :, None] * v[..., None, :], dim=2)  # (B, H, N, D', e)
    return (phi_q[..., :, None] * state).sum(-2)


def feature_attention(module, phi_q, phi_k, v, key_padding_mask, causal):
    """Dense φ(q)φ(k)ᵀ attention with the module's denominator policy; φ (B, H, L, D')."""
    keep = keep_mask(phi_q, phi_k, key_padding_mask, causal)
    scores = (phi_q @ phi_k.transpose(-1, -2)).masked_fill(~keep, 0.0)
    num, den = scores @ v.double(), scores.sum(-1, keepdim=True)
    count = keep.sum(-1, keepdim=True).double()
    eps = module.denominator_eps if module.signed_features else 0.0
    if module.denominator_floor == "absolute":
        count = torch.ones_like(count)
    threshold = (eps * count).clamp_min(torch.finfo(torch.float64).tiny ** 0.5)
    bad = ~(den > threshold)
    policy = module.denominator
    if policy == "clamp":
        den = torch.maximum(den, threshold)
    elif policy == "abs":
        den = torch.maximum(den.abs(), threshold)
    out = num / torch.where(bad & (policy == "fallback"), 1.0, den)
    if policy == "fallback":
        out = torch.where(bad, uniform_attention(phi_q, phi_k, v, key_padding_mask, causal), out)
    return out


def rmf_features(module, x):
    """Φ(x) one feature at a time (no merged constant), x already scaled by d^{-1/4}."""
    a, p, D = module.kernel.coefficient, module.p, module.num_features
    m = MIN_DEGREE[module.measure]
    omega = module.omega.double()
    ones = torch.ones_like(x[..., :1])
    feats = [] if module.measure == "faithful" else [math.sqrt(a(0)) * ones]
    if module.measure == "h01":
        feats.append(math.sqrt(a(1)) * x)
    col = 0
    for n in module.degrees.tolist():
        f = math.sqrt(a(n) * p ** (n - m + 1) / (p - 1) / D) * ones
        for _ in range(n):
            f = f * (x @ omega[:, col : col + 1])
            col += 1
        feats.append(f)
    return torch.cat(feats, -1)


def pre_sbn_reference(
    x, mask, *, stats, eps, batch, running_mean=None, running_var=None, temperature=None
):
    """Pre-SBN of x (B, H, L, d) (docs/maths.md §10): standardised per row (``stats:
    row``), per (head, channel) over the batch's real rows (``batch``; ``mask`` (B, L) or
    None), or with the running estimates (H, d); each row then L2-normalised and scaled
    by ``temperature`` (H, 1, 1) where given."""
    x = x.double()
    if stats == "row":
        x = x - x.mean(-1, keepdim=True)
        x = x / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + eps)
    elif batch:
        real = x.permute(1, 0, 2, 3)  # (H, B, L, d)
        real = real[:, mask] if mask is not None else real.flatten(1, 2)  # (H, n, d)
        mean, var = real.mean(1, keepdim=True), real.var(1, unbiased=False, keepdim=True)
        x = (x - mean) / torch.sqrt(var + eps)  # (H, 1, d) broadcasts
    else:
        mean, var = running_mean.double()[:, None], running_var.double()[:, None]
        x = (x - mean) / torch.sqrt(var + eps)
    x = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return x if temperature is None else x * temperature.double()


def post_sbn_reference(out, gamma, log_beta=None):
    """Post-SBN: y = γ·out, then sign(y)·|y|^β with β = exp(log_beta) where given."""
    y = gamma.double() * out
    if log_beta is not None:
        y = torch.sign(y) * y.abs().pow(log_beta.double().exp())
    return y


def reference_forward(
    module, q, k, v, *, key_padding_mask=None, causal=False, query_padding_mask=None
):
    """The reference output of any registered backend, ppSBN-wrapped or not (float64):
    ``module.reference``, given ``query_padding_mask`` where it reads one (pre-SBN).

    For ppSBN in training, call it before the module: the module's forward moves the
    running estimates the reference may read.
    """
    if module.reads_query_mask:
        return module.reference(
            q,
            k,
            v,
            key_padding_mask=key_padding_mask,
            causal=causal,
            query_padding_mask=query_padding_mask,
        )
    return module.reference(q, k, v, key_padding_mask=key_padding_mask, causal=causal)
