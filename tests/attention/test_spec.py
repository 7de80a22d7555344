"""``check_attention_spec``: the parse-time check of attention specs (the CLI's use of it
is tested in tests/cli/test_cli.py)."""

import pytest
import torch

from macformer_lit.attention.spec import check_attention_spec


@pytest.mark.parametrize(
    "spec",
    [
        None,
        {"name": "softmax"},
        {"name": "rmfa", "kernel": "exp", "num_features": 8, "p": 2, "pre_sbn": True},
        {"name": "rmfa", "kernel": "inv", "pre_sbn": True, "post_sbn": True, "sbn_eps": 1e-13},
        {"name": "favor", "num_features": 8, "row_norm": "sqrt", "denominator": "clamp"},
        {"name": "linear", "pre_sbn": True, "temperature_max": None},
        {"name": "kernelized", "post_sbn": True},
    ],
)
def test_valid_specs_pass(spec):
    check_attention_spec(spec, head_dim=8, num_heads=2)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("rmfa", "attention must be a mapping like {name: rmfa, kernel: exp}; got 'rmfa'"),
        ({"kernel": "exp"}, "has no 'name'"),
        ({"name": "rmfa", "p": "two"}, "option p='two' of attention backend 'rmfa' must be float"),
        ({"name": "rmfa", "pre_sbn": "yes"}, "option pre_sbn='yes' of attention backend 'rmfa'"),
        ({"name": "rmfa", "num_features": 8.5}, "num_features=8.5 of attention backend 'rmfa'"),
        ({"name": "rmfa", "num_features": True}, "num_features=True of attention backend"),
        ({"name": "rmfa", "p": 1.0}, "p must be > 1"),
        ({"name": "rmfa", "sbn_eps": 1e-9}, "act inside pre-SBN: set pre_sbn: true"),
        ({"name": "linear", "temperature_max": "hot", "pre_sbn": True}, "must be float or null"),
    ],
)
def test_bad_specs_name_the_problem(spec, message):
    with pytest.raises(ValueError, match="^attention") as err:
        check_attention_spec(spec, head_dim=8, num_heads=2)
    assert message in str(err.value)


def test_the_check_leaves_the_global_random_state_alone():
    # Building RMFA draws random features; a seeded run must still draw the same weights.
    torch.manual_seed(0)
    before = torch.get_rng_state()
    check_attention_spec({"name": "rmfa", "num_features": 64}, head_dim=16, num_heads=2)
    check_attention_spec({"name": "favor", "num_features": 64}, head_dim=16, num_heads=2)
    assert torch.equal(torch.get_rng_state(), before)
