"""The degree-2 Maclaurin map and its backward as a hand-written CPU kernel (docs/maths.md §14).

    φ(x) = [s₀, s₁·x̂, s₂ᵢⱼ·x̂ᵢx̂ⱼ for i ≤ j],  x̂ = x·d^{-1/4}          (forward)
    ∂x_a = d^{-1/4}·(s₁·g₁ₐ + Σ_{b≥a} s₂ₐᵦ·g₂ₐᵦ·x̂ᵦ + Σ_{b≤a} s₂ᵦₐ·g₂ᵦₐ·x̂ᵦ)   (backward)

The eager map is d slice products and a concatenation, and its backward d sums; under
torch.compile, inductor's loop over the slices ran far below memory bandwidth
(benchmarks/README.md, fast options). Here each row is one loop over its D' outputs, the
rows split over ``torch.get_num_threads()`` threads, and the compiler vectorises the loops
(``-O3 -march=native``). Built with OpenMP where the compiler has it, the threads are the
OpenMP threads torch's operators use (the library links the runtime torch has loaded):
otherwise they spin for a while after each operator and take the cores from the kernels'.
The forward computes in float32 in the eager map's order and rounds to bfloat16 to nearest
even as torch does: the rows are the eager map's, bit for bit.
The backward sums in another order than autograd's (float32 rounding apart); a gradient
stored feature-major, as the product φ(k)ᵀ[v, 1] returns φ(k)'s, is read in place by a
second backward that puts consecutive rows side by side in the vector lanes.

The C++ sources (csrc/: the map in maclaurin2.h and maclaurin2_map.cpp, the fused products
of native_fused.py in maclaurin2_fused.cpp with its bfloat16 and AMX parts, ppSBN's passes
of native_sbn.py in ppsbn.cpp) have no torch headers: they build with the
system's C++ compiler in a few seconds into one library in a cache folder
(``$MACFORMER_LIT_CACHE``, else ``$XDG_CACHE_HOME/macformer_lit``, else
``~/.cache/macformer_lit``), once per source, compiler and CPU, loaded with ctypes.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
# The sources of the library: the map (maclaurin2.h, maclaurin2_map.cpp), the fused
# attention's products (maclaurin2_fused.cpp and the two parts it includes, native_fused.py)
# and ppSBN's passes (ppsbn.cpp, native_sbn.py).
SOURCES = (
    "maclaurin2.h",
    "maclaurin2_map.cpp",
    "maclaurin2_fused.cpp",
    "maclaurin2_fused_bf16.h",
    "maclaurin2_fused_amx.h",
    "ppsbn.cpp",
)

# -ffp-contract=fast: the fused products' a·b + c as one FMA (the map's forward multiplies
# only, so its rows are the same bits either way).
FLAGS = [
    "-O3", "-march=native", "-ffp-contract=fast", "-shared", "-fPIC", "-std=c++17", "-pthread"
]  # fmt: skip
# Tried first: OpenMP, so that the kernels run on torch's own OpenMP threads
# (maclaurin2.h, parallel_rows); a compiler without it builds without (std::threads).
OPENMP = ["-fopenmp"]
MAX_HEAD_DIM = 1024


def cxx_compiler() -> str | None:
    """The C++ compiler torch.compile's inductor would find (``$CXX``, else g++, clang++, c++)."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "clang++", "c++"]
    return next((path for name in names if (path := shutil.which(name))), None)


def cache_dir() -> Path:
    """Where the built library lives: ``$MACFORMER_LIT_CACHE``, else the XDG cache."""
    if os.environ.get("MACFORMER_LIT_CACHE"):
        return Path(os.environ["MACFORMER_LIT_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "macformer_lit"


def _cpu_flags() -> str:
    """The CPU's feature flags (``-march=native`` builds for them): part of the cache key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def source_text() -> str:
    """The library's sources, concatenated: what its cache key hashes."""
    return "\0".join((CSRC / name).read_text() for name in SOURCES)


def library(compiler: str, option: str = "native_map") -> ctypes.CDLL:
    """The kernel library, built on first use (once per source, compiler and CPU); a build
    that cannot happen is refused in one line naming ``option``, the switch that asked."""
    try:
        return _library(compiler)
    except _BuildError as err:
        raise ValueError(f"{option}: true: {err}: set {option}: false") from None


class _BuildError(Exception):
    pass


@functools.cache
def _library(compiler: str) -> ctypes.CDLL:
    key = hashlib.sha256(
        "\0".join([source_text(), compiler, " ".join(FLAGS + OPENMP), _cpu_flags()]).encode()
    ).hexdigest()[:16]
    path = cache_dir() / f"maclaurin_map_{key}.so"
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = tempfile.TemporaryDirectory(dir=path.parent)
        except OSError as err:
            raise _BuildError(
                f"cannot write the kernel's cache folder {path.parent} ({err.strerror}); "
                "point $MACFORMER_LIT_CACHE at a writable folder"
            ) from None
        with tmp:
            lib = Path(tmp.name) / "map.so"
            units = [str(CSRC / name) for name in SOURCES if name.endswith(".cpp")]
            for extra in (OPENMP, []):
                done = subprocess.run(
                    [compiler, *FLAGS, *extra, *units, "-o", str(lib)],
                    capture_output=True,
                    text=True,
                )
                if done.returncode == 0:
                    break
            if done.returncode != 0:
                errors = [line for line in done.stderr.splitlines() if "error" in line]
                first = (errors or done.stderr.splitlines() or ["no message"])[0].strip()
                raise _BuildError(f"{compiler} could not build the kernel ({first})")
            os.replace(lib, path)  # atomic: processes building at once each land a whole file
    lib = ctypes.CDLL(str(path))
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    signatures = {
        "maclaurin2_forward": [ptr] * 3 + [i64] + [i32] * 3,
        "maclaurin2_forward_lanes": [ptr] * 3 + [i64, i64] + [i32] * 3,
        "maclaurin2_backward": [ptr] * 4 + [i64] + [i32] * 3,
        "maclaurin2_backward_lanes": [ptr] * 4 + [i64, i64] + [i32] * 3,
        "maclaurin2_state": [ptr] * 4 + [i64, i64] + [i32] * 3,
        "maclaurin2_apply": [ptr] * 4 + [i64, i64] + [i32] * 3,
        "maclaurin2_pullback": [ptr] * 5 + [i64, i64] + [i32] * 3,
        "maclaurin2_bf16_dot": [],
        "maclaurin2_amx": [i32],
        "maclaurin2_openmp": [],
        "sbn_moment": [ptr] * 4 + [i64] * 6 + [i32] * 3,
        "sbn_normalise": [ptr] * 7 + [i64] * 6 + [i32] * 3,
        "sbn_backward_sums": [ptr] * 6 + [i64] * 3 + [i32] * 2,
        "sbn_backward_apply": [ptr] * 9 + [i64] * 6 + [i32] * 3,
        "post_sbn_forward": [ptr] * 5 + [i64] * 6 + [i32] * 3,
        "post_sbn_backward": [ptr] * 7 + [i64] * 6 + [i32] * 3,
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
    return lib


def _check(code: int) -> None:
    if code != 0:
        raise ValueError(f"the native Maclaurin map takes head_dim ≤ {MAX_HEAD_DIM}")


class NativeMaclaurinMap(torch.autograd.Function):
    """φ rows (..., L, D') of x (..., L, d) float32 on the CPU, in ``out_dtype`` (float32 or
    bfloat16); ``scale`` (D',) float32. The gradient reaches x only (the scale is a
    constant buffer)."""

    @staticmethod
    def forward(ctx, x, scale, out_dtype, compiler, feature_major):
        x = x.contiguous()
        d, L = x.shape[-1], x.shape[-2]
        D = 1 + d + d * (d + 1) // 2
        lib, threads = library(compiler), torch.get_num_threads()
        bf16 = int(out_dtype == torch.bfloat16)
        if feature_major:
            out = torch.empty(*x.shape[:-2], D, L, dtype=out_dtype)
            forward, shape = lib.maclaurin2_forward_lanes, (x.numel() // (d * L), L)
        else:
            out = torch.empty(*x.shape[:-1], D, dtype=out_dtype)
            forward, shape = lib.maclaurin2_forward, (x.numel() // d,)
        _check(forward(x.data_ptr(), scale.data_ptr(), out.data_ptr(), *shape, d, bf16, threads))
        ctx.save_for_backward(x, scale)
        ctx.compiler = compiler
        # (..., L, D') either way: a feature-major result is the transpose of its storage.
        return out.transpose(-1, -2) if feature_major else out

    @staticmethod
    def backward(ctx, g):
        x, scale = ctx.saved_tensors
        d, L = x.shape[-1], x.shape[-2]
        lib, threads = library(ctx.compiler), torch.get_num_threads()
        bf16 = int(g.dtype == torch.bfloat16)
        gx = torch.empty_like(x)
        if g.transpose(-1, -2).is_contiguous() and not g.is_contiguous():
            # Feature-major, as φ(k)ᵀ[v, 1]'s backward leaves it: read in place.
            backward, shape = lib.maclaurin2_backward_lanes, (x.numel() // (d * L), L)
        else:
            g, backward, shape = g.contiguous(), lib.maclaurin2_backward, (x.numel() // d,)
        pointers = (g.data_ptr(), x.data_ptr(), scale.data_ptr(), gx.data_ptr())
        _check(backward(*pointers, *shape, d, bf16, threads))
        return gx, None, None, None, None


def native_maclaurin_rows(
    x, scale, out_dtype: torch.dtype, compiler: str, feature_major: bool = False
) -> torch.Tensor:
    """The degree-2 rows (..., L, D') of ``maclaurin.maclaurin_rows`` from the native kernel;
    ``feature_major``: stored (..., D', L) contiguous (the result is that storage's transpose),
    as φ(k)ᵀ[v, 1] reads φ(k) fastest."""
    scale = scale.float().contiguous()
    return NativeMaclaurinMap.apply(x, scale, out_dtype, compiler, feature_major)
