"""``ParsedSpec``: the one attention spec value, frozen and complete, parsed once by
``parse_spec`` and built from as it is."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

from macformer_lit.attention import ParsedSpec, PPSBNAttention, build_attention, parse_spec
from macformer_lit.attention import spec as spec_module
from macformer_lit.attention.spec import backend_options, full_spec, sbn_options


@pytest.fixture
def parses(monkeypatch):
    """The number of specs ``parse_spec`` has checked since the fixture was made (a value
    handed back as it is does not count)."""
    count = [0]
    as_mapping = spec_module._as_mapping

    def counting(spec):
        count[0] += 1
        return as_mapping(spec)

    monkeypatch.setattr(spec_module, "_as_mapping", counting)
    return count


def test_the_value_is_frozen_and_keeps_no_reference_to_its_source():
    source = {"name": "softmax", "prefix": ["forward", "none"]}
    value = parse_spec(source)
    with pytest.raises(dataclasses.FrozenInstanceError):
        value.name = "rmfa"
    with pytest.raises(TypeError):
        value.options["dropout"] = 0.5
    with pytest.raises(TypeError):
        value.sbn["pre_sbn"] = True
    source["prefix"].append("split")
    source["dropout"] = 0.5
    assert value.as_dict() == {"name": "softmax", "prefix": ["forward", "none"]}
    value.as_dict()["prefix"].append("split")  # a copy
    assert value.prefix == ["forward", "none"] and value.options["dropout"] == 0.0


def test_the_value_is_complete():
    value = parse_spec({"name": "rmfa", "num_features": 64})
    assert list(value.options) == list(backend_options("rmfa"))
    assert value.options["num_features"] == 64 and value.options["kernel"] == "exp"
    assert dict(value.sbn) == {"pre_sbn": False, "post_sbn": False} and not value.wrapped
    assert value.prefix == "none"
    wrapped = parse_spec({"name": "rmfa", "pre_sbn": True, "sbn_eps": 1e-9})
    assert list(wrapped.sbn) == list(sbn_options()) and wrapped.wrapped
    assert wrapped.sbn["sbn_eps"] == 1e-9 and wrapped.sbn["sbn_momentum"] == 0.1
    assert wrapped.options["bounded_inputs"] is True  # pre-SBN bounds the kernel's input
    assert (
        parse_spec({"name": "rmfa", "pre_sbn": True, "bounded_inputs": False}).options[
            "bounded_inputs"
        ]
        is False
    )
    assert wrapped.full() == full_spec({"name": "rmfa", "pre_sbn": True, "sbn_eps": 1e-9})


def test_equal_values_build_the_same_attention_and_keep_what_was_written():
    assert parse_spec({"name": "softmax"}) == parse_spec({"name": "softmax", "dropout": 0.0})
    assert parse_spec(None) == parse_spec("softmax") == parse_spec({"name": "softmax"})
    assert parse_spec({"name": "softmax"}) != parse_spec({"name": "softmax", "dropout": 0.1})
    assert parse_spec({"name": "rmfa"}) != parse_spec({"name": "favor"})
    assert parse_spec("rmfa").as_dict() == {"name": "rmfa"}
    assert parse_spec({"name": "rmfa", "kernel": "exp"}).as_dict() == {
        "name": "rmfa",
        "kernel": "exp",
    }
    assert parse_spec("rmfa", num_features=8).as_dict() == {"name": "rmfa", "num_features": 8}
    with pytest.raises(TypeError):
        hash(parse_spec("rmfa"))


def test_the_value_pickles_and_copies():
    value = parse_spec({"name": "rmfa", "pre_sbn": True, "prefix": ["forward", "none"]})
    for copied in (pickle.loads(pickle.dumps(value)), copy.deepcopy(value)):
        assert copied == value and copied.as_dict() == value.as_dict()
        with pytest.raises(TypeError):
            copied.options["kernel"] = "inv"


def test_a_value_is_not_parsed_again(parses):
    value = parse_spec({"name": "rmfa", "num_features": 8, "pre_sbn": True})
    assert parses[0] == 1
    assert parse_spec(value) is value
    attn = build_attention(value, head_dim=8, num_heads=2)
    assert parses[0] == 1
    assert isinstance(attn, PPSBNAttention) and attn.inner.num_features == 8
    # Keyword options make a new value from the one given.
    more = parse_spec(value, num_features=16)
    assert parses[0] == 2 and more.options["num_features"] == 16 and more.wrapped


def test_a_model_parses_its_spec_once_for_all_layers(parses):
    from macformer_lit.models.classifier import EncoderClassifier

    model = EncoderClassifier(
        vocab_size=12, num_classes=3, max_len=16, pad_id=0, d_model=16, num_heads=2,
        num_layers=3, ffn_dim=16, attention={"name": "rmfa", "num_features": 8},
    )  # fmt: skip
    assert parses[0] == 1
    assert len(model.encoder.blocks) == 3


def test_a_task_parses_once_and_records_the_mapping(parses):
    from macformer_lit.tasks import LitClassifier, LitTranslator

    task = LitClassifier(
        vocab_size=12, num_classes=3, max_len=16, pad_id=0, d_model=16, num_heads=2,
        num_layers=2, ffn_dim=16, attention="linear",
    )  # fmt: skip
    assert parses[0] == 1
    assert task.hparams["attention"] == {"name": "linear"}
    assert isinstance(task.hparams["attention"], dict)
    parses[0] = 0
    translator = LitTranslator(
        vocab_size=12, max_len=16, pad_id=0, bos_id=1, eos_id=2, d_model=16, num_heads=2,
        num_encoder_layers=2, num_decoder_layers=2, ffn_dim=16,
        attention={"name": "rmfa", "num_features": 8}, decoder_attention="softmax",
    )  # fmt: skip
    # attention once (encoder and cross-attention share it), decoder_attention once.
    assert parses[0] == 2
    assert translator.hparams["decoder_attention"] == {"name": "softmax"}
    assert translator.hparams["cross_attention"] is None
    assert not any(isinstance(v, ParsedSpec) for v in translator.hparams.values())
