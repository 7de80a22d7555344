"""The attention spec: what ``attention: {name: rmfa, kernel: exp, pre_sbn: true}`` may say,
and the one function that checks it.

A spec is a backend name and options. The options are declared once, typed, where they
act: each backend's own ``__init__`` signature (``BACKENDS[name]``, and the base class
signature its ``**kwargs`` reach: FeatureAttention's denominator, chunk and recompute
options are written there once) and the ppSBN wrapper's
(``PPSBNAttention``: ``pre_sbn``, ``post_sbn``, ``sbn_*``, ``temperature_max``). Nothing
else lists them. ``parse_spec`` checks a spec against those signatures (the backend name,
each option's name, type and ``Literal`` choices, options of pre-SBN without it) and splits
it; ``build_attention`` builds from its result, and the constructors check ranges. The CLI
calls ``check_attention_spec`` (a trial build) on every attention argument of the model
right after parsing, so a wrong spec stops a run before data is read or a model is built.
"""

from __future__ import annotations

import inspect
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Union

import torch

# What a spec may be in a config: a mapping, a bare backend name, or nothing (softmax).
AttentionSpec = dict[str, Any] | str | None

# Constructor arguments the model supplies, never a spec: the wrapped backend, the head
# shape, whether the queries are causal although the call is not, and the encoder layer.
MODEL_SUPPLIED = ("self", "inner", "head_dim", "num_heads", "causal_queries", "layer")
# The wrapper's switches; its other options act inside pre-SBN (or post-SBN, below).
SBN_SWITCHES = ("pre_sbn", "post_sbn")
POST_OPTIONS = ("post_sbn_power", "post_sbn_gamma")
# Where the model builds an attention: the role decides which options make sense.
ROLES = ("encoder", "decoder", "cross")


@dataclass(frozen=True)
class ParsedSpec:
    """A checked spec: the backend, its options, the ppSBN wrapper's (empty if none), and the
    encoder's ``prefix`` (``none``, a direction, or one per layer)."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)
    sbn: dict[str, Any] = field(default_factory=dict)
    prefix: Any = "none"

    @property
    def wrapped(self) -> bool:
        return bool(self.sbn.get("pre_sbn") or self.sbn.get("post_sbn"))


def constructor_chain(cls: type) -> list[Any]:
    """``cls.__init__`` and, while one ends in ``**kwargs``, the base ``__init__`` it hands
    them on to (a backend writes ``**common`` for FeatureAttention's shared options)."""
    inits = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        inits.append(init)
        params = inspect.signature(init).parameters.values()
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return inits


def _parameters(cls: type) -> dict[str, inspect.Parameter]:
    """The keyword-only options of ``cls``'s constructor, own first, then those its
    ``**kwargs`` reach; the model-supplied ones left out."""
    found: dict[str, inspect.Parameter] = {}
    for init in constructor_chain(cls):
        for k, p in inspect.signature(init).parameters.items():
            if k not in MODEL_SUPPLIED and p.kind == p.KEYWORD_ONLY:
                found.setdefault(k, p)
    return found


def _hints(cls: type) -> dict[str, Any]:
    hints: dict[str, Any] = {}
    for init in reversed(constructor_chain(cls)):
        hints.update(typing.get_type_hints(init))
    return {k: v for k, v in hints.items() if k in _parameters(cls)}


def backend_options(name: str) -> dict[str, inspect.Parameter]:
    """The options of backend ``name``, in signature order (defaults included)."""
    from . import BACKENDS

    return _parameters(BACKENDS[name])


def sbn_options() -> dict[str, inspect.Parameter]:
    """The ppSBN wrapper's options (``pre_sbn``, ``post_sbn``, ``sbn_*``, ``temperature_max``)."""
    from .ppsbn import PPSBNAttention

    return _parameters(PPSBNAttention)


def prefix_options() -> dict[str, inspect.Parameter]:
    """The prefix wrapper's option (``prefix``)."""
    from .prefix import PrefixAttention

    return _parameters(PrefixAttention)


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is list:
        return "a list of (" + " or ".join(_describe(a) for a in typing.get_args(hint)) + ")"
    if origin is Literal:
        return "one of: " + ", ".join(repr(a) for a in typing.get_args(hint))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "null"
    return getattr(hint, "__name__", str(hint))


def _fits(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        return isinstance(value, list) and all(_fits(v, item) for v in value)
    if origin is Literal:
        return value in typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return any(_fits(value, a) for a in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return True  # an annotation this check does not know: left to the constructor


def as_spec(spec: AttentionSpec) -> dict[str, Any] | None:
    """A bare backend name (``attention: rmfa`` in a config) means ``{name: rmfa}``."""
    return {"name": spec} if isinstance(spec, str) else spec


def parse_spec(
    spec: AttentionSpec = None, *, check_types: bool = True, **options: Any
) -> ParsedSpec:
    """Check ``spec`` (``{name: ..., **options}``, a bare name, or None for softmax; keyword
    ``options`` are merged in) against the signatures that declare its options and split
    it. Raises ``ValueError`` naming the problem and the valid choices. With
    ``check_types=False`` (``build_attention``: a Python caller) values are left to the
    constructors' own checks; the CLI checks them here, against the annotations."""
    from . import BACKENDS
    from .ppsbn import PPSBNAttention
    from .prefix import PrefixAttention

    spec = dict(as_spec(spec) or {"name": "softmax"})
    spec.update(options)
    if "name" not in spec:
        raise ValueError(
            f"attention spec {spec} has no 'name'; give e.g. {{name: softmax}} or "
            "compose a file from configs/attention/"
        )
    name = spec.pop("name")
    if name not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; valid backends: {', '.join(sorted(BACKENDS))}"
        )
    accepted, wrapper, around = backend_options(name), sbn_options(), prefix_options()
    unknown = sorted(set(spec) - set(accepted) - set(wrapper) - set(around))
    if unknown:
        raise ValueError(
            f"attention backend {name!r} has no option(s) {', '.join(unknown)}; its options are: "
            f"{', '.join(sorted(set(accepted) | set(wrapper) | set(around)))}"
        )
    hints = (
        {**_hints(PrefixAttention), **_hints(PPSBNAttention), **_hints(BACKENDS[name])}
        if check_types
        else {}
    )
    for key, value in spec.items():
        hint = hints.get(key)
        if hint is not None and not _fits(value, hint):
            raise ValueError(
                f"option {key}={value!r} of attention backend {name!r} must be {_describe(hint)}"
            )
    prefix = spec.pop("prefix", "none") if "prefix" not in accepted else "none"
    sbn = {key: spec.pop(key) for key in list(spec) if key in wrapper and key not in accepted}
    post = [key for key in sbn if key in POST_OPTIONS]
    if post and not sbn.get("post_sbn"):
        raise ValueError(f"option(s) {', '.join(post)} act inside post-SBN: set post_sbn: true")
    inside = [key for key in sbn if key not in SBN_SWITCHES and key not in POST_OPTIONS]
    if inside and not sbn.get("pre_sbn"):
        raise ValueError(f"option(s) {', '.join(inside)} act inside pre-SBN: set pre_sbn: true")
    sbn.setdefault("pre_sbn", False)
    sbn.setdefault("post_sbn", False)
    return ParsedSpec(name, spec, sbn, prefix)


def full_spec(spec: AttentionSpec) -> dict[str, Any]:
    """``spec`` with every option it leaves out at its default, as ``build_attention``
    resolves it (so ``{name: softmax}`` equals ``{name: softmax, dropout: 0.0}``); a spec
    that does not parse comes back as given."""
    try:
        parsed = parse_spec(spec)
    except ValueError:
        return dict(as_spec(spec) or {})
    full: dict[str, Any] = {"name": parsed.name}
    full.update({k: p.default for k, p in backend_options(parsed.name).items()})
    wrapper = sbn_options()
    full.update({k: p.default for k, p in wrapper.items() if parsed.wrapped or k in SBN_SWITCHES})
    if parsed.sbn["pre_sbn"] and "bounded_inputs" in full:
        full["bounded_inputs"] = True  # build_attention's own rule
    full.update(parsed.options)
    full.update(parsed.sbn)
    full["prefix"] = parsed.prefix
    return full


def check_attention_spec(
    spec: dict[str, Any] | None,
    *,
    head_dim: int,
    num_heads: int,
    where: str = "attention",
    roles: tuple[str, ...] = ("encoder",),
    num_layers: int | None = None,
) -> None:
    """Raise ``ValueError`` (prefixed by ``where``) if ``spec``, a mapping as in
    ``configs/attention/``, would not build: ``parse_spec``'s checks, then the constructors'
    range checks by one trial build for this head shape, with the global random state
    saved and restored, so a seeded run draws the same weights. ``roles``: where the model
    builds it (``ROLES``); ``num_layers``: its encoder's depth (a per-layer ``prefix``)."""
    from . import build_attention
    from .prefix import check_prefix_layers

    if spec is None:
        return
    if not isinstance(spec, dict):
        raise ValueError(
            f"{where} must be a mapping like {{name: rmfa, kernel: exp}}; got {spec!r}"
        )
    try:
        parsed = parse_spec(spec)
        if num_layers is not None and "encoder" in roles:
            check_prefix_layers(parsed.prefix, num_layers)
        with torch.random.fork_rng(devices=[]):
            for role in roles:
                layer = 0 if role == "encoder" else None
                build_attention(
                    spec, head_dim=head_dim, num_heads=num_heads, role=role, layer=layer
                )
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def describe_backends() -> str:
    """Every backend's options with their types and defaults, for ``--help``."""
    from . import BACKENDS, KERNELS
    from .ppsbn import PPSBNAttention

    def line(cls: type, key: str, param: inspect.Parameter) -> str:
        hint = _hints(cls).get(key)
        kind = _describe(hint) if hint is not None else "any"
        return f"{key}={param.default!r} ({kind})"

    rows = [
        f"  {name}: " + ", ".join(line(cls, k, p) for k, p in _parameters(cls).items())
        for name, cls in BACKENDS.items()
    ]
    from .prefix import PrefixAttention

    wrapper = ", ".join(line(PPSBNAttention, k, p) for k, p in sbn_options().items())
    around = ", ".join(line(PrefixAttention, k, p) for k, p in prefix_options().items())
    return "\n".join(
        ["attention: {name: <backend>, <option>: <value>, ...}; backends and options:", *rows]
        + [f"  any backend, wrapped in ppSBN: {wrapper}"]
        + [f"  any backend, in an encoder's self-attention: {around} (a value or one per layer)"]
        + [f"  kernels: {', '.join(KERNELS)} (attention.register_kernel adds more)"]
    )
