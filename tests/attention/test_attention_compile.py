"""Every backend (bare and ppSBN-wrapped) compiles as one graph, forward and backward, with
no host synchronisation, and five sequence lengths cost one dynamic compile, not five.

``aot_eager`` traces forward and backward exactly as inductor would receive them (AOTAutograd)
without generating code, so the test sees graph breaks (``fullgraph=True`` raises on one) and
recompiles; the compiled results equal eager ones. Tracing a backend takes 10-50 s on a
2-core CPU, so the default run covers Macformer (RMFA + ppSBN) and softmax, both ways;
``-m slow`` runs every backend."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from macformer_lit.attention import BACKENDS, build_attention

LENGTHS = (9, 13, 16, 23, 30)
H, D = 2, 8
# The default run: Macformer (RMFA + ppSBN) bidirectional, softmax both ways; causal
# Macformer (ppSBN's running statistics and RMFA's chunked path together) is the
# slowest case, in -m slow.
DEFAULT = {
    ("rmfa", True, False),
    ("softmax", False, False),
    ("softmax", False, True),
}
# Known defects under aot_eager, kept visible (strict xfail: a fix shows up as XPASS): none at
# present (inductor's, on causal ppSBN, is the strict xfail at the end of this file). Fixed:
# causal ppSBN in training, whose query gradient AOTAutograd gave off by up to 3 % (it
# recomputed a read of the running statistics after their in-place update: ppsbn.py
# ``_update_running`` rebinds them when compiled), and the chunked causal feature-map path
# (a recompile when the length became a multiple of the chunk size, a view error in
# linear's backward: feature_attention.py ``_causal``, linear.py ``_elu1``).
KNOWN_BAD: set[tuple[str, bool, bool]] = set()


def _marks(case):
    marks = [] if case in DEFAULT else [pytest.mark.slow]
    if case in KNOWN_BAD:
        marks.append(pytest.mark.xfail(strict=True, reason="known causal compile defect"))
    return marks


CASES = [
    pytest.param(
        name,
        sbn,
        causal,
        id=f"{name}{'-ppsbn' if sbn else ''}{'-causal' if causal else ''}",
        marks=_marks((name, sbn, causal)),
    )
    for name in BACKENDS
    for sbn in (False, True)
    for causal in (False, True)
]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _build(name: str, sbn: bool, **options):
    if name in ("rmfa", "favor"):
        options["num_features"] = 16
    if name in ("rmfa", "favor", "linear"):
        options["chunk_size"] = 4
    if sbn:
        options.update(pre_sbn=True, post_sbn=True)
    torch.manual_seed(0)
    attn = build_attention(name, head_dim=D, num_heads=H, **options)
    if sbn:
        with torch.no_grad():
            attn.gamma.uniform_(0.5, 1.5)
            attn.log_beta.uniform_(-0.3, 0.3)
    return attn.train()


@pytest.mark.parametrize("name,sbn,causal", CASES)
def test_fullgraph_and_one_dynamic_compile_over_five_lengths(name, sbn, causal):
    _check_compiled_equals_eager(_build(name, sbn), causal)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_recompute_compiles_too(causal):
    """``recompute: true`` (a checkpoint over the core, and over post-SBN too under ppSBN)
    traces as one graph and equals eager, as the plain backends above."""
    _check_compiled_equals_eager(_build("rmfa", True, recompute=True), causal)


def _check_compiled_equals_eager(attn, causal):
    counter = CompileCounterWithBackend("aot_eager")

    def step(q, k, v, mask):
        return attn(q, k, v, key_padding_mask=mask, query_padding_mask=mask, causal=causal)

    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    compiles = []
    for i, n in enumerate(LENGTHS):
        g = torch.Generator().manual_seed(i)
        q, k, v = (torch.randn(2, H, n, D, generator=g) for _ in range(3))
        mask = torch.ones(2, n, dtype=torch.bool)
        mask[1, n - 3 :] = False
        real = mask[:, None, :, None]
        results = []
        state = {key: b.clone() for key, b in attn.named_buffers()}
        for fn in (compiled, step):
            # Same running statistics for both (ppSBN moves them in training).
            for key, buf in attn.named_buffers():
                buf.copy_(state[key])
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            out = fn(*inputs, mask) * real
            out.square().sum().backward()
            moved = [b.clone() for _, b in attn.named_buffers()]  # after the update
            results.append((out.detach(), *(t.grad for t in inputs), *moved))
        names = ("out", "dq", "dk", "dv", *(f"buffer {key}" for key in state))
        for a, b, what in zip(*results, names):
            torch.testing.assert_close(
                a, b, rtol=1e-4, atol=1e-5, msg=lambda m, what=what: f"{what}: {m}"
            )
        compiles.append(counter.frame_count)
    # The first length compiles (dynamic shapes from the start); later lengths reuse it.
    assert compiles[0] >= 1 and compiles[1:] == [compiles[0]] * (len(LENGTHS) - 1), compiles


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="known: inductor differs from eager here (cause not found)")
@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor on the CPU needs a C++ compiler")
def test_causal_ppsbn_training_under_inductor_equals_eager():
    """Why CompileModel keeps causal ppSBN decoder blocks eager: with inductor (not aot_eager),
    softmax + ppSBN in causal training, random running statistics and ppSBN parameters, one
    row of the output came out 3e-2 off eager's (2026-11-26, torch 2.13 CPU), while the same
    call traced by aot_eager equals eager exactly (the test above)."""
    torch._dynamo.reset()
    attn = _build("softmax", True)
    with torch.no_grad():
        attn.running_mean.normal_()
        attn.running_var.uniform_(0.5, 2.0)

    def step(q, k, v, mask):
        return attn(q, k, v, key_padding_mask=mask, query_padding_mask=mask, causal=True)

    compiled = torch.compile(step, backend="inductor", fullgraph=True, dynamic=True)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, H, 9, D, generator=g) for _ in range(3))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False
    state = {key: b.clone() for key, b in attn.named_buffers()}
    outs = []
    for fn in (compiled, step):
        for key, buf in attn.named_buffers():
            buf.copy_(state[key])
        outs.append(fn(q, k, v, mask) * mask[:, None, :, None])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-5)
