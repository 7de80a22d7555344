"""ppSBN's passes as Triton kernels (``triton_sbn: true``, attention/triton_sbn.py): their
numbers (triton_sbn_interpreted.py) in a process of their own, under Triton's interpreter
where no GPU is; every kernel compiled for CUDA without a GPU; the option's refusals in one
line, its company with ``native_sbn``, and its choice under ``auto_kernels``. Skipped where
the triton package (or its CUDA assembler) is missing."""

from __future__ import annotations

import os

import pytest
import torch
from native_support import needs_cxx
from test_triton_fused import _has_ptxas, compile_for_cuda, run_interpreted

from macformer_lit.attention import build_attention
from macformer_lit.attention import maclaurin as maclaurin_module
from macformer_lit.attention import ppsbn as ppsbn_module
from macformer_lit.attention.ppsbn import PPSBNAttention
from macformer_lit.attention.triton_fused import triton_available

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not triton_available(), reason="no triton package")


@needs_triton
def test_the_kernels_numbers_in_their_own_process():
    """triton_sbn_interpreted.py in a fresh process: under Triton's interpreter where no GPU
    is (it must be on before triton.language is imported, which this process may have done
    already), on the GPU where one is."""
    run_interpreted("triton_sbn_interpreted.py")


def test_refused_without_either_half():
    """The spec says so first; the wrapper built by hand says it too."""
    with pytest.raises(ValueError, match="triton_sbn act on pre-SBN and post-SBN") as err:
        build_attention("softmax", head_dim=16, num_heads=2, triton_sbn=True)
    assert "\n" not in str(err.value)
    inner = build_attention("softmax", head_dim=16, num_heads=2)
    with pytest.raises(ValueError, match="triton_sbn acts on pre-SBN and post-SBN"):
        PPSBNAttention(inner, head_dim=16, num_heads=2, triton_sbn=True)


def test_refused_on_a_gpu_machine_without_the_triton_package(monkeypatch):
    """A machine with a GPU and no triton is told before anything is built; on a CPU-only
    machine the option is inert (no CUDA tensors to take), as triton_fused is."""
    monkeypatch.setattr(ppsbn_module, "triton_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    spec = dict(name="softmax", pre_sbn=True, triton_sbn=True)
    with pytest.raises(ValueError, match="triton_sbn: true needs the triton package") as err:
        build_attention(spec, head_dim=16, num_heads=2)
    assert "\n" not in str(err.value) and "install triton" in str(err.value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert build_attention(spec, head_dim=16, num_heads=2).triton_sbn


@needs_cxx
def test_with_native_sbn_each_takes_its_own_devices_tensors():
    """Both options on: a config for either machine. CPU float32 tensors go to the native
    passes first (even under the interpreter), CUDA tensors to the Triton kernels."""
    spec = dict(name="softmax", pre_sbn=True, post_sbn=True, native_sbn=True, triton_sbn=True)
    attn = build_attention(spec, head_dim=16, num_heads=2)
    assert attn.native_sbn and attn.triton_sbn
    cpu = torch.empty(1, 2, 3, 16)
    assert attn._native(cpu)
    assert "native_sbn=True, triton_sbn=True" in attn.extra_repr()


def _auto(**options):
    spec = dict(name="maclaurin", pre_sbn=True, post_sbn=True, auto_kernels=True, **options)
    return build_attention(spec, head_dim=32, num_heads=2)


def _core(attn):
    return next(m for m in attn.modules() if isinstance(m, maclaurin_module.MaclaurinAttention))


def test_auto_kernels_turn_it_on_with_the_triton_fused_products(monkeypatch):
    monkeypatch.setattr(maclaurin_module, "cxx_compiler", lambda: None)
    monkeypatch.setattr(maclaurin_module, "triton_available", lambda: True)
    monkeypatch.setattr(ppsbn_module, "triton_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    wrapper = _auto()
    assert wrapper.triton_sbn and not wrapper.native_sbn
    assert _core(wrapper).kernel_choice.endswith("; ppSBN: triton_sbn")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    wrapper = _auto()
    assert not wrapper.triton_sbn
    assert "triton_sbn" not in _core(wrapper).kernel_choice


# The kernels' pointer arguments (upper case, but for the sizes H and L), their element
# types where not float32 (the partial sums, and x and ∂x in bfloat16), and the switches.
_SIZES = {"H", "L"}
_FLOAT64 = {"PART"}
_BF16 = {"moment_kernel": "X", "normalise_kernel": "X", "backward_apply_kernel": "GX"}
_SWITCHES = {"HAS_W": True, "HAS_MEAN": True, "HAS_TAU": True, "SHARED": False}


@pytest.mark.skipif(not _has_ptxas(), reason="no Triton CUDA assembler")
@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16"])
@pytest.mark.parametrize("arch", [80, 90])
def test_kernels_compile_for_cuda_without_a_gpu(arch, bf16):
    """Every kernel compiles to a cubin for an A100 (sm_80) and an H100 (sm_90) at head size
    64, with Triton's own ptxas: what the interpreter cannot check (float64 accumulators,
    libdevice's exp and log, layouts, registers) fails here, not on a lent GPU."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: the kernels are the interpreter's")
    from macformer_lit.attention import triton_sbn_kernels as kernels

    for name in (
        "moment_kernel",
        "normalise_kernel",
        "backward_sums_kernel",
        "backward_apply_kernel",
        "post_forward_kernel",
        "post_backward_kernel",
    ):
        kernel = getattr(kernels, name)
        consts = {"BD": 64, "BL": 64, "TILES": 4, "BF16": bf16, "INTERPRETED": False}
        consts.update(_SWITCHES)
        consts = {k: v for k, v in consts.items() if k in kernel.arg_names}
        signature = {}
        for arg in kernel.arg_names:
            if arg in consts:
                continue
            if arg.isupper() and arg not in _SIZES:
                bf16_arg = bf16 and _BF16.get(name) == arg
                signature[arg] = "*fp64" if arg in _FLOAT64 else "*bf16" if bf16_arg else "*fp32"
            else:
                signature[arg] = "i32"
        compiled = compile_for_cuda(kernel, signature, consts, arch)
        assert compiled.asm["cubin"], name
