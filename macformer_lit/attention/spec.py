"""The attention spec: what ``attention: {name: rmfa, kernel: exp, pre_sbn: true}`` may say,
the one function that parses it into one value, and the build from that value.

A spec is a backend name and options. The options are declared once, typed, where they
act: each backend's own ``__init__`` signature (``registry.BACKENDS[name]``, and the base
class signature its ``**kwargs`` reach: FeatureAttention's denominator, chunk and
recompute options are written there once), the ppSBN wrapper's (``PPSBNAttention``:
``pre_sbn``, ``post_sbn``, ``sbn_*``, ``temperature_*``) and the prefix wrapper's
(``prefix``). Nothing else lists them.

``parse_spec`` is the one parser: it checks a spec against those signatures (the backend
name, each option's name, type and ``Literal`` choices, options of pre-SBN without it) and
returns a ``ParsedSpec``, frozen and complete (every option at its value, defaults filled
in). The CLI parses each attention argument once, right after the command line; the tasks
parse the mappings they are given once and hand the value to the model;
``build_attention`` builds from a value as it is, and the constructors check ranges.
``check_attention_spec`` is the CLI's trial build, so a wrong spec stops a run before
data is read or a model is built.
"""

from __future__ import annotations

import copy
import functools
import inspect
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Union

import torch
from torch import nn

from .kernels import KERNELS
from .ppsbn import PPSBNAttention
from .prefix import PrefixAttention, check_prefix_layers, resolve_prefix
from .registry import BACKENDS

# What a spec may be in a config: a mapping, a bare backend name, or nothing (softmax).
# Model arguments with this type are attention specs (``spec_arguments``).
AttentionSpec = dict[str, Any] | str | None

# Constructor arguments the model supplies, never a spec: the wrapped backend, the head
# shape, whether the queries are causal although the call is not, and the encoder layer.
MODEL_SUPPLIED = ("self", "inner", "head_dim", "num_heads", "causal_queries", "layer")
# The wrapper's switches; its other options act inside pre-SBN (or post-SBN, below).
SBN_SWITCHES = ("pre_sbn", "post_sbn")
POST_OPTIONS = ("post_sbn_power", "post_sbn_gamma")
EITHER_OPTIONS = ("native_sbn", "triton_sbn")  # acts on both halves: either switch will do
# Where the model builds an attention: the role decides which options make sense.
ROLES = ("encoder", "decoder", "cross")


@dataclass(frozen=True, eq=False, repr=False)
class ParsedSpec:
    """One attention spec, checked and complete; made by ``parse_spec`` only.

    ``options``: every option of the backend, at its default where the spec leaves it out;
    ``sbn``: the ppSBN wrapper's (all of them when either switch is on, else the two
    switches, off); ``prefix``: the encoder's (``none``, a direction, or one per layer).
    Two values are equal when they build the same attention, so ``{name: softmax}`` equals
    ``{name: softmax, dropout: 0.0}``; ``as_dict()`` is the mapping as written, which
    config.yaml and the checkpoints' hyper-parameters record.
    """

    name: str
    options: Mapping[str, Any]
    sbn: Mapping[str, Any]
    prefix: Any
    given: Mapping[str, Any]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ParsedSpec):
            return NotImplemented
        return self.full() == other.full()

    __hash__ = None  # equal values may hold lists (a per-layer prefix)

    def __repr__(self) -> str:
        return f"ParsedSpec({dict(self.given)!r})"

    def __reduce__(self):
        # A mappingproxy does not pickle (DDP spawn, deepcopy): rebuilt from plain dicts.
        fields = (self.name, dict(self.options), dict(self.sbn), self.prefix, dict(self.given))
        return (_parsed_spec, fields)

    @property
    def wrapped(self) -> bool:
        return bool(self.sbn.get("pre_sbn") or self.sbn.get("post_sbn"))

    def as_dict(self) -> dict[str, Any]:
        """The spec as written (a bare name as ``{name: ...}``), a copy."""
        return copy.deepcopy(dict(self.given))

    def full(self) -> dict[str, Any]:
        """Every option at its value: ``{name, **options, **sbn, prefix}``."""
        return {"name": self.name, **self.options, **self.sbn, "prefix": self.prefix}


def _parsed_spec(name, options, sbn, prefix, given) -> ParsedSpec:
    proxy = types.MappingProxyType
    return ParsedSpec(name, proxy(options), proxy(sbn), prefix, proxy(given))


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
    return dict(_class_parameters(cls))


def _hints(cls: type) -> dict[str, Any]:
    """The options' type hints."""
    return dict(_class_hints(cls))


# A class's signatures do not change: read once a class (every CLI start describes every
# backend's options for --help, and a sweep starts one parser a point: 39 points of the
# mechanism screen spent most of their report's time in inspect.signature).
@functools.cache
def _class_parameters(cls: type) -> types.MappingProxyType:
    found: dict[str, inspect.Parameter] = {}
    for init in constructor_chain(cls):
        for k, p in inspect.signature(init).parameters.items():
            if k not in MODEL_SUPPLIED and p.kind == p.KEYWORD_ONLY:
                found.setdefault(k, p)
    return types.MappingProxyType(found)


@functools.cache
def _class_hints(cls: type) -> types.MappingProxyType:
    hints: dict[str, Any] = {}
    for init in reversed(constructor_chain(cls)):
        hints.update(typing.get_type_hints(init))
    return types.MappingProxyType({k: v for k, v in hints.items() if k in _class_parameters(cls)})


def backend_options(name: str) -> dict[str, inspect.Parameter]:
    """The options of backend ``name``, in signature order (defaults included)."""
    return _parameters(BACKENDS[name])


def sbn_options() -> dict[str, inspect.Parameter]:
    """The ppSBN wrapper's options (``pre_sbn``, ``post_sbn``, ``sbn_*``, ``temperature_*``)."""
    return _parameters(PPSBNAttention)


def prefix_options() -> dict[str, inspect.Parameter]:
    """The prefix wrapper's option (``prefix``)."""
    return _parameters(PrefixAttention)


def spec_arguments(hints: Mapping[str, Any]) -> list[str]:
    """The arguments typed ``AttentionSpec`` among ``hints`` (a constructor's type hints)."""
    return [key for key, hint in hints.items() if hint == AttentionSpec]


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


def _as_mapping(spec: AttentionSpec) -> Any:
    """A bare backend name (``attention: rmfa`` in a config) means ``{name: rmfa}``."""
    return {"name": spec} if isinstance(spec, str) else spec


def parse_spec(
    spec: AttentionSpec | ParsedSpec = None, *, check_types: bool = True, **options: Any
) -> ParsedSpec:
    """The one value of ``spec`` (``{name: ..., **options}``, a bare name, or None for
    softmax; keyword ``options`` are merged in), checked against the signatures that
    declare its options. A ``ParsedSpec`` without ``options`` comes back as it is. Raises
    ``ValueError`` naming the problem and the valid choices. With ``check_types=False``
    (a Python caller) values are left to the constructors' own checks; the CLI checks them
    here, against the annotations."""
    if isinstance(spec, ParsedSpec):
        if not options:
            return spec
        spec = spec.as_dict()
    given = copy.deepcopy(dict(_as_mapping(spec) or {"name": "softmax"}))
    given.update(options)
    if "name" not in given:
        raise ValueError(
            f"attention spec {given} has no 'name'; give e.g. {{name: softmax}} or "
            "compose a file from configs/attention/"
        )
    rest = dict(given)
    name = rest.pop("name")
    if name not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; valid backends: {', '.join(sorted(BACKENDS))}"
        )
    accepted, wrapper, around = backend_options(name), sbn_options(), prefix_options()
    unknown = sorted(set(rest) - set(accepted) - set(wrapper) - set(around))
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
    for key, value in rest.items():
        hint = hints.get(key)
        if hint is not None and not _fits(value, hint):
            raise ValueError(
                f"option {key}={value!r} of attention backend {name!r} must be {_describe(hint)}"
            )
    prefix = rest.pop("prefix", "none") if "prefix" not in accepted else "none"
    sbn = {key: rest.pop(key) for key in list(rest) if key in wrapper and key not in accepted}
    post = [key for key in sbn if key in POST_OPTIONS]
    if post and not sbn.get("post_sbn"):
        raise ValueError(f"option(s) {', '.join(post)} act inside post-SBN: set post_sbn: true")
    either = [key for key in sbn if key in EITHER_OPTIONS]
    if either and not (sbn.get("pre_sbn") or sbn.get("post_sbn")):
        raise ValueError(
            f"option(s) {', '.join(either)} act on pre-SBN and post-SBN: set pre_sbn or "
            "post_sbn: true"
        )
    outside = (*SBN_SWITCHES, *POST_OPTIONS, *EITHER_OPTIONS)
    inside = [key for key in sbn if key not in outside]
    if inside and not sbn.get("pre_sbn"):
        raise ValueError(f"option(s) {', '.join(inside)} act inside pre-SBN: set pre_sbn: true")
    sbn.setdefault("pre_sbn", False)
    sbn.setdefault("post_sbn", False)
    wrapped = bool(sbn["pre_sbn"] or sbn["post_sbn"])
    defaults = {k: p.default for k, p in accepted.items()}
    if sbn["pre_sbn"] and "bounded_inputs" in defaults:
        defaults["bounded_inputs"] = True  # pre-SBN bounds |q·k|/√d (docs/maths.md §10)
    sbn_full = {k: p.default for k, p in wrapper.items() if wrapped or k in SBN_SWITCHES}
    return ParsedSpec(
        name=name,
        options=types.MappingProxyType({**defaults, **rest}),
        sbn=types.MappingProxyType({**sbn_full, **sbn}),
        prefix=prefix,
        given=types.MappingProxyType(given),
    )


def full_spec(spec: AttentionSpec | ParsedSpec) -> dict[str, Any]:
    """``parse_spec(spec).full()``: every option at its value (so ``{name: softmax}`` equals
    ``{name: softmax, dropout: 0.0}``); a spec that does not parse comes back as given."""
    try:
        return parse_spec(spec).full()
    except ValueError:
        return dict(_as_mapping(spec) or {})


def build_attention(
    spec: AttentionSpec | ParsedSpec = None,
    *,
    head_dim: int,
    num_heads: int,
    causal_queries: bool = False,
    role: str = "encoder",
    layer: int | None = None,
    **options: Any,
) -> nn.Module:
    """Build the backend a spec names for heads of size ``head_dim``.

    ``spec`` is a ``ParsedSpec`` (built from as it is), or what ``parse_spec`` takes: a
    mapping ``{name: rmfa, kernel: exp, ...}`` as in ``configs/attention/``, a bare backend
    name, or None (softmax), with keyword ``options`` added, so ``build_attention("rmfa",
    head_dim=16, num_heads=4, pre_sbn=True)`` works too. ``PPSBNAttention`` wraps the
    backend when either of ``pre_sbn``, ``post_sbn`` is on; with pre-SBN, a backend that
    takes ``bounded_inputs`` gets True. ``causal_queries`` is the model's to set: queries
    causal although the call is not (decoder cross-attention), which ppSBN's
    ``sbn_train_stats: auto`` then respects. ``role`` (``encoder``, ``decoder`` or
    ``cross``) and ``layer`` (the encoder layer) are the model's too: ``prefix`` (prefix
    sums in an encoder, ``PrefixAttention``, inside ppSBN) acts in an encoder's
    self-attention only, one value or one per layer.
    """
    if head_dim < 1 or num_heads < 1:
        raise ValueError(f"head_dim and num_heads must be >= 1; got {head_dim}, {num_heads}")
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}; got {role!r}")
    parsed = parse_spec(spec, check_types=False, **options)
    if parsed.prefix not in ("none", None) and role != "encoder":
        raise ValueError(
            f"prefix acts in an encoder's self-attention only, not in {role} attention (a "
            "decoder is causal already; cross-attention has no order between queries and "
            "keys): put it in encoder_attention"
        )
    direction = resolve_prefix(parsed.prefix, layer) if role == "encoder" else "none"
    backend = BACKENDS[parsed.name](head_dim=head_dim, num_heads=num_heads, **parsed.options)
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


def check_attention_spec(
    spec: dict[str, Any] | ParsedSpec | None,
    *,
    head_dim: int,
    num_heads: int,
    where: str = "attention",
    roles: tuple[str, ...] = ("encoder",),
    num_layers: int | None = None,
) -> None:
    """Raise ``ValueError`` (prefixed by ``where``) if ``spec``, a ``ParsedSpec`` or a
    mapping as in ``configs/attention/``, would not build: ``parse_spec``'s checks, then
    the constructors' range checks by one trial build for this head shape, with the global
    random state saved and restored, so a seeded run draws the same weights. ``roles``:
    where the model builds it (``ROLES``); ``num_layers``: its encoder's depth (a
    per-layer ``prefix``)."""
    if spec is None:
        return
    if not isinstance(spec, (dict, ParsedSpec)):
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
                    parsed, head_dim=head_dim, num_heads=num_heads, role=role, layer=layer
                )
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def describe_backends() -> str:
    """Every backend's options with their types and defaults, for ``--help``."""

    def line(cls: type, key: str, param: inspect.Parameter) -> str:
        hint = _hints(cls).get(key)
        kind = _describe(hint) if hint is not None else "any"
        return f"{key}={param.default!r} ({kind})"

    rows = [
        f"  {name}: " + ", ".join(line(cls, k, p) for k, p in _parameters(cls).items())
        for name, cls in BACKENDS.items()
    ]
    wrapper = ", ".join(line(PPSBNAttention, k, p) for k, p in sbn_options().items())
    around = ", ".join(line(PrefixAttention, k, p) for k, p in prefix_options().items())
    return "\n".join(
        ["attention: {name: <backend>, <option>: <value>, ...}; backends and options:", *rows]
        + [f"  any backend, wrapped in ppSBN: {wrapper}"]
        + [f"  any backend, in an encoder's self-attention: {around} (a value or one per layer)"]
        + [f"  kernels: {', '.join(KERNELS)} (attention.register_kernel adds more)"]
    )
