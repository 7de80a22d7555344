"""Check an attention spec from a config before anything is built or loaded.

The CLI calls ``check_attention_spec`` on every ``*attention`` argument of the model right
after parsing, so a wrong backend, option, type, choice or range stops the run at parse
time with the valid choices, before data is read or a model is built:

1. the backend name and option names (``build_attention``'s own messages);
2. each option's type and choices against the constructor's annotations (``Literal``
   choices listed);
3. the backends' own range checks (``num_features >= 1``, ``p > 1``, restricted kernels
   without pre-SBN, ...), by building the backend once for the model's head size with the
   global random state saved and restored, so a seeded run draws the same weights.
"""

from __future__ import annotations

import inspect
import types
import typing
from typing import Any, Literal, Union

import torch

from . import _PRE_SBN_OPTIONS as PRE_SBN_OPTIONS
from . import BACKENDS, PPSBNAttention, build_attention

_COMMON: dict[str, Any] = {"pre_sbn": bool, "post_sbn": bool}


def _hints(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls.__init__)
    params = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in hints.items() if k in params and k not in ("head_dim", "num_heads")}


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "one of: " + ", ".join(repr(a) for a in typing.get_args(hint))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "null"
    return getattr(hint, "__name__", str(hint))


def _fits(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
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


def _check_types(name: str, options: dict[str, Any], where: str) -> None:
    hints = {**_COMMON, **_hints(BACKENDS[name])}
    sbn_hints = _hints(PPSBNAttention)
    hints.update({key: sbn_hints[arg] for key, arg in PRE_SBN_OPTIONS.items()})
    for key, value in options.items():
        hint = hints.get(key)
        if hint is None or _fits(value, hint):
            continue
        raise ValueError(
            f"{where}: option {key}={value!r} of attention backend {name!r} must be "
            f"{_describe(hint)}"
        )


def as_spec(spec: dict[str, Any] | str | None) -> dict[str, Any] | None:
    """A bare backend name (``attention: rmfa`` in a config) means ``{name: rmfa}``."""
    return {"name": spec} if isinstance(spec, str) else spec


def check_attention_spec(
    spec: dict[str, Any] | None, *, head_dim: int, num_heads: int, where: str = "attention"
) -> None:
    """Raise ``ValueError`` naming the problem if ``spec`` (``{name: ..., **options}``, as
    in ``configs/attention/``) would not build; ``where`` prefixes the message."""
    if spec is None:
        return
    if not isinstance(spec, dict):
        raise ValueError(
            f"{where} must be a mapping like {{name: rmfa, kernel: exp}}; got {spec!r}"
        )
    options = dict(spec)
    name = options.pop("name", None)
    if name is None:
        raise ValueError(
            f"{where} {spec} has no 'name'; give e.g. {{name: softmax}} or compose a file "
            "from configs/attention/"
        )
    if name in BACKENDS:
        _check_types(name, options, where)
    try:
        with torch.random.fork_rng(devices=[]):
            build_attention(name, head_dim=head_dim, num_heads=num_heads, **options)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
