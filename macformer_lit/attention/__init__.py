"""Attention backends behind one contract (docs/maths.md §1) and a plain registry.

Adding a backend: one file in this folder, one line in ``BACKENDS``, one YAML under
``configs/attention/``, one entry in ``reference.REFERENCES``. The contract tests pick it
up from the registry.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from .base import AttentionBackend, check_inputs
from .favor import FavorAttention
from .feature_attention import DENOMINATOR_POLICIES, FeatureAttention
from .kernelized import KernelizedAttention
from .kernels import KERNELS, Kernel, get_kernel, register_kernel
from .linear import LinearAttention
from .ppsbn import PPSBNAttention
from .rmfa import RMFAttention
from .softmax import SoftmaxAttention

BACKENDS: dict[str, type[AttentionBackend]] = {
    "softmax": SoftmaxAttention,
    "kernelized": KernelizedAttention,
    "rmfa": RMFAttention,
    "favor": FavorAttention,
    "linear": LinearAttention,
}

# build_attention option -> PPSBNAttention argument; these only make sense with pre_sbn.
_PRE_SBN_OPTIONS = {
    "sbn_eps": "eps",
    "sbn_momentum": "momentum",
    "sbn_stats": "stats",
    "sbn_train_stats": "train_stats",
    "temperature_max": "temperature_max",
}


def build_attention(
    name: str,
    *,
    head_dim: int,
    num_heads: int,
    pre_sbn: bool = False,
    post_sbn: bool = False,
    **options: Any,
) -> nn.Module:
    """Build backend ``name`` for heads of size ``head_dim``; ``options`` go to its constructor.

    ``pre_sbn`` / ``post_sbn`` wrap any backend in ppSBN (``ppsbn.PPSBNAttention``), tuned by
    ``sbn_eps``, ``sbn_momentum``, ``sbn_stats``, ``sbn_train_stats`` and
    ``temperature_max``. With pre-SBN, a backend that takes ``bounded_inputs`` gets True.
    """
    if name not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; valid backends: {', '.join(sorted(BACKENDS))}"
        )
    if head_dim < 1 or num_heads < 1:
        raise ValueError(f"head_dim and num_heads must be >= 1; got {head_dim}, {num_heads}")
    cls = BACKENDS[name]
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "head_dim", "num_heads"}
    sbn = {
        _PRE_SBN_OPTIONS[key]: options.pop(key) for key in list(options) if key in _PRE_SBN_OPTIONS
    }
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise ValueError(
            f"attention backend {name!r} has no option(s) {', '.join(unknown)}; its options are: "
            f"{', '.join(sorted(accepted | {'pre_sbn', 'post_sbn', *_PRE_SBN_OPTIONS}))}"
        )
    if sbn and not pre_sbn:
        given = [key for key, arg in _PRE_SBN_OPTIONS.items() if arg in sbn]
        raise ValueError(f"option(s) {', '.join(given)} act inside pre-SBN: set pre_sbn: true")
    if pre_sbn and "bounded_inputs" in accepted:
        options.setdefault("bounded_inputs", True)
    backend = cls(head_dim=head_dim, num_heads=num_heads, **options)
    if not (pre_sbn or post_sbn):
        return backend
    return PPSBNAttention(
        backend, head_dim=head_dim, num_heads=num_heads, pre=pre_sbn, post=post_sbn, **sbn
    )


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
    return [m for _, m in attention_cores(model) if getattr(m, "random_features", False)]


__all__ = [
    "BACKENDS",
    "DENOMINATOR_POLICIES",
    "KERNELS",
    "AttentionBackend",
    "Kernel",
    "PPSBNAttention",
    "attention_cores",
    "build_attention",
    "check_inputs",
    "get_kernel",
    "random_feature_backends",
    "register_kernel",
]
