"""``auto_kernels: true`` on the Maclaurin backend (attention/maclaurin.py, choose_kernels):
the kernels and the rows' dtype chosen by what the machine has, refused beside explicit
kernel options, and the choice written where a run record reads it."""

from __future__ import annotations

import pytest
import torch
from native_support import CXX, needs_cxx

from macformer_lit import provenance
from macformer_lit.attention import build_attention
from macformer_lit.attention import maclaurin as maclaurin_module
from macformer_lit.attention.native_fused import amx_tiles, bf16_dot


def _auto(head_dim=32, **options):
    spec = dict(name="maclaurin", pre_sbn=True, post_sbn=True, auto_kernels=True, **options)
    return build_attention(spec, head_dim=head_dim, num_heads=2)


def _core(attn):
    return next(m for m in attn.modules() if isinstance(m, maclaurin_module.MaclaurinAttention))


@needs_cxx
def test_a_cpu_with_a_compiler_takes_the_native_kernels():
    wrapper = _auto()
    attn = _core(wrapper)
    assert wrapper.native_sbn  # ppSBN's passes native too (attention/native_sbn.py)
    assert attn.native_map and attn.native_fused and not attn.triton_fused
    assert attn.feature_dtype == ("bfloat16" if bf16_dot(CXX) else "float32")
    want = "AMX tiles" if amx_tiles(CXX) else "AVX512-BF16" if bf16_dot(CXX) else "a C++ compiler"
    assert (
        attn.kernel_choice.startswith("auto: native_map+native_fused")
        and want in attn.kernel_choice
    )


@needs_cxx
def test_head_sizes_the_fused_kernel_lacks_keep_the_native_map():
    attn = _core(_auto(head_dim=24))
    assert attn.native_map and not attn.native_fused
    # The rows' dtype still follows what the CPU multiplies (the unfused GEMMs take bfloat16).
    assert attn.feature_dtype == ("bfloat16" if bf16_dot(CXX) else "float32")


@needs_cxx
def test_sign_split_takes_the_native_map_without_the_fused_kernels(monkeypatch):
    monkeypatch.setattr(maclaurin_module, "triton_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    attn = _core(_auto(head_dim=16, input_map="sign_split"))
    assert attn.native_map and not (attn.native_fused or attn.triton_fused)
    assert attn.feature_dtype == ("bfloat16" if bf16_dot(CXX) else "float32")


def test_no_compiler_and_no_gpu_is_eager_float32(monkeypatch):
    monkeypatch.setattr(maclaurin_module, "cxx_compiler", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    wrapper = _auto()
    attn = _core(wrapper)
    assert not (attn.native_map or attn.native_fused or attn.triton_fused or attn.compile_map)
    assert not wrapper.native_sbn
    assert attn.feature_dtype == "float32"
    assert attn.kernel_choice == "auto: eager, float32 (CPU without a C++ compiler)"


def test_a_gpu_with_triton_takes_the_triton_kernels_in_bfloat16(monkeypatch):
    monkeypatch.setattr(maclaurin_module, "cxx_compiler", lambda: None)
    monkeypatch.setattr(maclaurin_module, "triton_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    attn = _core(_auto())
    assert attn.triton_fused and attn.feature_dtype == "bfloat16"
    assert "CUDA GPU with triton" in attn.kernel_choice


def test_degree_one_has_no_kernels():
    attn = _core(_auto(degree=1))
    assert not (attn.native_map or attn.native_fused or attn.triton_fused)


@pytest.mark.parametrize(
    "option", [dict(native_fused=True), dict(triton_fused=True), dict(feature_dtype="bfloat16")]
)
def test_refused_beside_explicit_kernel_options(option):
    with pytest.raises(ValueError, match="auto_kernels: true chooses the kernels") as err:
        _auto(**option)
    assert "\n" not in str(err.value)


def test_the_run_record_names_the_kernels_and_the_cpu_flags():
    """provenance.entry writes each attention's kernel_choice (the options on, or what auto
    chose) and the CPU flags the choice reads."""
    model = torch.nn.Sequential(
        build_attention(dict(name="maclaurin", native_map=False), head_dim=16, num_heads=1),
        build_attention("softmax", head_dim=16, num_heads=1),
    )
    assert provenance.attention_kernels(model) == ["eager, float32"]
    assert set(provenance.cpu_flags()) <= set(provenance.CPU_FLAGS)
    if "avx512_bf16" in provenance.cpu_flags() and CXX:
        assert bf16_dot(CXX)  # the flag the record shows is the instruction the kernel takes
    if "amx_bf16" in provenance.cpu_flags() and CXX:
        assert amx_tiles(CXX)  # and the tiles: built for them and granted
