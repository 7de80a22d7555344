"""Attention backends behind one contract (docs/maths.md §1) and a plain registry.

Adding a backend: one file in this folder (its typed ``__init__`` declares its options, its
``reference`` is beside ``_attend`` or derived from the feature maps), one line in
``BACKENDS``, one YAML under ``configs/attention/``. The contract tests and the CLI's config
tests pick it up from the registry and the YAML folder.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .base import AttentionBackend, check_inputs
from .favor import FavorAttention
from .feature_attention import DENOMINATOR_POLICIES, FeatureAttention
from .kernelized import KernelizedAttention
from .kernels import KERNELS, Kernel, get_kernel, register_kernel
from .linear import LinearAttention
from .maclaurin import MaclaurinAttention
from .ppsbn import PPSBNAttention
from .prefix import PREFIXES, PrefixAttention, resolve_prefix
from .rmfa import RMFAttention
from .softmax import SoftmaxAttention
from .spec import ROLES, AttentionSpec, backend_options, parse_spec
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


def build_attention(
    spec: AttentionSpec = None,
    *,
    head_dim: int,
    num_heads: int,
    causal_queries: bool = False,
    role: str = "encoder",
    layer: int | None = None,
    **options: Any,
) -> nn.Module:
    """Build the backend a spec names for heads of size ``head_dim``.

    ``spec`` is a mapping ``{name: rmfa, kernel: exp, ...}`` as in ``configs/attention/``, a
    bare backend name, or None (softmax); keyword ``options`` add to it, so
    ``build_attention("rmfa", head_dim=16, num_heads=4, pre_sbn=True)`` works too. The spec
    is checked by ``spec.parse_spec`` against the backend's signature and ppSBN's
    (``pre_sbn``, ``post_sbn``, ``sbn_eps``, ``sbn_momentum``, ``sbn_stats``,
    ``sbn_train_stats``, ``temperature_max``; ``PPSBNAttention`` wraps the backend when
    either switch is on). With pre-SBN, a backend that takes ``bounded_inputs`` gets True.
    ``causal_queries`` is the model's to set: queries causal although the call is not
    (decoder cross-attention), which ppSBN's ``sbn_train_stats: auto`` then respects.
    ``role`` (``encoder``, ``decoder`` or ``cross``) and ``layer`` (the encoder layer) are
    the model's too: ``prefix`` (prefix sums in an encoder, ``PrefixAttention``, inside
    ppSBN) acts in an encoder's self-attention only, one value or one per layer.
    """
    if head_dim < 1 or num_heads < 1:
        raise ValueError(f"head_dim and num_heads must be >= 1; got {head_dim}, {num_heads}")
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}; got {role!r}")
    parsed = parse_spec(spec, check_types=False, **options)
    cls, options = BACKENDS[parsed.name], dict(parsed.options)
    if parsed.sbn["pre_sbn"] and "bounded_inputs" in backend_options(parsed.name):
        options.setdefault("bounded_inputs", True)
    if parsed.prefix not in ("none", None) and role != "encoder":
        raise ValueError(
            f"prefix acts in an encoder's self-attention only, not in {role} attention (a "
            "decoder is causal already; cross-attention has no order between queries and "
            "keys): put it in encoder_attention"
        )
    direction = resolve_prefix(parsed.prefix, layer) if role == "encoder" else "none"
    backend = cls(head_dim=head_dim, num_heads=num_heads, **options)
    if direction != "none":
        backend = PrefixAttention(backend, num_heads=num_heads, prefix=parsed.prefix, layer=layer)
    if not parsed.wrapped:
        return backend
    return PPSBNAttention(
        backend,
        head_dim=head_dim,
        num_heads=num_heads,
        causal_queries=causal_queries,
        **parsed.sbn,
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
    return [m for _, m in attention_cores(model) if m.random_features]


__all__ = [
    "BACKENDS",
    "AttentionSpec",
    "DENOMINATOR_POLICIES",
    "KERNELS",
    "AttentionBackend",
    "Kernel",
    "PPSBNAttention",
    "PREFIXES",
    "PrefixAttention",
    "ROLES",
    "attention_cores",
    "build_attention",
    "check_inputs",
    "get_kernel",
    "random_feature_backends",
    "register_kernel",
]
