"""ppSBN's passes as Triton kernels (``triton_sbn: true``; triton_sbn_kernels.py, docs/maths.md
§10.5): native_sbn.py's passes for CUDA tensors, or CPU ones under Triton's interpreter
(``TRITON_INTERPRET=1``), which is how the tests check them without a GPU.

Eager, pre-SBN with batch statistics and post-SBN's signed power are 7 to 12 ATen launches
each way, most of them writing a temporary the size of q: on a GPU that makes Macformer's
step launch-bound (ppSBN added 22–28 % to it on an H100, benchmarks/README.md). Here, as in
the C++ loops:

    pre-SBN forward   two moment kernels (Σ w·x, then Σ w·(x − μ)²), one writing y = z/‖z‖
                      with z = (x − μ)/σ (and τ·y for the queries: the temperature folded in)
    pre-SBN backward  one kernel for the two per-channel sums of the batch-norm backward (and
                      τ's gradient), one writing ∂x
    post-SBN          one kernel forward (y·exp((β − 1)·log|y|), log|y| kept), one backward

The DDP all-reduces (``reduce``) run between the kernels, and the little arithmetic on
(H, d) tensors between them (μ, σ, the backward's means) in torch, as native_sbn.py has it.
Sums are deterministic, without atomics: a program covers a chunk of TILES tiles of BL rows
of one (batch entry, head), sums each tile in float32 and the tiles in float64, and writes
its partial sums; torch adds the partials in float64, over the chunks and the batch, in a
fixed order: the same bits on every launch. x is read where it is (q and k as the
(B, L, H, d) projections' transposed views, float32, or bfloat16 as autocast's projections
give them) and ∂x written in its layout and dtype (bfloat16 rounded to nearest even, as a
cast of the float32 gradient would be); post-SBN writes its result in the heads' merged
layout and reads its gradient as it comes. Divisions and the square root are IEEE-rounded
(``div_rn``, ``sqrt_rn``), as the C++ loops'; exp and log are CUDA's expf and logf
(libdevice, within 2 and 1 ulp, as the C++ polynomials; under the interpreter NumPy's in
float64, rounded). The kernels are imported on first use, so ``TRITON_INTERPRET`` is read
then.
"""

from __future__ import annotations

import functools
import importlib

import torch
from torch.autograd.function import once_differentiable

from .native_sbn import (
    _rows,
    batch_statistics,
    finish_pre_sbn,
    grad_input_buffer,
    pre_sbn_buffers,
)
from .triton_fused import interpreted


def runs_on(x: torch.Tensor, bf16: bool = False) -> bool:
    """Whether ``triton_sbn`` takes x: a float32 CUDA tensor, or a CPU one under Triton's
    interpreter (bfloat16 too where ``bf16``: pre-SBN reads q and k as autocast's projections
    give them), outside torch.compile's tracing."""
    dtypes = (torch.float32, torch.bfloat16) if bf16 else (torch.float32,)
    on = x.device.type == "cuda" or (x.device.type == "cpu" and interpreted())
    return on and x.dtype in dtypes and not torch.compiler.is_compiling()


@functools.cache
def _kernels():
    """triton_sbn_kernels, imported on first use: TRITON_INTERPRET is read then, and a machine
    without triton imports this module all the same."""
    return importlib.import_module(f"{__package__}.triton_sbn_kernels")


def _blocks(d: int) -> tuple[int, int, int]:
    """(BD, BL, TILES): the head size padded to a power of two; the rows of a tile (64 on a GPU,
    fewer above d = 64 so that a tile stays 4,096 floats; 16 under the interpreter, so that
    the tests' short sequences cross tiles and chunks); the tiles a summing program covers (4:
    chunks of 256 rows on a GPU; 2 under the interpreter)."""
    BD = 1 << max(0, d - 1).bit_length()
    if interpreted():
        return BD, 16, 2
    return BD, max(1, min(64, 4096 // BD)), 4


def _grid(x: torch.Tensor, rows: int) -> tuple[int, int]:
    """(groups, programs a group) for x (B, H, L, d), a program taking ``rows`` rows."""
    B, H, L, _ = x.shape
    return B * H, max(1, -(-L // rows))


def _partial_total(part: torch.Tensor, B: int, H: int) -> torch.Tensor:
    """(H, width) float64: part (B·H, T, width) summed over the chunks and the batch."""
    return part.view(B, H, part.shape[1], -1).sum((0, 2))


def _moment(x, w, mean) -> torch.Tensor:
    """(H, d) float64: Σ w·x over the batch and positions, or Σ w·(x − mean)²."""
    B, H, L, d = x.shape
    BD, BL, TILES = _blocks(d)
    grid = _grid(x, BL * TILES)
    part = torch.empty(*grid, d, dtype=torch.float64, device=x.device)
    _kernels().moment_kernel[grid](
        x, x if w is None else w, x if mean is None else mean, part, *x.stride()[:3], H, L, d,
        HAS_W=w is not None, HAS_MEAN=mean is not None, BD=BD, BL=BL, TILES=TILES,
    )  # fmt: skip
    return _partial_total(part, B, H)


def _normalise(x, shift, inv_std, tau, y, y_tau, norm) -> None:
    """The normalisation kernel: y (and y_tau = τ·y where tau is given) and norm of x."""
    H, L, d = x.shape[1:]
    BD, BL, _ = _blocks(d)
    _kernels().normalise_kernel[_grid(x, BL)](
        x, shift, inv_std, y if tau is None else tau, y, y if y_tau is None else y_tau, norm,
        *x.stride()[:3], H, L, d, HAS_TAU=tau is not None, BD=BD, BL=BL,
    )  # fmt: skip


def normalise(x, shift, inv_std) -> torch.Tensor:
    """y = z/‖z‖ per row, z = shift + x·inv_std ((H, 1, d) each), without a graph (the running
    estimates' path: evaluation, leak-free training)."""
    x = _rows(x)
    H, d = x.shape[1], x.shape[3]
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    shift, inv_std = (t.float().reshape(H, d).contiguous() for t in (shift, inv_std))
    _normalise(x, shift, inv_std, None, y, None, y.new_empty(x.shape[:-1]))
    return y


class TritonStandardiseNormalise(torch.autograd.Function):
    """Pre-SBN with batch statistics (eager_sbn.BatchStandardiseNormalise's maths) on a float32
    or bfloat16 x (B, H, L, d) that ``runs_on`` takes, computed in float32 (y float32; ∂x in
    x's dtype and layout): y = z/‖z‖, z = (x − μ)/σ per (head, channel) over the batch and
    the real positions, times ``tau`` (H, 1, 1) where given. ``w``: (B, L) float32 weights
    of the real positions, or None; ``n``: their count over the ranks. Returns (y or τ·y, μ,
    σ²), μ and σ² (H, 1, d) without gradients. ``reduce``: the all-reduce over ranks of a
    tensor (eager_sbn.all_reduce's, non-differentiable). native_sbn.NativeStandardiseNormalise
    on the GPU."""

    @staticmethod
    def forward(ctx, x, w, n, eps, tau, reduce):
        x = _rows(x)
        mean, var, inv_std, shift = batch_statistics(lambda mu: _moment(x, w, mu), n, eps, reduce)
        buffers = pre_sbn_buffers(x, tau)
        y, y_tau, norm, t = buffers
        _normalise(x, shift, inv_std, t, y, y_tau, norm)
        ctx.reduce = reduce
        return finish_pre_sbn(ctx, x, buffers, inv_std, w, n, mean, var)

    @staticmethod
    @once_differentiable
    def backward(ctx, g, _gmean, _gvar):
        y, norm, inv_std, w, n, t = ctx.saved_tensors
        g = _rows(g)
        B, H, L, d = y.shape
        BD, BL, TILES = _blocks(d)
        grid = _grid(y, BL * TILES)
        part = torch.empty(*grid, 2 * d + 1, dtype=torch.float64, device=y.device)
        kernels = _kernels()
        kernels.backward_sums_kernel[grid](
            y, norm, g, y if t is None else t, part, *g.stride()[:3], H, L, d,
            HAS_TAU=t is not None, BD=BD, BL=BL, TILES=TILES,
        )  # fmt: skip
        total = _partial_total(part, B, H)  # (H, 2d + 1): Σ gz, Σ gz·ẑ, Σ⟨g, y⟩
        sums = torch.stack([total[:, :d], total[:, d : 2 * d]])  # (2, H, d)
        means = (ctx.reduce(sums) / n.double()).float().contiguous()
        gx = grad_input_buffer(ctx, y)
        dtype = gx.dtype
        kernels.backward_apply_kernel[_grid(y, BL)](
            y, norm, g, y if t is None else t, y if w is None else w, means, inv_std, gx,
            *g.stride()[:3], *gx.stride()[:3], H, L, d, HAS_TAU=t is not None,
            HAS_W=w is not None, BF16=dtype == torch.bfloat16, BD=BD, BL=BL,
        )  # fmt: skip
        g_tau = None if t is None else total[:, 2 * d].float().view(H, 1, 1)
        return gx, None, None, None, g_tau, None


class TritonPostSBN(torch.autograd.Function):
    """Post-SBN, sign(y)·|y|^β with y = γ·out (eager_sbn.PostSBN's maths), on a float32 out
    (B, H, L, d) that ``runs_on`` takes, read by its strides; γ and log β (Hg, 1, d), Hg = H
    or 1 (shared). The result is stored in the heads' merged layout ((B, L, H, d) memory, a
    (B, H, L, d) view), which the model's merge of the heads reads without a copy; its
    gradient is read in whatever layout it comes. native_sbn.NativePostSBN on the GPU."""

    @staticmethod
    def forward(ctx, out, gamma, log_beta):
        out = _rows(out)
        gamma_ = gamma.detach().float().contiguous()
        beta = log_beta.detach().exp().float().contiguous()
        B, H, L, d = out.shape
        result = out.new_empty(B, L, H, d).transpose(1, 2)
        log_abs = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        BD, BL, _ = _blocks(d)
        _kernels().post_forward_kernel[_grid(out, BL)](
            out, gamma_, beta, result, log_abs, *out.stride()[:3], *result.stride()[:3],
            H, L, d, SHARED=gamma.shape[0] == 1, INTERPRETED=interpreted(), BD=BD, BL=BL,
        )  # fmt: skip
        ctx.save_for_backward(out, log_abs, gamma, log_beta)
        return result

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        out, log_abs, gamma, log_beta = ctx.saved_tensors
        g = _rows(g)
        B, H, L, d = out.shape
        shared = gamma.shape[0] == 1
        gamma_, beta = gamma.float().contiguous(), log_beta.exp().float().contiguous()
        g_out = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        BD, BL, TILES = _blocks(d)
        grid = _grid(out, BL * TILES)
        part = torch.empty(*grid, 2 * d, dtype=torch.float64, device=out.device)
        _kernels().post_backward_kernel[grid](
            g, out, log_abs, gamma_, beta, g_out, part, *g.stride()[:3], *out.stride()[:3],
            H, L, d, SHARED=shared, INTERPRETED=interpreted(), BD=BD, BL=BL, TILES=TILES,
        )  # fmt: skip
        sums = _partial_total(part, B, H).view(H, 2, d)  # Σ p·out, Σ p·out·log|y|
        if shared:  # one γ and β for all heads: the heads' sums added in order
            sums = sums.sum(0, keepdim=True)
        sums = sums.to(gamma.dtype).transpose(0, 1)[:, :, None]  # (2, Hg, 1, d)
        return (
            g_out,
            sums[0] * beta.to(gamma.dtype),
            sums[1] * (beta * gamma_).to(gamma.dtype),
        )
