"""Config keys that have moved, read at their new place: the one table and the one migration.

The standard callbacks had five groups before they were gathered under ``callbacks:``
(callbacks/standard.py): ``nan_guard``, ``memory``, ``redraw`` and ``telemetry``, and
``run_callbacks`` with one flag per callback and two settings. Runs recorded before hold
them in ``config.yaml`` (and in their checkpoints), and command lines and config files may
still use them. ``migrate_args`` rewrites a command line and ``migrate_config`` a config
mapping; each also returns what moved (``old → new``), for the CLI's one-line note. Every
reader of a saved config goes through ``migrate_config`` (``provenance.effective_config``,
``checkpoints.saved_run_config``), so an old and a new run that mean the same compare equal.

Pure Python, no torch: ``report`` and ``sweep`` read configs through it.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

NEW = "callbacks"
# Groups that became an entry of the same name.
GROUPS = ("nan_guard", "memory", "redraw", "telemetry")
OLD = "run_callbacks"
# run_callbacks' flags, each now an entry of the same name (false: switched off).
FLAGS = (
    "best_checkpoint",
    "last_checkpoint",
    "save_on_sigterm",
    "metrics_rows",
    "rng_states",
    "lr_monitor",
    "throughput",
)
# run_callbacks' settings, now in the settings of the entry they tune.
SETTINGS = {
    "save_top_k": ("best_checkpoint", "save_top_k"),
    "lr_logging_interval": ("lr_monitor", "logging_interval"),
}
SUBCOMMANDS = ("fit", "validate", "test", "predict")


def new_key(old: str) -> str | None:
    """Where the dotted ``old`` key lives now; None for a key that has not moved (or that
    was never one: an unknown ``run_callbacks`` key stays, to be refused as given)."""
    group, _, rest = old.partition(".")
    if group in GROUPS:
        return f"{NEW}.{old}"
    if group != OLD or not rest:
        return None
    head, _, tail = rest.partition(".")
    if head in FLAGS and not tail:
        return f"{NEW}.{head}"
    if head in SETTINGS and not tail:
        return f"{NEW}.{'.'.join(SETTINGS[head])}"
    return None


def migrate_config(config: Any) -> tuple[Any, list[tuple[str, str]]]:
    """``config`` (a run's settings, or a file of subcommand sections) with the old keys
    at their new place, a new mapping, and the ``(old, new)`` moves; a config without old
    keys comes back as it was. A switched-off entry drops the settings ``run_callbacks``
    gave it, as it ignored them; keys that cannot move stay to be refused as given."""
    if not isinstance(config, dict):
        return config, []
    moves: list[tuple[str, str]] = []
    out = dict(config)
    for sub in SUBCOMMANDS:
        if isinstance(out.get(sub), dict):
            out[sub], inner = migrate_config(out[sub])
            moves += inner
    if not any(k in out for k in (*GROUPS, OLD)):
        return out, moves
    group = out.get(NEW)
    group = copy.deepcopy(group) if isinstance(group, dict) else {}
    for name in GROUPS:
        if name not in out:
            continue
        value = out.pop(name)
        if isinstance(value, dict) and isinstance(group.get(name), dict):
            group[name] = {**group[name], **copy.deepcopy(value)}
        else:
            group[name] = copy.deepcopy(value)
        moves.append((name, f"{NEW}.{name}"))
    old = out.get(OLD)
    if isinstance(old, dict):
        kept = {}
        for key, value in old.items():
            if key in FLAGS:
                moves.append((f"{OLD}.{key}", f"{NEW}.{key}"))
                if value is False or not isinstance(group.get(key), dict):
                    group[key] = value
            elif key in SETTINGS:
                entry, setting = SETTINGS[key]
                moves.append((f"{OLD}.{key}", f"{NEW}.{entry}.{setting}"))
                if old.get(entry) is not False:
                    current = group.get(entry)
                    current = current if isinstance(current, dict) else {}
                    group[entry] = {**current, setting: value}
            else:
                kept[key] = value
        if kept:
            out[OLD] = kept
        else:
            del out[OLD]
    if group or NEW in out:
        out[NEW] = group
    return out, moves


def migrate_change(key: str, value: Any) -> list[tuple[str, Any]]:
    """A recorded change of the dotted ``key`` to ``value`` as the changes it makes now:
    itself, or for an old key, those at its new place."""
    if key.split(".")[0] not in (*GROUPS, OLD):
        return [(key, value)]
    for part in reversed(key.split(".")):
        value = {part: value}
    moved, _ = migrate_config(value)
    return list(_leaves(moved))


def _leaves(mapping: dict, prefix: str = ""):
    for key, value in mapping.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def migrate_args(argv: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """A command line with its old options (``--nan_guard.action skip``,
    ``--run_callbacks.save_top_k=3``, ``--run_callbacks '{lr_monitor: false}'``) at their
    new place, and the moves. As ``run_callbacks`` had them, on one command line a flag
    switched off drops its entry's settings, and ``true`` keeps them."""
    options = list(_options(argv))
    flags = {k: _yaml(v) for _, k, v, _ in options if k.startswith(f"{OLD}.")}
    tuned = {SETTINGS[k.split(".")[1]][0] for k in flags if k.split(".")[1] in SETTINGS}
    out: list[str] = []
    moves: list[tuple[str, str]] = []
    done = 0
    for i, key, value, step in options:
        out += argv[done:i]
        done = i + step
        if key == OLD:
            # The whole group inline: each of its keys as an option of its own.
            new, inner = migrate_config({OLD: _yaml(value)})
            if OLD in new:
                out += argv[i : i + step]  # not a mapping of known keys: refused as given
                continue
            moves += inner
            for name, setting in new[NEW].items():
                out += [f"--{NEW}.{name}", _flow(setting)]
            continue
        target = new_key(key)
        if target is None:
            out += argv[i : i + step]
            continue
        moves.append((f"--{key}", f"--{target}"))
        entry = target.split(".")[1]
        if key.startswith(f"{OLD}."):
            if target.count(".") == 2 and flags.get(f"{OLD}.{entry}") is False:
                continue
            if entry in tuned and flags.get(key) is True:
                continue
        out += [f"--{target}={value}"] if "=" in argv[i] else [f"--{target}", value]
    out += argv[done:]
    return out, moves


def _options(argv: list[str]):
    """``(index, key, value, tokens)`` of each ``--key value`` or ``--key=value`` whose key
    is or was under an old group."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        key, eq, inline = arg[2:].partition("=")
        old = arg.startswith("--") and key.split(".")[0] in (*GROUPS, OLD)
        if old and eq:
            yield i, key, inline, 1
        elif old and i + 1 < len(argv):
            yield i, key, argv[i + 1], 2
            i += 1
        i += 1


def _yaml(text: str | None) -> Any:
    try:
        return yaml.safe_load(text) if text is not None else None
    except yaml.YAMLError:
        return text


def _flow(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...")


def describe(moves: list[tuple[str, str]]) -> str:
    """The moves as one line, each once, ``run_callbacks``' flags together at the end."""
    parts: list[str] = []
    flags: dict[str, list[str]] = {}
    for old, new in dict.fromkeys(moves):
        dashes, _, name = old.rpartition(f"{OLD}.")
        if name in FLAGS and dashes in ("", "--"):
            flags.setdefault(dashes, []).append(name)
        else:
            parts.append(f"{old} → {new}")
    for dashes, names in flags.items():
        listed = names[0] if len(names) == 1 else "{" + ",".join(names) + "}"
        parts.append(f"{dashes}{OLD}.{listed} → {dashes}{NEW}.{listed}")
    return ", ".join(parts)
