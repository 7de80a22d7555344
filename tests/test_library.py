"""The attention as a library: the README section "Use the attention in your own model" runs
as written and computes what it says, and the public surface of ``macformer_lit`` (its
``__all__``) imports without lightning while ``import macformer_lit`` stays cheap."""

from __future__ import annotations

import contextlib
import copy
import io
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import macformer_lit

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## Use the attention in your own model"
# From tests/attention/test_attention_convergence.py::test_nmse_falls_with_num_features: RMFA
# at D = 2048 on rows of norm d^{1/4} (d = 16, 2 heads, N = 48, causal), the README's setting.
RMFA_2048_BOUND = 1e-2
# The README model's ppSBN'd RMFA core (D = 128, d = 16) against exact exp attention: at most
# 1.9e-3 over torch seeds 0-19 of the section (1.4e-3 at its seed 0), with the 4x margin of
# the convergence tests.
MODEL_NMSE_BOUND = 8e-3


def _section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(HEADING)
    end = text.index("\n## ", start + len(HEADING))
    return text[start:end]


def _blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", _section(), flags=re.DOTALL | re.MULTILINE)


@pytest.fixture(scope="module")
def runs():
    """Run the section's blocks in order in one fresh namespace; per block, a snapshot of the
    namespace after it and what it printed."""
    namespace: dict = {"__name__": "readme_library_section"}
    results = []
    for i, block in enumerate(_blocks()):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block, f"README.md:{HEADING}:block{i}", "exec"), namespace)
        results.append((dict(namespace), out.getvalue()))
    return results


def test_section_sits_before_troubleshooting_and_uses_the_public_surface():
    text = (ROOT / "README.md").read_text()
    assert text.index(HEADING) < text.index("## When something is wrong")
    blocks = _blocks()
    assert len(blocks) == 3
    code = "\n".join(blocks)
    imported = {
        name.strip()
        for names in re.findall(r"^from macformer_lit import (.+)$", code, flags=re.M)
        for name in names.split(",")
    }
    assert imported and imported <= set(macformer_lit.__all__)
    assert not re.search(r"macformer_lit\.\w", code)  # nothing below the package
    for path in re.findall(r"configs/attention/[\w*]+\.yaml", _section()):
        assert list(ROOT.glob(path)), path


def test_drop_in_module_keeps_shapes_and_ignores_padding(runs):
    ns, printed = runs[0]
    y, x, mask = ns["y"], ns["x"], ns["mask"]
    assert printed.strip() == "torch.Size([2, 10, 64])"
    assert y.shape == x.shape == (2, 10, 64) and torch.isfinite(y).all()
    assert mask.tolist() == [[True] * 10, [True] * 7 + [False] * 3]
    # Junk at padded positions changes no real output of the README's model, in training
    # (batch pre-SBN statistics) and in eval (running ones).
    model = ns["model"]
    junk = x.clone()
    junk[1, 7:] = 1e3
    for training in (True, False):
        a, b = copy.deepcopy(model).train(training), copy.deepcopy(model).train(training)
        real = mask[:, :, None].expand_as(x)
        torch.testing.assert_close(a(x, mask)[real], b(junk, mask)[real])


def test_bare_backend_is_causal_and_close_to_exact_attention(runs):
    ns, printed = runs[1]
    q, k, v, out, exact = (ns[n] for n in ("q", "k", "v", "out", "exact"))
    assert q.shape == (2, 2, 48, 16) and out.shape == q.shape
    assert printed.startswith("torch.Size([2, 2, 48, 16]) NMSE ")
    # What it printed is the error of this output against the exact causal exp attention.
    reference = macformer_lit.kernelized_attention(q, k, v, "exp", None, True)
    torch.testing.assert_close(exact, reference, rtol=0, atol=0)
    error = float(macformer_lit.nmse(out, reference))
    assert ns["error"] == error and printed.split()[-1] == f"{error:.1e}"
    assert error < RMFA_2048_BOUND
    # causal: the last key and value reach no earlier query
    k2, v2 = k.clone(), v.clone()
    k2[:, :, -1], v2[:, :, -1] = 5.0, -5.0
    torch.testing.assert_close(ns["rmfa"](q, k2, v2, causal=True)[:, :, :-1], out[:, :, :-1])
    # Macformer's setting (pre- and post-SBN) with padding and causal masking
    assert ns["pad"].sum(1).tolist() == [48, 43]
    assert ns["out_sbn"].shape == q.shape and torch.isfinite(ns["out_sbn"]).all()
    assert type(ns["macformer"]).__name__ == "PPSBNAttention"


def test_redraw_and_error_are_the_callbacks_without_lightning(runs):
    from macformer_lit.callbacks.telemetry import AttentionTelemetry

    ns, printed = runs[2]
    model = ns["model"]
    backends = macformer_lit.random_feature_backends(model)
    assert len(backends) == 1 and len(ns["before"]) == 1
    # The redraw changed the features, and is draw (seed 0, layer 0, index 1) wherever made.
    assert not torch.equal(ns["before"][0], backends[0].omega)
    assert int(backends[0].redraw_index) == 1
    torch.manual_seed(123)
    other = ns["Block"]()
    other_backend = macformer_lit.random_feature_backends(other)[0]
    assert not torch.equal(other_backend.omega, backends[0].omega)
    other_backend.redraw_features(seed=0, layer=0, index=1)
    assert torch.equal(other_backend.omega, backends[0].omega)
    # Every core was measured once, its hook is gone, and the numbers are the telemetry's.
    cores = macformer_lit.attention_cores(model)
    assert [name for name, _ in cores] == ["attn.backend.inner"]
    lines = printed.strip().splitlines()
    assert len(lines) == 1
    _, core = cores[0]
    assert not core._forward_hooks
    (q, k, v), kwargs = ns["seen"][core]
    metrics = AttentionTelemetry().measure(
        core, q, k, v, kwargs.get("key_padding_mask"), kwargs.get("causal", False)
    )
    assert ns["error"] == pytest.approx(metrics["nmse"], rel=1e-9)
    assert ns["uniform"] == pytest.approx(metrics["nmse_uniform"], rel=1e-9)
    assert lines[0] == (
        f"attn.backend.inner NMSE {ns['error']:.1e}, uniform attention {ns['uniform']:.1e}"
    )
    # pre-SBN bounds the core's logits by 1/√d: what the core saw is pre-SBN'd
    assert metrics["logit_max"] <= 16**-0.5 + 1e-6
    assert 0.0 < ns["error"] < MODEL_NMSE_BOUND
    assert ns["uniform"] > 1e-4  # the measurement is not trivially 0


def test_public_surface_imports_without_lightning_and_lazily():
    """In a fresh interpreter: ``import macformer_lit`` loads neither torch nor lightning;
    every name of ``__all__`` then resolves (to the object in its home module) without
    lightning."""
    script = textwrap.dedent(
        """
        import importlib, sys
        import macformer_lit
        assert "torch" not in sys.modules and "lightning" not in sys.modules
        assert set(macformer_lit.__all__) <= set(dir(macformer_lit))
        for name in macformer_lit.__all__:
            value = getattr(macformer_lit, name)
            home = importlib.import_module(macformer_lit._LAZY[name])
            assert value is getattr(home, name), name
        namespace = {}
        exec("from macformer_lit import *", namespace)
        assert set(macformer_lit.__all__) <= set(namespace)
        try:
            macformer_lit.no_such_name
        except AttributeError as err:
            assert "no_such_name" in str(err)
        else:
            raise AssertionError("unknown attribute resolved")
        assert "lightning" not in sys.modules, "the public surface imported lightning"
        print("ok")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_docstring_lists_the_public_surface():
    assert set(macformer_lit._LAZY) == set(macformer_lit.__all__)
    for name in macformer_lit.__all__:
        assert f"``{name}" in macformer_lit.__doc__, name
