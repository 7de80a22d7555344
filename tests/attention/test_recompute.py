"""``recompute: true`` on the feature-map backends: the backward pass computes the features
again instead of keeping them, with the same numbers, and keeps little more than q, k, v."""

from __future__ import annotations

import pytest
import torch

from macformer_lit.attention import build_attention

B, H, N, D = 2, 2, 37, 8


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, D, generator=g) for _ in range(3))
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[1, 30:] = False
    return q, k, v, mask


def _run(spec, causal, recompute):
    torch.manual_seed(0)
    attn = build_attention({**spec, "recompute": recompute}, head_dim=D, num_heads=H).train()
    q, k, v, mask = (t.clone().requires_grad_(t.is_floating_point()) for t in _inputs())
    out = attn(q, k, v, key_padding_mask=mask, causal=causal)
    (out * mask[:, None, :, None]).square().sum().backward()
    params = [p.grad for p in attn.parameters()]
    return out.detach(), q.grad, k.grad, v.grad, params


SPECS = [
    {"name": "rmfa", "num_features": 16, "chunk_size": 8},
    {"name": "rmfa", "num_features": 16, "chunk_size": 8, "pre_sbn": True, "post_sbn": True},
    {"name": "favor", "num_features": 16, "chunk_size": 8},
    {"name": "linear", "chunk_size": 8},
]


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize(
    "spec", SPECS, ids=lambda s: s["name"] + ("-ppsbn" if "pre_sbn" in s else "")
)
def test_recompute_gives_the_same_outputs_and_gradients(spec, causal):
    kept, again = _run(spec, causal, False), _run(spec, causal, True)
    for a, b in zip(kept[:4], again[:4]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same operations, in order
    for a, b in zip(kept[4], again[4]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _saved_bytes(recompute: bool, causal: bool, **sbn) -> int:
    torch.manual_seed(0)
    attn = build_attention(
        {"name": "rmfa", "num_features": 64, "recompute": recompute, **sbn},
        head_dim=D,
        num_heads=H,
    ).train()
    q, k, v, mask = (t.clone().requires_grad_(t.is_floating_point()) for t in _inputs())
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attn(q, k, v, key_padding_mask=mask, causal=causal)
    return sum(seen.values())


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_recompute_keeps_only_the_inputs(causal):
    inputs = 3 * B * H * N * D * 4 + B * N  # q, k, v in float32 and the bool mask
    lean, full = _saved_bytes(True, causal), _saved_bytes(False, causal)
    assert lean <= inputs, (lean, inputs)
    # Without it the layer keeps the feature matrices (D' = 64 + rows per degree >> d = 8).
    assert full > 4 * inputs, (full, inputs)


def test_recompute_with_ppsbn_keeps_its_inputs_and_pre_sbn_rows():
    """Around RMFA with ``recompute: true``, ppSBN keeps pre-SBN's normalised q and k (their
    own backward needs them; the recomputation reads them) and v, one checkpoint over the
    core and post-SBN: not post-SBN's input and log|y|, which autograd keeps otherwise."""
    sbn = {"pre_sbn": True, "post_sbn": True}
    act = B * H * N * D * 4  # one float32 activation
    rows = 2 * B * H * N * 4 + 2 * B * N * 4  # ‖z‖ of q and k, their real-row weights
    lean, full = _saved_bytes(True, False, **sbn), _saved_bytes(False, False, **sbn)
    assert lean <= 3 * act + rows + B * N, (lean, act)
    assert full > 4 * lean, (full, lean)
