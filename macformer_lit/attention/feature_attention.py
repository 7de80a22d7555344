"""Shared core of the feature-map backends (rmfa, favor, linear), docs/maths.md §8.

    out_i = φ(q_i)ᵀ [Σ_j φ(k_j) ⊗ v_j] / φ(q_i)ᵀ [Σ_j φ(k_j)]

Features are rows, φ (B, H, D', L). Bidirectional: one D'×(d+1) state, O((N+M)·D'·d).
Causal: chunked prefix sums (quadratic inside a chunk, state carried between chunks, as in
fla's ``chunk`` linear attention; both products live in products.py), and ``step`` decodes
with the same state in O(1) a token.
A ones column appended to v gives numerator and denominator from the same products.
Padded keys get zero rows in k and v, so they reach neither. The denominator policy is
explicit (``DENOMINATOR_POLICIES``): it acts on rows whose denominator is ≤ eps·n (n visible
keys; signed features, i.e. rmfa) or underflowed (positive features), and with
``collect_stats`` on, ``last_stats`` records how often it engaged. Random-feature
subclasses keep their draw in buffers, redrawn only by ``redraw_features`` (called from
``callbacks.redraw.FeatureRedraw``).
"""

from __future__ import annotations

from typing import ClassVar, Literal, NamedTuple, get_args

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from .base import AttentionBackend
from .features import feature_seed
from .products import causal_product, feature_products
from .reference import feature_attention as dense_feature_attention

Denominator = Literal["fallback", "clamp", "abs", "none"]
DENOMINATOR_POLICIES: tuple[str, ...] = get_args(Denominator)
DenominatorFloor = Literal["per_key", "absolute"]


class _DivideByLastColumn(torch.autograd.Function):
    """``out[..., :-1] / den`` for out = [numerator, raw denominator] (..., d+1), where
    ``den`` is the raw denominator after the policy and ``slope`` its derivative by the raw
    one (both computed without a graph; None: 1). Autograd through the two slices of out
    built two zero tensors of out's size, copied into them and added them, then negated and
    divided for the denominator's gradient; here backward writes out's gradient once
    (docs/pitfalls.md §2)."""

    @staticmethod
    def forward(ctx, out, den, slope):
        result = out[..., :-1] / den
        ctx.save_for_backward(result, den, slope)
        return result

    @staticmethod
    def backward(ctx, g):
        result, den, slope = ctx.saved_tensors
        # ∂/∂den of Σ g·num/den = −⟨g, result⟩/den, times the policy's slope.
        g_den = torch.linalg.vecdot(g, result).unsqueeze(-1).div_(den).neg_()
        if slope is not None:
            g_den = g_den.mul_(slope)
        if torch.compiler.is_compiling():  # traced: no out= into slices
            return torch.cat([g / den, g_den], dim=-1), None, None
        g_out = g.new_empty(*g.shape[:-1], g.shape[-1] + 1)
        torch.div(g, den, out=g_out[..., :-1])
        g_out[..., -1:] = g_den
        return g_out, None, None


@torch.no_grad()
def _apply_policy(policy: str, den, threshold, bad):
    """(den after ``policy``, its derivative by den or None for 1): the values and the
    gradients autograd gives ``torch.maximum`` (ties split evenly), ``abs`` and ``where``."""
    if policy == "clamp":
        return torch.maximum(den, threshold), _max_slope(den, threshold)
    if policy == "abs":
        size = den.abs()
        return torch.maximum(size, threshold), _max_slope(size, threshold).mul_(den.sgn())
    if policy == "fallback":
        # The safe denominator 1 keeps NaN out of the unused rows' values.
        return torch.where(bad, torch.ones_like(den), den), (~bad).to(den.dtype)
    return den, None


def _max_slope(x, threshold):
    """∂ max(x, threshold)/∂x as autograd has it: 1 above, 1/2 at a tie, 0 below."""
    return torch.where(x == threshold, 0.5, (x > threshold).to(x.dtype))


def fallback_means_always(device: torch.device) -> bool:
    """Whether the fallback's means are built for every row, needed or not: off the CPU
    (knowing whether a row needs them is a host sync there) and under torch.compile (a graph
    break). The values are the same either way: ``where`` picks the same entries."""
    return device.type != "cpu" or torch.compiler.is_compiling()


def _resize_to_incoming_draw(module, state_dict, prefix, *args) -> None:
    """A checkpoint may hold a draw of another size: resize the buffers to it before the copy."""
    for name in module.resizable_buffers:
        incoming = state_dict.get(prefix + name)
        if incoming is not None and incoming.shape != getattr(module, name).shape:
            getattr(module, name).resize_(incoming.shape)


def _refresh_after_load(module, incompatible_keys) -> None:
    """The derived buffers follow the loaded draw."""
    module._refresh()


def per_head(stat: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Reduce-free reshape of a (B, H) statistic to broadcast against ``like`` (B, H, ...)."""
    return stat.reshape(*stat.shape[:2], *([1] * (like.dim() - 2)))


class KeyFeatures(NamedTuple):
    """φ of the keys, (B, H, ..., D', L), and ``ref``: None, or a detached per-(batch, head)
    key statistic fixing the numerical range (it cancels in the ratio)."""

    phi: torch.Tensor
    ref: torch.Tensor | None


class QueryFeatures(NamedTuple):
    """φ of the queries, (B, H, ..., D', L), and ``den_scale``: None, or the per-(batch, head)
    factor by which the query features were scaled (the denominator threshold follows it)."""

    phi: torch.Tensor
    den_scale: torch.Tensor | None


class FeatureAttention(AttentionBackend):
    """Base of φ(q)ᵀφ(k) backends. The subclass protocol, all of it:

    - ``_key_features(k, keep, floor) -> KeyFeatures`` and ``_query_features(q, ref) ->
      QueryFeatures`` on x (B, H, ..., L, d) -> φ (B, H, ..., D', L). ``keep`` is None or a
      bool broadcastable to (B, H, ..., 1, L) marking real keys; ``floor`` is the running
      ``ref`` while decoding (the new ``ref`` must be ≥ it).
    - ``_rescale_state(ref_old, ref_new)``: the factor moving a decoding state from one
      ``ref`` to the next; needed only when ``_key_features`` returns a ``ref``.
    - ``reference_features(q, k, key_padding_mask) -> (φ_q, φ_k)``, float64 rows
      (B, H, L, D'): what ``reference`` is built on. The default evaluates the two hooks
      above in float64; a backend with an independent slow map overrides it.
    - ``recompute`` (an option of every feature backend): keep only q, k, v for the backward
      pass (``torch.utils.checkpoint``) and compute the features again there.
    - class flags: ``signed_features`` (features may be negative: the denominator policy then
      tests against eps·n), ``random_features`` (a draw in buffers, redrawn by
      ``redraw_features``; such a subclass defines ``_draw(generator)`` and ``_refresh()``
      and lists in ``resizable_buffers`` the buffers whose shape a draw may change).
    """

    signed_features: ClassVar[bool] = False
    random_features: ClassVar[bool] = False
    resizable_buffers: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        *,
        head_dim: int,
        num_heads: int,
        denominator: Denominator = "fallback",
        denominator_eps: float = 1e-3,
        denominator_floor: DenominatorFloor = "per_key",
        chunk_size: int = 64,
        recompute: bool = False,
    ) -> None:
        """The options every feature backend shares; a subclass takes them as ``**common``
        and hands them on here, so they are written once (``spec.parse_spec`` and the CLI
        follow the hand-on).

        Args:
            denominator: what rows with a denominator ≤ eps·n get (``DENOMINATOR_POLICIES``).
            denominator_eps: that threshold, relative to the number of visible keys n.
            denominator_floor: ``per_key``: the threshold is eps·n; ``absolute``: eps (the
                SchoenbAt release clamps its denominator at 1).
            chunk_size: positions per block of the causal prefix sums.
            recompute: keep only q, k, v for the backward pass and recompute the features.
        """
        super().__init__()
        if denominator not in DENOMINATOR_POLICIES:
            valid = ", ".join(DENOMINATOR_POLICIES)
            raise ValueError(f"unknown denominator policy {denominator!r}; valid: {valid}")
        if not denominator_eps >= 0.0:
            raise ValueError(f"denominator_eps must be >= 0; got {denominator_eps}")
        if denominator_floor not in get_args(DenominatorFloor):
            raise ValueError(
                f"denominator_floor must be per_key or absolute; got {denominator_floor!r}"
            )
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
        self.head_dim, self.num_heads = head_dim, num_heads
        self.denominator, self.denominator_eps = denominator, denominator_eps
        self.denominator_floor = denominator_floor
        self.chunk_size = chunk_size
        self.recompute = recompute
        if self.random_features:
            self._register_load_hooks()

    # ---- the subclass protocol (see the class docstring) ------------------------------
    def _key_features(
        self, k: torch.Tensor, keep: torch.Tensor | None, floor: torch.Tensor | None
    ) -> KeyFeatures:
        raise NotImplementedError

    def _query_features(self, q: torch.Tensor, ref: torch.Tensor | None) -> QueryFeatures:
        raise NotImplementedError

    def _rescale_state(self, ref_old: torch.Tensor, ref_new: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} returns a ref but no _rescale_state")

    def reference_features(
        self, q: torch.Tensor, k: torch.Tensor, key_padding_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(φ_q, φ_k) in float64, rows (B, H, L, D'), from the hooks. Their per-(batch, head)
        scale cancels in the ratio; for signed features the denominator threshold would
        follow it, so a signed backend whose hooks rescale overrides this (RMFA does)."""
        keep = None if key_padding_mask is None else key_padding_mask[:, None, None, :]
        phi_k, ref = self._key_features(k.double(), keep, None)
        phi_q, _ = self._query_features(q.double(), ref)
        return phi_q.transpose(-1, -2), phi_k.transpose(-1, -2)

    def reference(self, q, k, v, *, key_padding_mask=None, causal=False):
        """Dense φ(q)φ(k)ᵀ attention in float64 with this backend's denominator policy."""
        phi_q, phi_k = self.reference_features(q, k, key_padding_mask)
        return dense_feature_attention(self, phi_q, phi_k, v, key_padding_mask, causal)

    def recomputes(self, q, k, v) -> bool:
        """Whether this call keeps only its inputs for backward (``recompute`` on, and a graph
        being built through q, k or v)."""
        return (
            self.recompute and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        )

    def _attend(self, q, k, v, *, key_padding_mask, causal):
        if self.recomputes(q, k, v):
            # Keep only q, k, v for the backward pass and compute the features again there
            # (the feature matrices and the map's intermediates are most of the layer's
            # saved memory). The forward has no randomness: the recomputation is exact.
            return torch.utils.checkpoint.checkpoint(
                self.attend_now, q, k, v, key_padding_mask, causal, use_reentrant=False
            )
        return self.attend_now(q, k, v, key_padding_mask, causal)

    def attend_now(self, q, k, v, key_padding_mask, causal):
        """The attention on validated inputs, without ``recompute``'s checkpoint: for a
        wrapper that checkpoints more than this call (ppSBN, post-SBN included)."""
        dtype = q.dtype
        ct = torch.promote_types(dtype, torch.float32)
        with torch.autocast(q.device.type, enabled=False):
            q, k = q.to(ct), k.to(ct)
            B, H, N, _ = q.shape
            M = k.shape[2]
            mask = key_padding_mask
            if mask is None:
                ones = q.new_ones(B, H, M, 1)
            else:
                keep = mask[:, None, :, None]
                if self._keys_masked(q):
                    k = k.masked_fill(~keep, 0.0)
                ones = keep.to(ct).expand(B, H, M, 1)
            # [v, 1]: numerator and denominator from the same products; zero at padded keys.
            # v (bfloat16 under autocast) reaches ct in the concatenation itself (exactly:
            # every bfloat16 is a float32), one pass fewer than a cast first; padded keys'
            # rows are zeroed in place there, not in a masked copy of v first.
            v1 = torch.cat([v, ones], dim=-1).to(ct)  # (B, H, M, d+1); .to: v wider than ct
            if mask is not None:
                v1 = v1.masked_fill_(~keep, 0.0)
            if causal:
                out, den_scale = self._causal(q, k, v1, mask)
                if mask is None:
                    count = torch.arange(1, N + 1, device=q.device, dtype=ct)[:, None]
                else:
                    count = mask.cumsum(-1, dtype=ct)[:, None, :, None]  # (B, 1, N, 1)
            else:
                out, den_scale = self._bidirectional(q, k, v1, mask)  # (B, H, N, d+1)
                count = M if mask is None else mask.sum(-1, dtype=ct)[:, None, None, None]

            def visible_sums():
                return v1.cumsum(2) if causal else v1.sum(2, keepdim=True)

            return self._normalise(out, count, den_scale, visible_sums).to(dtype)

    def _keys_masked(self, q) -> bool:
        """Whether padded keys are zeroed before the features: their rows of [v, 1] are zero,
        so they reach neither sum whatever k holds there, but a feature map may read every
        key (random features' statistics, the unfused products' rows). A backend whose
        products only ever weight φ(k_l) by [v_l, 1] can skip the copy."""
        return True

    def _bidirectional(self, q, k, v1, mask):
        """(φ(q)ᵀ[φ(k)ᵀ v1], den_scale): every query over every key; padded keys are zero in
        k and v1 (so they reach neither sum)."""
        keep = None if mask is None else mask[:, None, None, :]
        phi_k, ref = self._key_features(k, keep, None)
        phi_q, den_scale = self._query_features(q, ref)
        return feature_products(phi_q, phi_k, v1), den_scale

    def _causal(self, q, k, v1, mask):
        """Chunked causal pass: the sequence becomes (nc, C) before the feature map, so every
        per-chunk matmul reads its operands in place."""
        B, H, N, _ = q.shape
        # Compiled: one graph for every length, so nothing may depend on whether N is a
        # multiple of the chunk: chunks of chunk_size and 1 to C padded positions, never 0
        # (with none, the final slice's contiguity differs and a guard on it recompiled).
        # Eager pads only when it has to.
        compiling = torch.compiler.is_compiling()
        C = self.chunk_size if compiling else min(self.chunk_size, N)
        pad = C - N % C if compiling else -N % C
        keep = mask
        if compiling or pad:
            q, k, v1 = F.pad(q, (0, 0, 0, pad)), F.pad(k, (0, 0, 0, pad)), F.pad(v1, (0, 0, 0, pad))
            keep = torch.ones(B, N, dtype=torch.bool, device=q.device) if mask is None else mask
            keep = F.pad(keep, (0, pad), value=False)
        nc = (N + pad) // C
        q, k, v1 = (t.reshape(B, H, nc, C, -1) for t in (q, k, v1))
        keep = None if keep is None else keep.view(B, 1, nc, 1, C)
        phi_k, ref = self._key_features(k, keep, None)
        phi_q, den_scale = self._query_features(q, ref)
        out = causal_product(phi_q, phi_k, v1).reshape(B, H, N + pad, -1)[:, :, :N]
        return out, den_scale

    def step(self, q, k, v, state=None):
        """O(1)-per-token causal decoding; equals row t of the full causal pass."""
        dtype = q.dtype
        ct = torch.promote_types(dtype, torch.float32)
        with torch.autocast(q.device.type, enabled=False):
            q, k, v = q.to(ct), k.to(ct), v.to(ct)
            v1 = F.pad(v, (0, 1), value=1.0)  # (B, H, 1, d+1)
            floor = None if state is None else state.get("ref")
            phi_k, ref = self._key_features(k, None, floor)
            kv, totals = (phi_k @ v1.to(phi_k.dtype)).to(ct), v1  # the state in ct
            if state is not None:
                scale = 1.0 if ref is None else self._rescale_state(state["ref"], ref)
                kv, totals = state["kv"] * scale + kv, state["totals"] + v1
            phi_q, den_scale = self._query_features(q, ref)
            out = (phi_q.transpose(-1, -2) @ kv.to(phi_q.dtype)).to(ct)
            out = self._normalise(out, totals[..., -1:], den_scale, lambda: totals).to(dtype)
        new_state = {"kv": kv, "totals": totals}
        if ref is not None:
            new_state["ref"] = ref
        return out, new_state

    @torch.no_grad()
    def diagnose(self, q, k, v, *, key_padding_mask=None, causal=False) -> dict[str, float]:
        """Forensics of one forward on these inputs (NaNGuard calls it after a non-finite
        loss or gradient): the largest |φ(q)| and |φ(k)| entry (in the rescaled feature
        space the forward uses), the smallest |denominator| φ(q)ᵀΣφ(k) over all query rows
        (before the denominator policy), and how many of them are ≤ 0 or non-finite."""
        ct = torch.promote_types(q.dtype, torch.float32)
        with torch.autocast(q.device.type, enabled=False):
            q, k = q.to(ct), k.to(ct)
            mask = key_padding_mask
            keep = None
            if mask is not None:
                k = k.masked_fill(~mask[:, None, :, None], 0.0)
                keep = mask[:, None, None, :]
            phi_k, ref = self._key_features(k, keep, None)
            phi_q, _ = self._query_features(q, ref)
            phi_q, phi_k = phi_q.to(ct), phi_k.to(ct)  # sums in ct whatever the rows' dtype
            if keep is not None:  # padded keys reach no denominator (the forward's ones column)
                phi_k = phi_k * keep
            if causal and q.shape[2] == k.shape[2]:
                sums = phi_k.cumsum(-1)  # (B, H, D', N): keys up to each query
            else:
                sums = phi_k.sum(-1, keepdim=True)
            den = (phi_q * sums).sum(-2)  # (B, H, N)
        return {
            "max_abs_feature_q": float(phi_q.abs().max()),
            "max_abs_feature_k": float(phi_k.abs().max()),
            "min_abs_denominator": float(den.abs().min()),
            "denominators_nonpositive": int((den <= 0).sum()),
            "denominators_nonfinite": int((~torch.isfinite(den)).sum()),
        }

    def _normalise(self, out, count, den_scale, visible_sums):
        """num/den under the denominator policy; ``count`` = number of visible real keys,
        ``visible_sums()`` = [Σ v, n] over them (only computed if the fallback is needed)."""
        den = out[..., -1:].detach()  # the policy and the division's gradient act on it
        # Smallest usable denominator: its square stays finite in the backward pass.
        tiny = torch.finfo(den.dtype).tiny ** 0.5
        if self.signed_features:
            # A true denominator is about a₀·n after pre-SBN; below eps·n the estimate is noise.
            n = 1.0 if self.denominator_floor == "absolute" else count
            threshold = self.denominator_eps * torch.as_tensor(n, dtype=den.dtype)
            if den_scale is not None:
                threshold = threshold * den_scale.reshape(*den_scale.shape[:2], 1, 1)
            threshold = threshold.clamp_min(tiny)
        else:
            threshold = torch.full((), tiny, dtype=den.dtype, device=den.device)
        bad = ~(den > threshold)
        if self.collect_stats:
            real = (torch.as_tensor(count, device=den.device) > 0).expand_as(bad)
            rate = (bad & real).sum() / real.sum().clamp_min(1)
            self.last_stats = {"denominator_engaged": rate.detach().float()}
        den, slope = _apply_policy(self.denominator, den, threshold, bad)
        out = _DivideByLastColumn.apply(out, den, slope)
        # The fallback is uniform attention over the visible keys, which every kernel tends to
        # after pre-SBN. Rows needing it are rare: on the CPU ``bad.any()`` is free, so the
        # means are built only then; on an accelerator it would be a host sync, and under
        # torch.compile a graph break, so they are always built (``fallback_means_always``).
        if self.denominator == "fallback" and (
            fallback_means_always(out.device) or bool(bad.any())
        ):
            sums = visible_sums()
            mean = sums[..., :-1] / sums[..., -1:].clamp_min(1.0)
            out = torch.where(bad, mean, out)
        return out

    # Random features: buffers, seeded redraw, checkpoint shapes.
    def _draw(self, generator: torch.Generator | None) -> None:
        raise NotImplementedError

    def redraw_features(self, *, seed: int, layer: int, index: int) -> None:
        """Replace the draw with the one seeded by (seed, layer, index): same on every rank."""
        if not self.random_features:
            return
        self._draw(torch.Generator().manual_seed(feature_seed(seed, layer, index)))
        self.redraw_index.fill_(index)

    def _set_buffer(self, name: str, value: torch.Tensor) -> None:
        # set_ keeps the buffer object (DDP and optimisers hold references) while the shape
        # may change between draws.
        buf = getattr(self, name)
        buf.set_(value.to(device=buf.device, dtype=buf.dtype))

    def _register_load_hooks(self) -> None:
        # Public hooks of module-level functions (a closure over self would follow a deepcopy
        # back to the original module, and would not pickle).
        self.register_load_state_dict_pre_hook(_resize_to_incoming_draw)
        self.register_load_state_dict_post_hook(_refresh_after_load)

    def _apply(self, fn, recurse=True):
        # Derived buffers are rebuilt from the draw at the new dtype (exact scales in float64,
        # not float32 values cast up). The private override stays: nn.Module has no public
        # hook that runs after .to() / .double() / .cuda().
        super()._apply(fn, recurse)
        if self.random_features:
            self._refresh()
        return self

    def _refresh(self) -> None:
        """Recompute anything derived from the draw buffers (after a draw or a load)."""
