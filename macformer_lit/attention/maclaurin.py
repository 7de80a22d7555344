"""Deterministic Maclaurin feature attention: the kernel's series cut at degree 2, exactly
(docs/maths.md §14).

    φ(x) = [√a₀, √a₁·x, √a₂·(x_i x_j)·√w_ij for i ≤ j],  x = q/d^{1/4},  w_ii = 1, w_ij = 2
    φ(q)·φ(k) = a₀ + a₁ s + a₂ s²,  s = q·k/√d

No sampling: the map is exact for its own kernel 1 + s + s²/2 (exp), which is ≥ a₀ − a₁²/(4a₂)
= 1/2 > 0 for every s, so denominators never vanish. Against the full kernel it is the
degree-2 Taylor cut, close where |s| is a few units: after pre-SBN |s| ≤ τ/√d, the regime
where 128 random Maclaurin features already lose to uniform attention
(benchmarks/results/temperature_nmse.md). D' = 1 + d + d(d+1)/2 rows (561 at d = 32), the
symmetric half of x⊗x. ``degree: 1`` keeps [√a₀, √a₁·x] (the first-order baseline).

Two options make it fast (docs/maths.md §14, fast options): ``feature_dtype: bfloat16``
keeps the rows and the two products in bfloat16 (GEMMs that accumulate in float32;
numerator and denominator divided in float32), within a bound of five bfloat16 roundings;
``compile_map: true`` evaluates the map with ``torch.compile`` (one fused loop forward and
one backward instead of d slices; a C++ compiler must be on PATH); ``native_map: true``
evaluates the degree-2 map of CPU tensors with a hand-written kernel (native_map.py: the
same rows bit for bit; forward and backward 0.29x of the compiled map's time,
benchmarks/README.md; built with the C++ compiler on first use); ``native_fused: true``
runs a call's map and both products in one kernel a direction on the CPU, causal calls
chunk by chunk (native_fused.py: the rows never reach memory; in float32 the ListOps step
0.36x eager softmax's, benchmarks/README.md); ``triton_fused: true`` does the same on CUDA tensors
with Triton kernels (triton_fused.py). Tensors that no fused kernel takes get the compiled
map if ``compile_map`` is on (Triton on a GPU), else the eager one.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Literal, get_args

import torch

from .feature_attention import FeatureAttention, KeyFeatures, QueryFeatures
from .kernels import get_kernel
from .native_fused import HEAD_DIMS as FUSED_HEAD_DIMS
from .native_fused import native_causal_products, native_fused_products
from .native_map import MAX_HEAD_DIM, cxx_compiler, library, native_maclaurin_rows
from .pieces import PIECE_BYTES, batch_slices
from .triton_fused import MAX_HEAD_DIM as TRITON_MAX_HEAD_DIM
from .triton_fused import runs_on as triton_runs_on
from .triton_fused import triton_available, triton_causal_products, triton_fused_products

# Bytes of the feature rows of one piece of the batch: a few batch entries at N ~ 1,000.
PIECE_FEATURE_BYTES = 16 << 20

FeatureDtype = Literal["float32", "bfloat16"]
InputMap = Literal["identity", "relu", "sign_split"]
FEATURE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def maclaurin_rows(x, scale, degree: int, out_dtype: torch.dtype):
    """φ rows (..., L, D') of x (..., L, d) in ``out_dtype``, computed in x's dtype."""
    x = x * x.shape[-1] ** -0.25
    parts = [torch.ones_like(x[..., :1]), x]
    if degree == 2:
        # Row i of the upper triangle, x_i·x_{i..d}: slices, whose backward is a sum per
        # slice (an index gather's backward scatters: slower, benchmarks/README.md).
        parts.extend(x[..., i : i + 1] * x[..., i:] for i in range(x.shape[-1]))
    return (torch.cat(parts, -1) * scale).to(out_dtype)


def sign_split(x):
    """[x⁺, x⁻]·2^{1/4} (..., 2d) of x (..., d), x⁻ = max(−x, 0): the map's (2d)^{-1/4} then
    scales it as x's d^{-1/4} does."""
    return torch.cat([torch.relu(x), torch.relu(-x)], -1) * 2**0.25


@functools.cache
def compiled_maclaurin_rows():
    """``maclaurin_rows`` under ``torch.compile`` (dynamic shapes: one graph for every length
    and batch), built on first use."""
    return torch.compile(maclaurin_rows, dynamic=True)


def describe_kernels(**options: Any) -> str:
    """The kernel options in one line: those on, and the rows' dtype."""
    on = [name for name, value in options.items() if value is True]
    return f"{'+'.join(on) or 'eager'}, {options['feature_dtype']}"


def choose_kernels(head_dim: int, degree: int, fused_ok: bool = True) -> dict[str, Any]:
    """The fastest kernels this machine has for the degree-2 map, as measured
    (benchmarks/README.md, "Choosing the kernels"): on a machine with a CUDA GPU and triton,
    the Triton fused kernels; on the CPU, with a C++ compiler, the native map and the native
    fused kernels (head sizes they take); bfloat16 rows and products where the CPU multiplies
    bfloat16 pairs (AVX512-BF16: the fused ListOps step 0.369x eager softmax's against 0.398x
    in float32, 0.661x against 0.781x at N = 1,000, the 2-core AMD EPYC; on AMX tiles where
    the CPU has them, Intel Xeon: see the benchmarks' README) or a GPU takes them, float32
    elsewhere. Degree 1 has no kernels: eager. ``fused_ok: False`` (inputs wider than the values,
    ``input_map: sign_split``) leaves the fused kernels out. Returns the options and ``why``."""
    if degree != 2:
        off = dict(native_map=False, native_fused=False, triton_fused=False)
        return dict(**off, feature_dtype="float32", why="eager (degree 1 has no kernels), float32")
    gpu = (
        fused_ok
        and torch.cuda.is_available()
        and triton_available()
        and head_dim <= TRITON_MAX_HEAD_DIM
    )
    compiler = cxx_compiler()
    native_map = compiler is not None and head_dim <= MAX_HEAD_DIM
    native_fused = fused_ok and compiler is not None and head_dim in FUSED_HEAD_DIMS
    # The fused library answers what the CPU multiplies, whether or not its kernels run.
    fused = library(compiler, "native_fused") if compiler is not None else None
    cpu_bf16 = bool(fused and fused.maclaurin2_bf16_dot())
    amx = bool(cpu_bf16 and fused.maclaurin2_amx(-1))
    bf16 = cpu_bf16 or gpu
    options = dict(native_map=native_map, native_fused=native_fused, triton_fused=gpu)
    reasons = []
    if gpu:
        reasons.append("CUDA GPU with triton")
    reasons.append(
        "CPU with AMX tiles" if amx
        else "CPU with AVX512-BF16" if cpu_bf16
        else "CPU with a C++ compiler" if native_map
        else "CPU without a C++ compiler"
    )  # fmt: skip
    dtype = "bfloat16" if bf16 else "float32"
    why = f"{describe_kernels(**options, feature_dtype=dtype)} ({'; '.join(reasons)})"
    return dict(**options, feature_dtype=dtype, why=why)


class MaclaurinAttention(FeatureAttention):
    # Degree 2 is positive for every registered kernel, degree 1 is not: the denominator
    # policy tests against eps·n, as for signed random features.
    signed_features = True

    def __init__(
        self,
        *,
        head_dim: int,
        num_heads: int,
        kernel: str = "exp",
        degree: Literal[1, 2] = 2,
        bounded_inputs: bool = False,
        feature_dtype: FeatureDtype = "float32",
        compile_map: bool = False,
        native_map: bool = False,
        native_fused: bool = False,
        triton_fused: bool = False,
        auto_kernels: bool = False,
        input_map: InputMap = "identity",
        **common: Any,
    ) -> None:
        """``feature_dtype``: the dtype of the feature rows and of the two products (the
        map itself and the division compute in float32; float64 models stay float64).
        ``compile_map``: evaluate the map with ``torch.compile`` (needs a C++ compiler).
        ``native_map``: evaluate the degree-2 map of CPU tensors with the hand-written
        kernel of native_map.py (needs a C++ compiler). ``native_fused``: every call on
        CPU float32 tensors runs the map and both products in one native kernel a
        direction, causal calls chunk by chunk (native_fused.py: the rows never reach memory; with
        ``feature_dtype: bfloat16`` the products' inputs are rounded to bfloat16 and
        multiplied by the CPU's bfloat16 dot products; head_dim 16, 32, 48 or 64).
        ``triton_fused``: the same on CUDA float32 tensors with Triton kernels
        (triton_fused.py; head_dim up to 64; a machine with a GPU needs the ``triton``
        package; CPU tensors are left to ``native_fused``). ``auto_kernels``: the four
        kernel options and ``feature_dtype`` chosen by this machine (``choose_kernels``),
        the choice in ``kernel_choice`` and in the run's provenance. ``input_map: relu``:
        q and k pass through max(·, 0) before the map (after pre-SBN where it wraps this
        backend), so s = q⁺·k⁺/√d ≥ 0, where the kernel a₀ + a₁s + a₂s² only grows with s:
        with signed inputs the parabola weights an anti-aligned key (s ≪ −1) about as much
        as an aligned one (docs/maths.md §14, non-negative inputs). ``input_map:
        sign_split``: q and k become [q⁺, q⁻]·2^{1/4} (2·head_dim entries) before the map, so
        s = (q⁺·k⁺ + q⁻·k⁻)/√d ≥ 0: the same monotone kernel, which keeps both signs' information
        (an entry counts where q and k agree in sign); 1 + 2d + d(2d+1) features, and the
        fused kernels (whose values share the keys' width) do not take it (docs/maths.md §14,
        sign-split inputs)."""
        super().__init__(head_dim=head_dim, num_heads=num_heads, **common)
        if input_map not in get_args(InputMap):
            valid = ", ".join(get_args(InputMap))
            raise ValueError(f"input_map must be one of {valid}; got {input_map!r}")
        # The width the map takes: sign_split doubles it.
        map_dim = 2 * head_dim if input_map == "sign_split" else head_dim
        if input_map == "sign_split":
            for option, on in (("native_fused", native_fused), ("triton_fused", triton_fused)):
                if on:
                    raise ValueError(
                        f"{option}: true fuses values as wide as the keys; input_map: "
                        f"sign_split makes the keys twice as wide as the values: set "
                        f"{option}: false (native_map: true is the fast path it takes)"
                    )
        if auto_kernels:
            asked = [
                name
                for name, on in (
                    ("compile_map", compile_map),
                    ("native_map", native_map),
                    ("native_fused", native_fused),
                    ("triton_fused", triton_fused),
                    ("feature_dtype: bfloat16", feature_dtype != "float32"),
                )
                if on
            ]
            if asked:
                raise ValueError(
                    f"auto_kernels: true chooses the kernels and feature_dtype by the machine; "
                    f"this config also sets {', '.join(asked)}: drop it, or set "
                    "auto_kernels: false"
                )
            choice = choose_kernels(map_dim, degree, fused_ok=input_map != "sign_split")
            native_map, native_fused = choice["native_map"], choice["native_fused"]
            triton_fused, feature_dtype = choice["triton_fused"], choice["feature_dtype"]
            self.kernel_choice = "auto: " + choice["why"]
        else:
            self.kernel_choice = describe_kernels(
                compile_map=compile_map,
                native_map=native_map,
                native_fused=native_fused,
                triton_fused=triton_fused,
                feature_dtype=feature_dtype,
            )
        self.auto_kernels = auto_kernels
        self.input_map, self.map_dim = input_map, map_dim
        if degree not in (1, 2):
            raise ValueError(f"degree must be 1 or 2 (d^degree features); got {degree!r}")
        if feature_dtype not in FEATURE_DTYPES:
            valid = ", ".join(get_args(FeatureDtype))
            raise ValueError(f"feature_dtype must be one of {valid}; got {feature_dtype!r}")
        for option, on, why in (
            ("compile_map", compile_map, "torch.compile"),
            ("native_map", native_map, "the native map"),
            ("native_fused", native_fused, "the fused kernel"),
        ):
            if on and cxx_compiler() is None:
                raise ValueError(
                    f"{option}: true needs a C++ compiler on PATH for {why} (g++, clang++ "
                    f"or $CXX): install one, or set {option}: false"
                )
        if native_map and degree != 2:
            raise ValueError(
                "native_map: true is the degree-2 map's kernel; degree 1's map is a "
                "concatenation with nothing to speed up: set native_map: false"
            )
        if native_map and map_dim > MAX_HEAD_DIM:
            raise ValueError(
                f"native_map: true takes head_dim ≤ {MAX_HEAD_DIM} (≤ {MAX_HEAD_DIM // 2} with "
                f"input_map: sign_split); got {map_dim} map inputs: set native_map: false"
            )
        if native_fused and degree != 2:
            raise ValueError(
                "native_fused: true is the degree-2 map's fused kernel: set native_fused: false"
            )
        if triton_fused and degree != 2:
            raise ValueError(
                "triton_fused: true is the degree-2 map's fused kernel: set triton_fused: false"
            )
        if triton_fused and head_dim > TRITON_MAX_HEAD_DIM:
            raise ValueError(
                f"triton_fused: true takes head_dim ≤ {TRITON_MAX_HEAD_DIM}; got {head_dim}: "
                "set triton_fused: false"
            )
        if triton_fused and torch.cuda.is_available() and not triton_available():
            raise ValueError(
                "triton_fused: true needs the triton package for this machine's GPU (CUDA "
                "builds of torch bring it; else pip install triton): install it, or set "
                "triton_fused: false"
            )
        if native_fused and head_dim not in FUSED_HEAD_DIMS:
            sizes = ", ".join(map(str, FUSED_HEAD_DIMS))
            raise ValueError(
                f"native_fused: true takes head_dim {sizes}; got {head_dim}: "
                "set native_fused: false"
            )
        # The compiler found once; the library built now, so a compiler that fails says so
        # before training.
        self._compiler = cxx_compiler() if native_map or native_fused else None
        for option, on in (("native_map", native_map), ("native_fused", native_fused)):
            if on:
                library(self._compiler, option)
        self.feature_dtype, self.compile_map = feature_dtype, compile_map
        self.native_map, self.native_fused = native_map, native_fused
        self.triton_fused = triton_fused
        self.kernel = get_kernel(kernel, bounded_inputs=bounded_inputs)
        self.target_kernel, self.degree = kernel, degree
        self.own_kernel = self.kernel.series(degree)  # exact for these features
        a = [self.kernel.coefficient(n) for n in range(degree + 1)]
        rows, cols = torch.triu_indices(map_dim, map_dim)  # row-major: the slices' order
        weight = torch.where(rows == cols, 1.0, 2.0).double()
        scale = torch.cat(
            [torch.tensor([math.sqrt(a[0])]), torch.full((map_dim,), math.sqrt(a[1]))]
            + ([torch.sqrt(a[2] * weight)] if degree == 2 else [])
        )
        self.register_buffer("_scale", scale.float(), persistent=False)
        self._coefficients = tuple(a)  # the Triton kernels' (a0, a1, a2)
        self.num_features = scale.numel()

    def extra_repr(self) -> str:
        return (
            f"kernel={self.kernel.name}, degree={self.degree}, features={self.num_features}, "
            f"feature_dtype={self.feature_dtype}, compile_map={self.compile_map}, "
            f"native_map={self.native_map}, native_fused={self.native_fused}, "
            f"triton_fused={self.triton_fused}, auto_kernels={self.auto_kernels}, "
            f"input_map={self.input_map}"
        )

    def kernel_inputs(self, q, k):
        """(q, k) through ``input_map``: max(·, 0) of each for ``relu``; [x⁺, x⁻]·2^{1/4} of
        each for ``sign_split`` (the map divides by (2d)^{1/4}, so s = (q⁺·k⁺ + q⁻·k⁻)/√d,
        bounded as q·k/√d is: |[x⁺, x⁻]| = |x|)."""
        if self.input_map == "relu":
            return torch.relu(q), torch.relu(k)
        if self.input_map == "sign_split":
            return sign_split(q), sign_split(k)
        return q, k

    def reference_features(self, q, k, key_padding_mask):
        return super().reference_features(*self.kernel_inputs(q, k), key_padding_mask)

    def step(self, q, k, v, state=None):
        return super().step(*self.kernel_inputs(q, k), v, state)

    def diagnose(self, q, k, v, *, key_padding_mask=None, causal=False) -> dict[str, float]:
        q, k = self.kernel_inputs(q, k)
        return super().diagnose(q, k, v, key_padding_mask=key_padding_mask, causal=causal)

    def _rows_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The rows' dtype for a map computed in ``dtype``: ``feature_dtype`` in place of
        float32; wider (a float64 model, the float64 references) stays as it is."""
        return FEATURE_DTYPES[self.feature_dtype] if dtype == torch.float32 else dtype

    def _map(self, x, keys: bool = False):
        """φ rows (B, H, ..., D', L) of x (B, H, ..., L, d); x is float32 or float64 (the
        attention computes in ``promote_types(dtype, float32)``). ``keys``: the native map
        stores them (D', L) contiguous, the operand layout of φ(k)ᵀ[v, 1]'s GEMM."""
        if x.dtype == torch.float64:  # float64 models and the references: the eager map
            rows = maclaurin_rows
        elif self.native_map and x.device.type == "cpu" and not torch.compiler.is_compiling():
            # (Under torch.compile inductor fuses the map itself: ctypes calls would break
            # the graph.)
            dtype = self._rows_dtype(x.dtype)
            phi = native_maclaurin_rows(x, self._scale, dtype, self._compiler, keys)
            return phi.transpose(-1, -2)
        elif self.compile_map:
            rows = compiled_maclaurin_rows()
        else:
            rows = maclaurin_rows
        phi = rows(x, self._scale.to(x.dtype), self.degree, self._rows_dtype(x.dtype))
        return phi.transpose(-1, -2)

    def _fused_kernel(self, x) -> str | None:
        """Which fused kernel a call on x takes, if any: ``triton_fused`` on a CUDA tensor (or
        a CPU one under Triton's interpreter); else ``native_fused`` on a CPU tensor; either
        bidirectional or causal; computed in float32 (not float64), not under torch.compile
        (a kernel call outside the graph would break it)."""
        if (
            torch.promote_types(x.dtype, torch.float32) != torch.float32
            or torch.compiler.is_compiling()
        ):
            return None
        if self.triton_fused and triton_runs_on(x):
            return "triton"
        if self.native_fused and x.device.type == "cpu":
            return "native"
        return None

    def _keys_masked(self, q) -> bool:
        """The fused kernels weight φ(k_l) by [v_l, 1] alone (zero at a padded key, and so is
        ∂k_l = J_φ(k_l)ᵀ(∂S [v_l, 1])): k's copy with padded keys zeroed is not needed. The
        unfused path builds every key's row and keeps them: zeroed as before."""
        return self._fused_kernel(q) is None

    def _bidirectional(self, q, k, v1, mask):
        kernel, bf16 = self._fused_kernel(q), self.feature_dtype == "bfloat16"
        if kernel == "triton":
            return triton_fused_products(q, k, v1, self._coefficients, bf16), None
        if kernel == "native":
            return native_fused_products(q, k, v1, self._scale, self._compiler, bf16), None
        return super()._bidirectional(q, k, v1, mask)

    def _causal(self, q, k, v1, mask):
        kernel, bf16 = self._fused_kernel(q), self.feature_dtype == "bfloat16"
        coef, chunk = self._coefficients, self.chunk_size
        if kernel == "triton":
            return triton_causal_products(q, k, v1, coef, chunk, bf16), None
        if kernel == "native":
            products = native_causal_products(
                q, k, v1, self._scale, coef, chunk, self._compiler, bf16
            )
            return products, None
        return super()._causal(q, k, v1, mask)

    def _key_features(self, k, keep, floor):
        return KeyFeatures(self._map(k, keys=True), None)

    def _query_features(self, q, ref):
        return QueryFeatures(self._map(q), None)

    def attend_now(self, q, k, v, key_padding_mask, causal):
        """Over the batch in pieces on the CPU (``pieces.batch_slices``): the feature rows of
        the whole batch are hundreds of MB, each a fresh mmap; a few entries at a time stay
        on the heap (docs/pitfalls.md §2). The batch
        entries are independent, so the result is the same; statistics are collected in
        one piece. ``split``, not slicing: its backward is one concatenation, where each
        slice's backward writes a zero tensor of the whole batch (docs/pitfalls.md §2)."""
        q, k = self.kernel_inputs(q, k)
        rows = self._rows_dtype(torch.promote_types(q.dtype, torch.float32))
        entry = q[:1].numel() // q.shape[-1] * self.num_features * rows.itemsize
        slices = batch_slices(q, max(1, entry * PIECE_BYTES // PIECE_FEATURE_BYTES))
        # The fused kernels keep no feature rows: a bidirectional call's whole batch at once.
        if len(slices) == 1 or self.collect_stats or (not causal and self._fused_kernel(q)):
            return super().attend_now(q, k, v, key_padding_mask, causal)
        step = slices[0].stop
        masks = [None] * len(slices) if key_padding_mask is None else key_padding_mask.split(step)
        parts = [
            super(MaclaurinAttention, self).attend_now(qs, ks, vs, ms, causal)
            for qs, ks, vs, ms in zip(q.split(step), k.split(step), v.split(step), masks)
        ]
        return torch.cat(parts)
