"""Pre-post Scaling Batch Normalization around any backend (Macformer Alg. 1; docs/maths.md §10).

Pre-SBN (q and k separately): standardise per (head, channel) with statistics over the batch
and the real positions only (BatchNorm semantics: running estimates for eval, synchronised
across DDP ranks, no affine), then L2-normalise each row, so |q·k|/√d ≤ 1/√d. ``stats: row``
is the SchoenbAt release's per-row standardisation instead. In causal attention batch
statistics would let position i see positions > i, so there training uses the running
estimates too (``sbn_train_stats: auto``); so does decoder cross-attention, whose queries
are causal although the call is not (the model builds it with ``causal_queries=True``).
An optional learnable temperature τ ∈ [1/τ_max, τ_max] (``temperature_init`` at init) scales
q after the L2 step: sharper attention at the price of a larger kernel argument. Its
parameter has its own learning rate (``temperature_lr``), so that log τ can cross its range
in hundreds of steps whatever the model's rate (docs/maths.md §10).
Post-SBN: out ← sign(γ·out)·|γ·out|^β, γ and β per (head, channel), β = exp(·) > 0, both 1 at
init (identity); ``post_sbn_power: false`` keeps γ·out only, and ``post_sbn_gamma: shared``
one γ for all heads, as the SchoenbAt release has it (docs/release.md). The release's
PostSBN reads ``out`` before assigning it; not here. All of it runs in fp32; the eager passes
are in eager_sbn.py.
``native_sbn: true`` runs pre-SBN's batch-statistics passes and post-SBN's power on float32
CPU tensors as native loops (native_sbn.py: the same maths in a few passes instead of
dozens); a Maclaurin backend with ``auto_kernels: true`` turns it on where a C++ compiler is.
``triton_sbn: true`` runs the same passes on CUDA tensors as Triton kernels (triton_sbn.py),
turned on by ``auto_kernels`` where it turns on the Triton fused products; with both set,
each takes its own device's tensors.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from .base import AttentionBackend, check_inputs
from .eager_sbn import (
    BatchStandardiseNormalise,
    PostSBN,
    all_reduce,
    batch_total,
    reduced,
    row_weights,
)
from .feature_attention import FeatureAttention
from .native_map import cxx_compiler, library
from .native_sbn import NativePostSBN, NativeStandardiseNormalise, normalise, runs_natively
from .pieces import batch_slices
from .reference import post_sbn_reference, pre_sbn_reference, reference_forward
from .triton_fused import triton_available
from .triton_sbn import TritonPostSBN, TritonStandardiseNormalise
from .triton_sbn import normalise as triton_normalise
from .triton_sbn import runs_on as triton_runs_on


def _lerp_row(buf: torch.Tensor, which: int, target: torch.Tensor, weight: float):
    """``buf`` with row ``which`` moved towards ``target`` (lerp), as a new tensor."""
    rows = list(buf.unbind(0))
    rows[which] = rows[which].lerp(target, weight)
    return torch.stack(rows)


class PPSBNAttention(AttentionBackend):
    """ppSBN around ``inner``. Its keyword options are the spec's own (``attention: {name:
    rmfa, pre_sbn: true, sbn_eps: 1e-13}``): this signature is where they are declared, and
    ``attention.spec`` reads them from it. ``causal_queries`` is not a spec option: the
    model sets it where the queries are causal although the call is not (decoder
    cross-attention), so that ``sbn_train_stats: auto`` trains on running statistics there.
    """

    reads_query_mask = True

    def __init__(
        self,
        inner: AttentionBackend,
        *,
        head_dim: int,
        num_heads: int,
        pre_sbn: bool = False,
        post_sbn: bool = False,
        sbn_eps: float = 1e-13,
        sbn_momentum: float = 0.1,
        sbn_stats: Literal["batch", "row"] = "batch",
        sbn_train_stats: Literal["auto", "batch", "running"] = "auto",
        temperature_max: float | None = None,
        temperature_init: float = 1.0,
        temperature_lr: float | None = 0.01,
        post_sbn_power: bool = True,
        post_sbn_gamma: Literal["head", "shared"] = "head",
        native_sbn: bool = False,
        triton_sbn: bool = False,
        causal_queries: bool = False,
    ) -> None:
        """
        Args:
            pre_sbn, post_sbn: the two halves' switches.
            sbn_eps, sbn_momentum, sbn_stats, sbn_train_stats: pre-SBN's standardisation.
            temperature_max: bound of the learnable temperature (None: no temperature).
            temperature_init: τ at init, inside (1/temperature_max, temperature_max).
            temperature_lr: learning rate of the temperature's parameter (scheduled like
                the model's); None: the model's own.
            post_sbn_power: the power β of post-SBN (false: γ·out only, as released).
            post_sbn_gamma: ``head``: γ (and β) per head and channel; ``shared``: per channel.
            native_sbn: pre-SBN's batch statistics and post-SBN's power as native loops on
                float32 CPU tensors (native_sbn.py; needs a C++ compiler); on by itself
                under a Maclaurin backend's ``auto_kernels: true`` where a compiler is.
            triton_sbn: the same passes as Triton kernels on float32 CUDA tensors
                (triton_sbn.py; a machine with a GPU needs the ``triton`` package); on by
                itself where ``auto_kernels: true`` turns on ``triton_fused``. With
                ``native_sbn`` too, each takes its own device's tensors.
        """
        super().__init__()
        if sbn_stats not in ("batch", "row"):
            raise ValueError(f"sbn_stats must be 'batch' or 'row'; got {sbn_stats!r}")
        if sbn_train_stats not in ("auto", "batch", "running"):
            raise ValueError(
                f"sbn_train_stats must be auto, batch or running; got {sbn_train_stats!r}"
            )
        if not (sbn_eps > 0 and 0 < sbn_momentum <= 1):
            raise ValueError(
                f"need sbn_eps > 0 and 0 < sbn_momentum <= 1; got {sbn_eps}, {sbn_momentum}"
            )
        if temperature_max is not None:
            if not pre_sbn:
                raise ValueError("temperature_max acts inside pre-SBN: set pre_sbn: true")
            if not temperature_max > 1.0:
                raise ValueError(f"temperature_max must be > 1; got {temperature_max}")
            kernel = getattr(inner, "kernel", None)
            if kernel is not None and kernel.restricted and temperature_max >= math.sqrt(head_dim):
                raise ValueError(
                    f"kernel {kernel.name!r} needs |q·k|/√d < 1, i.e. temperature_max < "
                    f"√head_dim = {math.sqrt(head_dim):.3g}; got {temperature_max}"
                )
            if not 1.0 / temperature_max < temperature_init < temperature_max:
                raise ValueError(
                    f"temperature_init must lie strictly between 1/temperature_max and "
                    f"temperature_max = {temperature_max}; got {temperature_init}"
                )
            if temperature_lr is not None and not temperature_lr > 0:
                raise ValueError(f"temperature_lr must be > 0 (or null); got {temperature_lr}")
        elif temperature_init != 1.0 or temperature_lr != 0.01:
            raise ValueError(
                "temperature_init and temperature_lr act on the temperature: set temperature_max"
            )
        if post_sbn_gamma not in ("head", "shared"):
            raise ValueError(f"post_sbn_gamma must be 'head' or 'shared'; got {post_sbn_gamma!r}")
        if native_sbn and not (pre_sbn or post_sbn):
            raise ValueError(
                "native_sbn acts on pre-SBN and post-SBN: set pre_sbn or post_sbn: true"
            )
        if native_sbn and cxx_compiler() is None:
            raise ValueError(
                "native_sbn: true needs a C++ compiler on PATH (g++, clang++ or $CXX): "
                "install one, or set native_sbn: false"
            )
        if triton_sbn and not (pre_sbn or post_sbn):
            raise ValueError(
                "triton_sbn acts on pre-SBN and post-SBN: set pre_sbn or post_sbn: true"
            )
        # As triton_fused: a machine without a GPU has no tensors for the kernels to take,
        # so there the option is inert, and a config can carry it for both machines.
        if triton_sbn and torch.cuda.is_available() and not triton_available():
            raise ValueError(
                "triton_sbn: true needs the triton package for this machine's GPU: install "
                "triton (CUDA builds of torch bring it), or set triton_sbn: false"
            )
        if getattr(inner, "auto_kernels", False):
            if getattr(inner, "_compiler", None):
                native_sbn = pre_sbn or post_sbn  # the machine's choice found a compiler
            if getattr(inner, "triton_fused", False):
                triton_sbn = pre_sbn or post_sbn  # and a GPU with triton
        # The compiler found once; the library built now, so a build that fails says so
        # before training.
        self._compiler = cxx_compiler() if native_sbn else None
        if native_sbn:
            library(self._compiler, "native_sbn")
        kernels = [
            name for name, on in (("native_sbn", native_sbn), ("triton_sbn", triton_sbn)) if on
        ]
        if kernels and hasattr(inner, "kernel_choice"):  # the run record's line (provenance.py)
            inner.kernel_choice += "; ppSBN: " + "+".join(kernels)
        self.native_sbn, self.triton_sbn = native_sbn, triton_sbn
        self.inner, self.pre_sbn, self.post_sbn = inner, pre_sbn, post_sbn
        self.sbn_eps, self.sbn_momentum = sbn_eps, sbn_momentum
        self.sbn_stats, self.sbn_train_stats = sbn_stats, sbn_train_stats
        self.temperature_max, self.causal_queries = temperature_max, causal_queries
        self.post_sbn_power, self.post_sbn_gamma = post_sbn_power, post_sbn_gamma
        self.temperature_init, self.temperature_lr = temperature_init, temperature_lr
        self.target_kernel = inner.target_kernel
        if pre_sbn and sbn_stats == "batch":
            self.register_buffer("running_mean", torch.zeros(2, num_heads, head_dim))
            self.register_buffer("running_var", torch.ones(2, num_heads, head_dim))
        if temperature_max is not None:
            # θ with log τ = b·tanh(θ/b): θ0 = b·atanh(log τ0 / b) gives τ0.
            bound = math.log(temperature_max)
            theta0 = bound * math.atanh(math.log(temperature_init) / bound)
            self.temperature_logit = nn.Parameter(torch.full((num_heads, 1, 1), theta0))
            if temperature_lr is not None:
                # Read by the optimiser (tasks/optim.py), as S4 and Mamba mark parameters.
                self.temperature_logit._optim = {"lr": temperature_lr, "weight_decay": 0.0}
        if post_sbn:
            heads = 1 if post_sbn_gamma == "shared" else num_heads
            self.gamma = nn.Parameter(torch.ones(heads, 1, head_dim))
            if post_sbn_power:
                self.log_beta = nn.Parameter(torch.zeros(heads, 1, head_dim))

    @property
    def pre(self) -> bool:
        return self.pre_sbn

    @property
    def post(self) -> bool:
        return self.post_sbn

    def leak_free(self, causal: bool) -> bool:
        """Whether training uses the running estimates instead of batch statistics: asked
        for (``sbn_train_stats: running``), or ``auto`` where batch statistics would let a
        query position see later ones (a causal call, or causal queries)."""
        return self.sbn_train_stats == "running" or (
            self.sbn_train_stats == "auto" and (causal or self.causal_queries)
        )

    def extra_repr(self) -> str:
        return (
            f"pre_sbn={self.pre_sbn}, post_sbn={self.post_sbn}, sbn_stats={self.sbn_stats}, "
            f"sbn_eps={self.sbn_eps}, temperature_max={self.temperature_max}, "
            f"native_sbn={self.native_sbn}, triton_sbn={self.triton_sbn}"
        )

    def _native(self, x: torch.Tensor) -> bool:
        return self.native_sbn and runs_natively(x)

    def _triton(self, x: torch.Tensor, bf16: bool = False) -> bool:
        return self.triton_sbn and triton_runs_on(x, bf16)

    def temperature(self) -> torch.Tensor:
        """τ per head, (H, 1, 1): log τ = log τ_max · tanh(θ / log τ_max), θ = 0 at init."""
        bound = math.log(self.temperature_max)
        return torch.exp(bound * torch.tanh(self.temperature_logit / bound))

    def _running_affine(self, x, mask, which: int, update: bool):
        """(shift, scale) of standardising with the running estimates (evaluation, and causal
        training), updating them from this batch first if asked; training on batch
        statistics takes BatchStandardiseNormalise instead. Copies: the update is in place."""
        mean = self.running_mean[which][:, None].clone()
        var = self.running_var[which][:, None].clone()
        if update:
            batch_mean, batch_var, n = self._moments(x, mask, differentiable=False)
            self._update_running(which, batch_mean, batch_var, n)
        inv_std = torch.rsqrt(var + self.sbn_eps)
        return -mean * inv_std, inv_std  # (x − μ)/σ = shift + x·inv_std

    @staticmethod
    def _moments(x, mask, differentiable: bool):
        """Mean and biased variance per (head, channel) over batch and real positions.

        Two passes of plain sums, over positions first (contiguous rows) then the batch:
        ``torch.var_mean`` over dims (0, 2) is slower on CPU. Masked sums stay ``(x·w).sum``:
        a matmul with the row mask is one long dot product instead of cascade sums, further
        from float64 (both measured in benchmarks/README.md, "Hot paths")."""
        if not differentiable:
            x = x.detach()  # only the running estimates read them: no graph to keep
        w, n = row_weights(x, mask)
        # Pieces only without a graph: slicing inside autograd is slow (docs/pitfalls.md §2).
        slices = [slice(None)] if differentiable else batch_slices(x)
        mean = all_reduce(batch_total(x, w, slices), differentiable) / n  # (H, 1, d)
        # ∂/∂μ of Σ w(x − μ)² is −2 Σ w(x − μ) = 0 over all ranks: no graph through μ here
        # (torch.var_mean's backward drops the same term), saving a full reduction backward.
        sq = batch_total(x, w, slices, lambda t: (t - mean.detach()).square())
        return mean, all_reduce(sq, differentiable) / n, n

    def _pre_sbn_one(self, x, mask, which: int, running: bool, update: bool, tau=None):
        """x standardised and L2-normalised per row, times ``tau`` (H, 1, 1) where given, in
        float32 or wider. The native and Triton batch-statistics passes read a bfloat16 x as
        it is; every other path computes on x cast to float32."""
        ct = torch.promote_types(x.dtype, torch.float32)
        batch = self.sbn_stats == "batch" and not running
        native = batch and self.native_sbn and runs_natively(x, bf16=True)
        triton = batch and not native and self._triton(x, bf16=True)
        if not (native or triton):
            x = x.to(ct)
        if batch:
            # Training on batch statistics: the fused forward/backward (same numbers).
            w, n = row_weights(x, mask, ct)
            # eps as a tensor: a Python float argument becomes symbolic under torch.compile's
            # dynamic shapes, which autograd.Function tracing does not support.
            eps = torch.full((), self.sbn_eps, dtype=ct, device=x.device)
            if native or triton:  # the temperature folded into the normalisation's pass
                w = None if mask is None else mask.to(ct).contiguous()
                if native:
                    y, mean, var = NativeStandardiseNormalise.apply(
                        x, w, n, eps, tau, self._compiler, reduced
                    )
                else:
                    y, mean, var = TritonStandardiseNormalise.apply(x, w, n, eps, tau, reduced)
                tau = None
            else:
                y, mean, var = BatchStandardiseNormalise.apply(x, w, n, eps)
            if update:
                self._update_running(which, mean, var, n)
            return y if tau is None else y * tau
        y = self._pre_sbn_eager(x, mask, which, update)
        return y if tau is None else y * tau

    def _pre_sbn_eager(self, x, mask, which: int, update: bool):
        """Row statistics, or the running estimates (evaluation, leak-free training)."""
        if self.sbn_stats == "row":
            # z = (x − μ)/σ with σ² = ‖x − μ‖²/d + eps, then z/max(‖z‖, 1e-12): σ cancels, so
            # y = (x − μ)/max(‖x − μ‖, 1e-12·σ), one reduction where var and normalize took
            # three (a third of the passes, docs/maths.md §10.1); a constant row meets the
            # same guards.
            x = x - x.mean(-1, keepdim=True)
            norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
            sigma = (norm.square() / x.shape[-1] + self.sbn_eps).sqrt()
            return x / torch.maximum(norm, 1e-12 * sigma)
        shift, scale = self._running_affine(x, mask, which, update)
        if not (torch.is_grad_enabled() and x.requires_grad):
            if self._native(x):
                return normalise(x, shift, scale, self._compiler)
            if self._triton(x):
                return triton_normalise(x, shift, scale)
        slices = batch_slices(x)
        if len(slices) == 1 or (torch.is_grad_enabled() and x.requires_grad):
            return F.normalize(torch.addcmul(shift, x, scale), dim=-1)
        # No graph (evaluation): over the batch in pieces, as the functions above.
        y = torch.empty_like(x)
        for sl in slices:
            z = torch.addcmul(shift, x[sl], scale)
            norm = torch.linalg.vector_norm(z, dim=-1, keepdim=True).clamp_min_(1e-12)
            torch.div(z, norm, out=y[sl])
        return y

    @torch.no_grad()
    def _update_running(self, which: int, mean, var, n):
        unbiased = var * n / (n - 1).clamp_min(1.0)
        if torch.compiler.is_compiling():
            # Compiled: new tensors bound to the buffers' names, never an in-place update.
            # AOTAutograd's backward may recompute from a graph input instead of saving, and
            # an input updated in place is read after its update then: with lerp_ here, the
            # query gradient of causal ppSBN (which normalises with the statistics from
            # before the update) was off by up to 3 % (tests/attention/test_attention_compile.py).
            # DDP's buffer broadcast keeps the tensors it found at wrap time; harmless here:
            # the moments are all-reduced, so every rank computes the same statistics.
            self.running_mean = _lerp_row(self.running_mean, which, mean[:, 0], self.sbn_momentum)
            self.running_var = _lerp_row(self.running_var, which, unbiased[:, 0], self.sbn_momentum)
            return
        self.running_mean[which].lerp_(mean[:, 0], self.sbn_momentum)
        self.running_var[which].lerp_(unbiased[:, 0], self.sbn_momentum)

    def _pre_sbn(self, q, k, q_mask, k_mask, running: bool, update: bool):
        tau = self.temperature() if self.temperature_max is not None else None
        q = self._pre_sbn_one(q, q_mask, 0, running, update, tau)
        k = self._pre_sbn_one(k, k_mask, 1, running, update)
        return q, k

    def _post_sbn(self, out):
        if not self.post_sbn_power:
            return self.gamma * out
        if out.dim() == 4 and self._native(out):
            return NativePostSBN.apply(out, self.gamma, self.log_beta, self._compiler)
        if out.dim() == 4 and self._triton(out):
            return TritonPostSBN.apply(out, self.gamma, self.log_beta)
        return PostSBN.apply(out, self.gamma, self.log_beta)

    def _finish(self, out, ct):
        """The core's output in the compute dtype ``ct``, post-SBN'd where that is on."""
        out = out.to(ct)
        return self._post_sbn(out) if self.post_sbn else out

    def forward(self, q, k, v, *, key_padding_mask=None, causal=False, query_padding_mask=None):
        check_inputs(
            q,
            k,
            v,
            key_padding_mask=key_padding_mask,
            causal=causal,
            query_padding_mask=query_padding_mask,
        )
        dtype = q.dtype
        ct = torch.promote_types(dtype, torch.float32)
        with torch.autocast(q.device.type, enabled=False):
            if not isinstance(self.inner, FeatureAttention):
                # A feature backend casts v where it builds [v, 1] (one pass fewer).
                v = v.to(ct)
            if self.pre_sbn:  # casts q and k itself (the native pass reads bfloat16)
                if query_padding_mask is None and causal:
                    query_padding_mask = key_padding_mask
                running = not self.training or self.leak_free(causal)
                q, k = self._pre_sbn(
                    q, k, query_padding_mask, key_padding_mask, running, update=self.training
                )
            else:
                q, k = q.to(ct), k.to(ct)
            if (
                self.post_sbn
                and isinstance(self.inner, FeatureAttention)
                and self.inner.recomputes(q, k, v)
            ):
                # ``recompute: true``: one checkpoint over the core and post-SBN, whose input
                # and log|y| would otherwise be kept (two activation-sized tensors a layer).
                out = torch.utils.checkpoint.checkpoint(
                    self._core_then_post, q, k, v, key_padding_mask, causal, use_reentrant=False
                )
            else:
                out = self._finish(
                    self.inner(q, k, v, key_padding_mask=key_padding_mask, causal=causal), ct
                )
        return out.to(dtype)

    def reference(self, q, k, v, *, key_padding_mask=None, causal=False, query_padding_mask=None):
        """ppSBN around the core's reference, in float64 (``attention/reference.py``), with
        the statistics ``forward`` would use. In training, call it before ``forward``, which
        moves the running estimates."""
        if self.pre_sbn:
            q_mask = query_padding_mask
            if q_mask is None and causal:
                q_mask = key_padding_mask
            tau = self.temperature() if self.temperature_max is not None else None
            q = self._pre_sbn_reference(q, q_mask, 0, causal, tau)
            k = self._pre_sbn_reference(k, key_padding_mask, 1, causal, None)
        out = reference_forward(
            self.inner, q, k, v.double(), key_padding_mask=key_padding_mask, causal=causal
        )
        if not self.post_sbn:
            return out
        return post_sbn_reference(out, self.gamma, self.log_beta if self.post_sbn_power else None)

    def _pre_sbn_reference(self, x, mask, which: int, causal: bool, tau):
        running = self.sbn_stats == "batch"
        return pre_sbn_reference(
            x,
            mask,
            stats=self.sbn_stats,
            eps=self.sbn_eps,
            batch=self.training and not self.leak_free(causal),
            running_mean=self.running_mean[which] if running else None,
            running_var=self.running_var[which] if running else None,
            temperature=tau,
        )

    def _core_then_post(self, q, k, v, key_padding_mask, causal):
        return self._finish(self.inner.attend_now(q, k, v, key_padding_mask, causal), q.dtype)

    def step(self, q, k, v, state=None):
        dtype = q.dtype
        ct = torch.promote_types(dtype, torch.float32)
        with torch.autocast(q.device.type, enabled=False):
            q, k, v = q.to(ct), k.to(ct), v.to(ct)
            if self.pre_sbn:
                q, k = self._pre_sbn(q, k, None, None, running=True, update=False)
            out, state = self.inner.step(q, k, v, state)
            out = self._finish(out, ct)
        return out.to(dtype), state
