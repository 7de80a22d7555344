"""What the native-kernel tests share (test_native_map.py, test_native_fused.py): the C++
compiler they build with (the files skip without one), float32's unit roundoff and the
degree-2 map's coefficients."""

from __future__ import annotations

import shutil

import pytest

from macformer_lit.attention import build_attention

U32 = 2.0**-24
CXX = shutil.which("g++") or shutil.which("clang++") or shutil.which("c++")
needs_cxx = pytest.mark.skipif(CXX is None, reason="no C++ compiler")


def scale(d: int):
    """The degree-2 map's (D',) coefficients at head size d."""
    return build_attention("maclaurin", head_dim=d, num_heads=1)._scale
