"""The registry: each backend's name and class, and the backends inside a built model.

A plain dict with explicit imports; ``spec.py`` reads the backends' options from these
classes' signatures, so adding a backend is its file, one line here and one YAML.
"""

from __future__ import annotations

from torch import nn

from .base import AttentionBackend
from .favor import FavorAttention
from .feature_attention import FeatureAttention
from .kernelized import KernelizedAttention
from .linear import LinearAttention
from .maclaurin import MaclaurinAttention
from .rmfa import RMFAttention
from .softmax import SoftmaxAttention
from .uniform import UniformAttention

BACKENDS: dict[str, type[AttentionBackend]] = {
    "softmax": SoftmaxAttention,
    "kernelized": KernelizedAttention,
    "rmfa": RMFAttention,
    "favor": FavorAttention,
    "linear": LinearAttention,
    "uniform": UniformAttention,
    "maclaurin": MaclaurinAttention,
}


def attention_cores(model: nn.Module) -> list[tuple[str, AttentionBackend]]:
    """The innermost backends of ``model`` (inside any ppSBN wrapper), in module order."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, AttentionBackend)
        and not any(isinstance(c, AttentionBackend) for c in m.children())
    ]


def random_feature_backends(model: nn.Module) -> list[FeatureAttention]:
    """Backends with redrawable random features, in module order (= layer index)."""
    return [m for _, m in attention_cores(model) if m.random_features]
