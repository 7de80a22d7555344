"""Attention backends behind one contract (docs/maths.md §1) and a plain registry.

Adding a backend: one file in this folder (its typed ``__init__`` declares its options, its
``reference`` is beside ``_attend`` or derived from the feature maps), one line in
``registry.BACKENDS``, one YAML under ``configs/attention/``. The contract tests and the
CLI's config tests pick it up from the registry and the YAML folder. The modules import
one way: backends ← ``registry`` ← ``spec`` (the spec value and ``build_attention``);
``reference`` (the float64 references) imports none of the modules it checks.
"""

from __future__ import annotations

from .base import AttentionBackend, check_inputs
from .favor import FavorAttention
from .feature_attention import DENOMINATOR_POLICIES, FeatureAttention
from .kernelized import KernelizedAttention
from .kernels import KERNELS, Kernel, get_kernel, register_kernel
from .linear import LinearAttention
from .maclaurin import MaclaurinAttention
from .ppsbn import PPSBNAttention
from .prefix import PREFIXES, PrefixAttention, resolve_prefix
from .registry import BACKENDS, attention_cores, random_feature_backends
from .rmfa import RMFAttention
from .softmax import SoftmaxAttention
from .spec import (
    ROLES,
    AttentionSpec,
    ParsedSpec,
    backend_options,
    build_attention,
    parse_spec,
)
from .uniform import UniformAttention

__all__ = [
    "BACKENDS",
    "AttentionSpec",
    "DENOMINATOR_POLICIES",
    "KERNELS",
    "AttentionBackend",
    "FavorAttention",
    "FeatureAttention",
    "Kernel",
    "KernelizedAttention",
    "LinearAttention",
    "MaclaurinAttention",
    "PPSBNAttention",
    "PREFIXES",
    "ParsedSpec",
    "PrefixAttention",
    "RMFAttention",
    "ROLES",
    "SoftmaxAttention",
    "UniformAttention",
    "attention_cores",
    "backend_options",
    "build_attention",
    "check_inputs",
    "get_kernel",
    "parse_spec",
    "random_feature_backends",
    "register_kernel",
    "resolve_prefix",
]
