"""Config lookup: a ``--config`` value is a file, or a config shipped in ``configs/``.

``resolve_config_args`` rewrites every ``--config NAME`` of a command line to a path (an
old name gets one line naming the new one) and returns the config stems, which name the
experiment by default (``config_stem``).
"""

from __future__ import annotations

from pathlib import Path

from macformer_lit.preflight import check_config_file

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


class ConfigNotFound(SystemExit):
    pass


def task_configs() -> list[str]:
    """The shipped configs that name a model and data (the others are overlays)."""
    return sorted(
        p.name for p in CONFIG_DIR.glob("*.yaml") if "class_path:" in p.read_text(errors="replace")
    )


def shipped_configs() -> list[str]:
    return sorted(str(p.relative_to(CONFIG_DIR)) for p in CONFIG_DIR.rglob("*.yaml"))


# Shipped configs that were renamed: the old name gets one line saying what to write.
RENAMED_CONFIGS = {
    "lra_listops_cpu.yaml": "listops_short_cpu.yaml (the CPU main job; it trains on short "
    "ListOps trees, so it is no longer named after the LRA task, which is lra_listops.yaml)",
}


def resolve_config(name: str) -> str:
    """A path that exists is used as is; otherwise look in the shipped ``configs/``."""
    if Path(name).is_file():
        return name
    renamed = RENAMED_CONFIGS.get(name) or RENAMED_CONFIGS.get(f"{name}.yaml")
    if renamed:
        raise ConfigNotFound(f"macformer_lit: error: config {name!r} was renamed: use {renamed}")
    for candidate in (CONFIG_DIR / name, CONFIG_DIR / f"{name}.yaml"):
        if candidate.is_file():
            return str(candidate)
    raise ConfigNotFound(
        f"macformer_lit: error: config {name!r} is neither a file nor a config shipped in "
        f"{CONFIG_DIR}.\nShipped configs: {', '.join(shipped_configs())}"
    )


def resolve_config_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Rewrite every ``--config NAME`` / ``-c NAME`` / ``--config=NAME``; also return the
    config stems, which name the experiment by default."""
    out, stems = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        value = None
        if arg in ("--config", "-c") and i + 1 < len(argv):
            value, i = argv[i + 1], i + 1
            out.append(arg)
        elif arg.startswith("--config="):
            value = arg.split("=", 1)[1]
            out.append("--config")
        else:
            out.append(arg)
        if value is not None:
            path = resolve_config(value)
            check_config_file(path)
            out.append(path)
            stems.append(config_stem(path))
        i += 1
    return out, stems


def config_stem(path: str) -> str:
    """The config's part of an experiment name: a shipped config by its place in
    ``configs/`` (``attention/rmfa_exp.yaml`` -> ``attention-rmfa_exp``), any other file by
    its file name alone (``/abs/dir/my.yaml`` -> ``my``)."""
    resolved = Path(path).resolve()
    shipped = CONFIG_DIR.resolve()
    if resolved.is_relative_to(shipped):
        return resolved.relative_to(shipped).with_suffix("").as_posix().replace("/", "-")
    return resolved.stem
