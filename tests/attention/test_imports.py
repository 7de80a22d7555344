"""The attention modules import one way: each loads on its own, nothing imports inside a
function to dodge a circle, and the references import none of the modules they check."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "macformer_lit" / "attention"
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
# What reference.py checks, directly or as the backends' shared core and wrappers.
CHECKED = (
    "feature_attention",
    "products",
    "ppsbn",
    "eager_sbn",
    "prefix",
    "registry",
    "spec",
    "rmfa",
    "favor",
)


def _package_imports(path: Path) -> tuple[set[str], list[str]]:
    """(the package modules ``path`` imports at top level, those it imports in a function)."""
    tree = ast.parse(path.read_text())
    top, nested = set(), []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.ImportFrom) and node.level == 1):
            continue
        names = [node.module] if node.module else [a.name for a in node.names]
        if node in tree.body:
            top.update(names)
        else:
            nested += names
    return top, nested


def test_no_package_import_inside_a_function():
    for name in MODULES + ["__init__"]:
        _, nested = _package_imports(PACKAGE / f"{name}.py")
        assert not nested, f"{name}.py imports {nested} inside a function"


def test_the_import_graph_has_no_circle():
    graph = {name: _package_imports(PACKAGE / f"{name}.py")[0] for name in MODULES}
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, "import circle: " + " -> ".join((*path, name))
        if name in done:
            return
        for dep in graph.get(name, ()):
            visit(dep, (*path, name))
        done.add(name)

    for name in MODULES:
        visit(name, ())


def test_each_module_loads_alone_and_reference_alone_loads_none_it_checks():
    """In a fresh interpreter, with the package's ``__init__`` (which imports every
    backend) replaced by an empty package, each module imports with only its own
    dependencies; ``reference`` brings none of the modules it checks."""
    script = textwrap.dedent(
        f"""
        import importlib, sys, types
        import torch  # noqa: F401  (loaded once for all modules)
        import macformer_lit

        def fresh():
            for key in [k for k in sys.modules if k.startswith("macformer_lit.attention")]:
                del sys.modules[key]
            stub = types.ModuleType("macformer_lit.attention")
            stub.__path__ = [{str(PACKAGE)!r}]
            sys.modules["macformer_lit.attention"] = stub

        for name in {MODULES!r}:
            fresh()
            importlib.import_module("macformer_lit.attention." + name)
        fresh()
        importlib.import_module("macformer_lit.attention.reference")
        loaded = sorted(k.rsplit(".", 1)[1] for k in sys.modules
                        if k.startswith("macformer_lit.attention."))
        print(" ".join(loaded))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = proc.stdout.split()
    assert "reference" in loaded
    assert not set(loaded) & set(CHECKED), loaded
    assert set(loaded) <= {"reference", "features", "kernels", "pieces"}, loaded
