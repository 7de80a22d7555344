"""ppSBN's passes as native CPU loops (``native_sbn: true``; csrc/ppsbn.cpp, docs/maths.md §10.5).

Pre-SBN with batch statistics and post-SBN's signed power are elementwise work over tensors
the size of q, k and the output: eager, each is 7 to 12 ATen passes, most of them writing a
temporary (at the ListOps preset a 16 MB tensor a pass). Here:

    pre-SBN forward   two passes for the moments (Σ w·x, then Σ w·(x − μ)²), one writing
                      y = z/‖z‖ with z = (x − μ)/σ (and τ·y for the queries: the temperature
                      folded in)
    pre-SBN backward  one pass for the two per-channel sums of the batch-norm backward (and
                      τ's gradient), one writing ∂x
    post-SBN          one pass forward (y·exp((β − 1)·log|y|), log|y| kept), one backward

The DDP all-reduces of the moments and of the backward's sums run between the passes, as
in the eager functions (ppsbn.py), whose maths these are. Sums accumulate in float64 a
(batch entry, head) at a time and then over the batch in order: the same bits on any thread
count. exp and log are Cephes' float32 polynomials (within 2 ulp), written so that the
loops vectorise. float32 CPU tensors (and bfloat16 q and k, read without a cast by
pre-SBN's pass): anything else (float64, CUDA, torch.compile's tracing) takes the eager
functions.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .native_map import library


def runs_natively(x: torch.Tensor, bf16: bool = False) -> bool:
    """Whether ``native_sbn`` takes x: a float32 CPU tensor (or bfloat16 where ``bf16``: pre-SBN
    reads bfloat16 q and k as they come from autocast's projections, without a cast), outside
    torch.compile's tracing."""
    dtypes = (torch.float32, torch.bfloat16) if bf16 else (torch.float32,)
    return x.device.type == "cpu" and x.dtype in dtypes and not torch.compiler.is_compiling()


def _dims(x: torch.Tensor, *flag: int):
    """(B, H, L, d, *flag, threads): the kernels' trailing arguments for x (B, H, L, d),
    ``flag`` the kernel's switch between its sizes and its thread count (bfloat16 input,
    or post-SBN's shared γ)."""
    return (*x.shape, *flag, torch.get_num_threads())


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x itself where its rows are contiguous (the kernels read any (B, H, L) strides: q
    and k come as transposed views of the (B, L, H, d) projections), else a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    """(sb, sh, sl): the element strides of x's rows, (B, H, L, d) with d contiguous."""
    return x.stride()[:3]


def _dense(x: torch.Tensor) -> bool:
    """Whether x's elements fill its storage span exactly once, in some order of its dims
    (then a tensor with its strides can be allocated, and x's view takes it as it is)."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(x.stride(), x.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _bf16(x: torch.Tensor) -> int:
    return int(x.dtype == torch.bfloat16)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _moment(lib, x, w, mean) -> torch.Tensor:
    """(H, d) float64: Σ w·x over the batch and positions, or Σ w·(x − mean)²."""
    out = torch.empty(x.shape[1], x.shape[3], dtype=torch.float64)
    lib.sbn_moment(
        x.data_ptr(), _ptr(w), _ptr(mean), out.data_ptr(), *_strides(x), *_dims(x, _bf16(x))
    )
    return out


def batch_statistics(moment, n, eps, reduce):
    """(μ, σ², 1/σ, −μ/σ), (H, d) float32 each, from ``moment(mean)``: the (H, d) float64
    Σ w·x (mean None) or Σ w·(x − mean)² of this rank, all-reduced by ``reduce`` and divided
    by the count ``n`` over the ranks. Pre-SBN's forward head, here and in triton_sbn.py."""
    nd = n.double()
    mean = (reduce(moment(None)) / nd).float()
    var = (reduce(moment(mean)) / nd).float()
    inv_std = torch.rsqrt(var + eps)
    return mean, var, inv_std, -mean * inv_std


def pre_sbn_buffers(x, tau):
    """(y, τ·y or None, ‖z‖, τ as (H,) float32 or None): what the normalisation pass writes
    for x (B, H, L, d), y contiguous float32 whatever x's layout and dtype."""
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    y_tau = None if tau is None else torch.empty_like(y)
    t = None if tau is None else tau.detach().float().reshape(x.shape[1]).contiguous()
    return y, y_tau, y.new_empty(x.shape[:-1]), t


def finish_pre_sbn(ctx, x, buffers, inv_std, w, n, mean, var):
    """Pre-SBN's forward tail: keep what the backward reads (y, ‖z‖, 1/σ, w, n, τ and x's
    layout) and return (y or τ·y, μ, σ²), μ and σ² (H, 1, d) without gradients."""
    y, y_tau, norm, t = buffers
    ctx.save_for_backward(y, norm, inv_std, w, n, t)
    ctx.x_meta = (x.shape, x.stride(), x.dtype, _dense(x))
    mean, var = mean[:, None], var[:, None]
    ctx.mark_non_differentiable(mean, var)
    return (y if y_tau is None else y_tau), mean, var


def grad_input_buffer(ctx, y):
    """∂x's buffer: in x's layout where x was dense (the projections' transposed view takes
    it back without a copy), else contiguous; x's dtype, on y's device."""
    shape, stride, dtype, dense = ctx.x_meta
    if dense:
        return torch.empty_strided(shape, stride, dtype=dtype, device=y.device)
    return y.new_empty(shape, dtype=dtype)


def normalise(x, shift, inv_std, compiler: str) -> torch.Tensor:
    """y = z/‖z‖ per row, z = shift + x·inv_std ((H, 1, d) each), without a graph (the
    running estimates' path: evaluation, leak-free training)."""
    x = _rows(x)
    y = torch.empty(x.shape, dtype=torch.float32)
    shift, inv_std = shift.float().contiguous(), inv_std.float().contiguous()
    library(compiler).sbn_normalise(
        x.data_ptr(), shift.data_ptr(), inv_std.data_ptr(), None, y.data_ptr(), None, None,
        *_strides(x), *_dims(x, _bf16(x)),
    )  # fmt: skip
    return y


class NativeStandardiseNormalise(torch.autograd.Function):
    """Pre-SBN with batch statistics (eager_sbn.BatchStandardiseNormalise's maths) on a float32
    or bfloat16 CPU x (B, H, L, d), computed in float32 (y float32; ∂x in x's dtype, rounded
    as a cast of the float32 gradient would be): y = z/‖z‖, z = (x − μ)/σ per (head,
    channel) over the batch and the real positions, times ``tau`` (H, 1, 1) where given.
    ``w``: (B, L) float32 weights of the real positions, or None; ``n``: their count over
    the ranks. Returns (y or τ·y, μ, σ²), μ and σ² (H, 1, d) without gradients.
    ``reduce``: the all-reduce over ranks of a tensor (eager_sbn.all_reduce's,
    non-differentiable)."""

    @staticmethod
    def forward(ctx, x, w, n, eps, tau, compiler, reduce):
        lib, x = library(compiler), _rows(x)
        mean, var, inv_std, shift = batch_statistics(
            lambda mu: _moment(lib, x, w, mu), n, eps, reduce
        )
        buffers = pre_sbn_buffers(x, tau)
        y, y_tau, norm, t = buffers
        lib.sbn_normalise(
            x.data_ptr(), shift.data_ptr(), inv_std.data_ptr(), _ptr(t), y.data_ptr(),
            _ptr(y_tau), norm.data_ptr(), *_strides(x), *_dims(x, _bf16(x)),
        )  # fmt: skip
        ctx.compiler, ctx.reduce = compiler, reduce
        return finish_pre_sbn(ctx, x, buffers, inv_std, w, n, mean, var)

    @staticmethod
    @once_differentiable
    def backward(ctx, g, _gmean, _gvar):
        y, norm, inv_std, w, n, t = ctx.saved_tensors
        lib, g = library(ctx.compiler), g.contiguous()
        H, d = y.shape[1], y.shape[3]
        sums = torch.empty(2, H, d, dtype=torch.float64)
        g_tau = torch.empty(H, dtype=torch.float64) if t is not None else None
        lib.sbn_backward_sums(
            y.data_ptr(), norm.data_ptr(), g.data_ptr(), _ptr(t), sums.data_ptr(),
            _ptr(g_tau), *_dims(y),
        )  # fmt: skip
        means = (ctx.reduce(sums) / n.double()).float()  # (2, H, d): Σ gz/n, Σ gz·ẑ/n
        gx = grad_input_buffer(ctx, y)
        lib.sbn_backward_apply(
            y.data_ptr(), norm.data_ptr(), g.data_ptr(), _ptr(t), _ptr(w), means[0].data_ptr(),
            means[1].data_ptr(), inv_std.data_ptr(), gx.data_ptr(), *_strides(gx),
            *_dims(gx, _bf16(gx)),
        )  # fmt: skip
        g_tau = None if g_tau is None else g_tau.float().view(H, 1, 1)
        return gx, None, None, None, g_tau, None, None


class NativePostSBN(torch.autograd.Function):
    """Post-SBN, sign(y)·|y|^β with y = γ·out (eager_sbn.PostSBN's maths), on a float32 CPU
    out (B, H, L, d); γ and log β (Hg, 1, d), Hg = H or 1 (shared). The result is stored in
    the heads' merged layout ((B, L, H, d) memory, a (B, H, L, d) view), which the model's
    merge of the heads reads without a copy; its gradient is read in whatever layout it
    comes."""

    @staticmethod
    def forward(ctx, out, gamma, log_beta, compiler):
        lib, out = library(compiler), out.contiguous()
        gamma_ = gamma.detach().float().contiguous()
        beta = log_beta.detach().exp().float().contiguous()
        B, H, L, d = out.shape
        result = out.new_empty(B, L, H, d).transpose(1, 2)
        log_abs = torch.empty_like(out)
        shared = int(gamma.shape[0] == 1)
        lib.post_sbn_forward(
            out.data_ptr(), gamma_.data_ptr(), beta.data_ptr(), result.data_ptr(),
            log_abs.data_ptr(), *_strides(result), *_dims(out, shared),
        )  # fmt: skip
        ctx.save_for_backward(out, log_abs, gamma, log_beta)
        ctx.compiler = compiler
        return result

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        out, log_abs, gamma, log_beta = ctx.saved_tensors
        lib, g = library(ctx.compiler), _rows(g)
        Hg, d = gamma.shape[0], out.shape[3]
        gamma_, beta = gamma.float().contiguous(), log_beta.exp().float().contiguous()
        g_out, sums = torch.empty_like(out), torch.empty(2, Hg, d, dtype=torch.float64)
        lib.post_sbn_backward(
            g.data_ptr(), out.data_ptr(), log_abs.data_ptr(), gamma_.data_ptr(),
            beta.data_ptr(), g_out.data_ptr(), sums.data_ptr(), *_strides(g),
            *_dims(out, int(Hg == 1)),
        )  # fmt: skip
        sums = sums.to(gamma.dtype)[:, :, None]  # (2, Hg, 1, d)
        return (
            g_out,
            sums[0] * beta.to(gamma.dtype),
            sums[1] * (beta * gamma_).to(gamma.dtype),
            None,
        )
