"""Prefix attention in an encoder (the SchoenbAt release's cumsum), the uniform control, and
the release's other items as options: each against its float64 reference, its direction
checked by perturbing keys on the wrong side, and every bad combination one clear error."""

from __future__ import annotations

import pytest
import torch

from macformer_lit.attention import BACKENDS, PrefixAttention, build_attention
from macformer_lit.attention.reference import reference_forward
from macformer_lit.attention.spec import check_attention_spec, full_spec
from macformer_lit.models.classifier import EncoderClassifier
from macformer_lit.models.seq2seq import Seq2SeqTransformer

D, H = 8, 2


def _inputs(B=2, N=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (0.5 * torch.randn(B, H, N, D, generator=g, dtype=torch.float64) for _ in "qkv")
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[-1, N - 3 :] = False
    return q, k, v, mask


def _small(name):
    return {"num_features": 16} if name in ("rmfa", "favor") else {}


@pytest.mark.parametrize("sbn", [False, True], ids=["bare", "ppsbn"])
@pytest.mark.parametrize("direction", ["forward", "backward", "split"])
@pytest.mark.parametrize("name", list(BACKENDS))
def test_prefix_matches_reference(name, direction, sbn):
    torch.manual_seed(0)
    extra = {"pre_sbn": True, "post_sbn": True} if sbn else {}
    attn = build_attention(
        name, head_dim=D, num_heads=H, prefix=direction, **_small(name), **extra
    ).double()
    q, k, v, mask = _inputs()
    outs = []
    for fn in (lambda *a, **kw: reference_forward(attn, *a, **kw), attn):
        q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
        out = fn(q_, k_, v_, key_padding_mask=mask, query_padding_mask=mask)
        out = out * mask[:, None, :, None]
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        outs.append((out.detach(), q_.grad, k_.grad, v_.grad))
    for expected, actual, what in zip(*outs, ("out", "dq", "dk", "dv")):
        torch.testing.assert_close(actual, expected, rtol=1e-7, atol=1e-9, msg=what)


@pytest.mark.parametrize("name", ["softmax", "rmfa", "uniform"])
def test_each_direction_sees_only_its_side(name):
    """Changing keys and values after position i changes nothing at i going forward, and
    changing them before i nothing going backward; split heads go one way each."""
    torch.manual_seed(0)
    q, k, v, _ = _inputs(B=1, N=10)
    i = 4
    later_k, later_v = k.clone(), v.clone()
    later_k[:, :, i + 1 :] += 1.0
    later_v[:, :, i + 1 :] -= 2.0
    earlier_k, earlier_v = k.clone(), v.clone()
    earlier_k[:, :, :i] += 1.0
    earlier_v[:, :, :i] -= 2.0
    for direction, same_after, same_before in (
        ("forward", [0, 1], []),
        ("backward", [], [0, 1]),
        ("split", [0], [1]),
    ):
        attn = build_attention(name, head_dim=D, num_heads=H, prefix=direction, **_small(name))
        attn = attn.double().eval()
        base = attn(q, k, v)
        after = attn(q, later_k, later_v)
        before = attn(q, earlier_k, earlier_v)
        for h in range(H):
            changed_after = not torch.allclose(after[:, h, i], base[:, h, i])
            changed_before = not torch.allclose(before[:, h, i], base[:, h, i])
            assert changed_after == (h not in same_after), (direction, h, "after")
            assert changed_before == (h not in same_before), (direction, h, "before")


def _encoder(num_layers, prefix):
    return EncoderClassifier(
        vocab_size=12, num_classes=3, max_len=16, pad_id=0, d_model=16, num_heads=2,
        num_layers=num_layers, ffn_dim=16, attention={"name": "softmax", "prefix": prefix},
    )  # fmt: skip


def test_per_layer_prefix_and_its_length():
    model = _encoder(2, ["forward", "none"])
    backends = [block.attn.backend for block in model.encoder.blocks]
    assert isinstance(backends[0], PrefixAttention) and backends[0].direction == "forward"
    assert not isinstance(backends[1], PrefixAttention)
    with pytest.raises(ValueError, match="one value per layer"):
        _encoder(3, ["forward", "none"])
    with pytest.raises(ValueError, match="one value per layer"):
        check_attention_spec(
            {"name": "softmax", "prefix": ["forward"]}, head_dim=8, num_heads=2, num_layers=2
        )


def test_ppsbn_keeps_bidirectional_batch_statistics_around_a_prefix():
    """The release standardises q and k without regard to the prefix: in training, ppSBN
    around a prefix core uses this batch's statistics (a causal call would use the running
    estimates), and they equal those of the bidirectional attention."""
    torch.manual_seed(0)
    q, k, v, mask = _inputs()
    stats = []
    for prefix in ("forward", "none"):
        attn = (
            build_attention(
                "rmfa", head_dim=D, num_heads=H, num_features=16, pre_sbn=True, prefix=prefix
            )
            .double()
            .train()
        )
        attn(q, k, v, key_padding_mask=mask, query_padding_mask=mask)
        stats.append(attn.running_mean.clone())
    torch.testing.assert_close(stats[0], stats[1])
    assert not torch.equal(stats[0], torch.zeros_like(stats[0]))


@pytest.mark.parametrize(
    "spec,role,match",
    [
        ({"name": "softmax", "prefix": "forward"}, "decoder", "encoder's self-attention only"),
        ({"name": "rmfa", "prefix": "backward"}, "cross", "put it in encoder_attention"),
        ({"name": "softmax", "prefix": "sideways"}, "encoder", "'forward', 'backward', 'split'"),
        ({"name": "softmax", "prefix": ["forward", "up"]}, "encoder", "a list of"),
        ({"name": "uniform", "num_features": 64}, "encoder", "no option.*num_features"),
        ({"name": "softmax", "post_sbn_power": False}, "encoder", "set post_sbn: true"),
        ({"name": "rmfa", "denominator_floor": "half"}, "encoder", "denominator_floor"),
    ],
)
def test_bad_combinations_are_one_line(spec, role, match):
    with pytest.raises(ValueError, match=match) as err:
        check_attention_spec(spec, head_dim=8, num_heads=2, roles=(role,))
    assert "\n" not in str(err.value)


def test_split_needs_two_heads():
    with pytest.raises(ValueError, match="at least 2 heads"):
        build_attention("softmax", head_dim=8, num_heads=1, prefix="split")


def test_a_list_outside_an_encoder_layer_is_refused():
    with pytest.raises(ValueError, match="give one value instead"):
        build_attention("softmax", head_dim=8, num_heads=2, prefix=["forward", "none"])


def test_seq2seq_takes_prefix_in_its_encoder_only():
    sizes = dict(
        vocab_size=11,
        max_len=12,
        pad_id=0,
        bos_id=1,
        eos_id=2,
        d_model=16,
        num_heads=2,
        num_encoder_layers=1,
        num_decoder_layers=1,
        ffn_dim=16,
    )
    with pytest.raises(ValueError, match="put it in encoder_attention"):
        Seq2SeqTransformer(**sizes, attention={"name": "softmax", "prefix": "forward"})
    model = Seq2SeqTransformer(**sizes, encoder_attention={"name": "softmax", "prefix": "forward"})
    assert isinstance(model.encoder.blocks[0].attn.backend, PrefixAttention)


def test_full_spec_records_the_prefix():
    assert full_spec({"name": "softmax"})["prefix"] == "none"
    assert full_spec({"name": "uniform", "prefix": "split"})["prefix"] == "split"


def test_absolute_denominator_floor_clamps_at_eps():
    """The release's clamp_min(1): rows whose denominator is below 1 are divided by 1."""
    torch.manual_seed(0)
    q, k, v, mask = _inputs(N=12)
    attn = build_attention(
        "rmfa",
        head_dim=D,
        num_heads=H,
        num_features=16,
        denominator="clamp",
        denominator_eps=1.0,
        denominator_floor="absolute",
        prefix="forward",
    ).double()
    out = attn(q, k, v, key_padding_mask=mask)
    torch.testing.assert_close(out, reference_forward(attn, q, k, v, key_padding_mask=mask))
    per_key = build_attention(
        "rmfa",
        head_dim=D,
        num_heads=H,
        num_features=16,
        denominator="clamp",
        denominator_eps=1.0,
        prefix="forward",
    ).double()
    per_key.load_state_dict(attn.state_dict())
    assert not torch.allclose(per_key(q, k, v, key_padding_mask=mask), out)


@pytest.mark.parametrize("power", [True, False])
def test_shared_gamma_post_sbn(power):
    torch.manual_seed(0)
    attn = build_attention(
        "softmax",
        head_dim=D,
        num_heads=H,
        post_sbn=True,
        post_sbn_gamma="shared",
        post_sbn_power=power,
    ).double()
    assert attn.gamma.shape == (1, 1, D)
    assert hasattr(attn, "log_beta") == power
    with torch.no_grad():
        attn.gamma.uniform_(0.5, 1.5)
        if power:
            attn.log_beta.uniform_(-0.3, 0.3)
    q, k, v, mask = _inputs()
    out = attn(q, k, v, key_padding_mask=mask)
    torch.testing.assert_close(out, reference_forward(attn, q, k, v, key_padding_mask=mask))
    out.sum().backward()
    assert attn.gamma.grad.shape == (1, 1, D)
    # A shared γ's gradient is the sum of what per-head γs would get.
    per_head = build_attention(
        "softmax", head_dim=D, num_heads=H, post_sbn=True, post_sbn_power=power
    ).double()
    with torch.no_grad():
        per_head.gamma.copy_(attn.gamma.expand(H, 1, D))
        if power:
            per_head.log_beta.copy_(attn.log_beta.expand(H, 1, D))
    per_head(q, k, v, key_padding_mask=mask).sum().backward()
    torch.testing.assert_close(attn.gamma.grad, per_head.gamma.grad.sum(0, keepdim=True))


def test_uniform_keeps_q_and_k_in_the_graph_with_zero_gradients():
    q, k, v, mask = _inputs()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    attn = build_attention("uniform", head_dim=D, num_heads=H)
    attn(q, k, v, key_padding_mask=mask).sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q)) and torch.equal(k.grad, torch.zeros_like(k))
    assert v.grad.abs().sum() > 0
