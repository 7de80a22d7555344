"""Every YAML the package reads, loaded one way: a key repeated in one mapping is refused.

YAML keeps the last of two equal keys without a word: a sweep file whose axis held the label
``0`` twice ran the point labelled ``seed=0`` with the second one's seed. Sweep files,
``--config`` files, inline YAML on the command line (through jsonargparse's loaders,
``preflight.install_parser_loaders``) and the ``config.yaml`` that ``report`` and ``sweep``
read back all go through ``check_unique_keys``; ``describe`` turns any YAML error into one
line naming the source, line and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

MERGE_TAG = "tag:yaml.org,2002:merge"


class DuplicateKeyError(yaml.MarkedYAMLError):
    """A key given twice in one mapping; ``context_mark`` is the first, ``problem_mark`` the
    second."""

    def __init__(self, key: str, first: yaml.Mark, second: yaml.Mark) -> None:
        super().__init__(
            context=f"key {key!r} first given",
            context_mark=first,
            problem=f"key {key!r} given again",
            problem_mark=second,
        )
        self.key = key


def check_unique_keys(text: str) -> None:
    """Raise ``DuplicateKeyError`` at the second of two equal keys in any mapping of
    ``text`` (a YAML syntax error raises ``yaml.YAMLError`` as loading would). Keys merged
    in with ``<<`` may be overridden: only a mapping's own keys count."""
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    stack, seen = [root] if root is not None else [], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:  # aliases can share (or loop back to) a node
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict[tuple, yaml.Mark] = {}
            for key, value in node.value:
                stack += [key, value]
                if key.tag == MERGE_TAG or not isinstance(key, yaml.ScalarNode):
                    continue
                # Resolved tag and text: "1" and 1 are different keys, as YAML has them.
                ident = (key.tag, key.value)
                if ident in first:
                    raise DuplicateKeyError(key.value, first[ident], key.start_mark)
                first[ident] = key.start_mark
        elif isinstance(node, yaml.SequenceNode):
            stack += node.value


def load(text: str) -> Any:
    """``yaml.safe_load`` that refuses a repeated key (``DuplicateKeyError``)."""
    check_unique_keys(text)
    return yaml.safe_load(text)


def load_file(path: str | Path) -> Any:
    return load(Path(path).read_text(encoding="utf-8"))


def describe(err: yaml.YAMLError, source: str) -> str:
    """One line for a YAML error: where (source, line, column), what, and for a repeated
    key the fix."""
    if isinstance(err, DuplicateKeyError):
        first, second = err.context_mark, err.problem_mark
        where, before = f"line {second.line + 1}", f"line {first.line + 1}"
        if first.line == second.line:  # inline YAML: one line, the columns tell them apart
            where += f", column {second.column + 1}"
            before = f"column {first.column + 1}"
        return (
            f"{source}, {where}: key {err.key!r} is given twice in one mapping (first at "
            f"{before}); YAML would silently keep the last one: remove or rename one of them"
        )
    mark = getattr(err, "problem_mark", None)
    where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = getattr(err, "problem", None) or (str(err).splitlines() or ["?"])[0]
    context = getattr(err, "context", None)
    detail = f"{context}: {problem}" if context else problem
    return f"{source}{where}: not valid YAML ({detail})"
