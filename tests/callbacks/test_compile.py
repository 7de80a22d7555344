"""``CompileModel`` (configs/trainer/compile.yaml): what it compiles, and a compiled fit
through the real CLI that equals the eager one, with the same checkpoint keys.

The CLI runs use the ``aot_eager`` backend: it traces forward and backward through dynamo
and AOTAutograd exactly as inductor receives them, without generating C++ (slow to build
on a 2-core CPU and needing a compiler), and runs the same aten operations, so the
compiled run's losses equal the eager run's to float32 rounding."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from macformer_lit.callbacks.compile import CompileModel, compile_plan
from macformer_lit.cli import CONFIG_DIR, main
from macformer_lit.models import EncoderClassifier
from macformer_lit.models.seq2seq import Seq2SeqTransformer


def _seq2seq(attention):
    return Seq2SeqTransformer(
        vocab_size=20, max_len=16, pad_id=0, bos_id=1, eos_id=2, d_model=16, num_heads=2,
        num_encoder_layers=1, num_decoder_layers=2, ffn_dim=32, dropout=0.0, attention=attention,
    )  # fmt: skip


def test_an_encoder_model_compiles_whole():
    macformer = {"name": "rmfa", "pre_sbn": True, "post_sbn": True}
    model = EncoderClassifier(
        vocab_size=20, num_classes=3, max_len=16, pad_id=0, d_model=16, num_heads=2,
        num_layers=1, ffn_dim=32, dropout=0.0, attention=macformer,
    )  # fmt: skip
    assert compile_plan(model) == ([("model", model)], [])


@pytest.mark.parametrize(
    "attention, eager_reason",
    [
        ({"name": "softmax"}, None),
        ({"name": "kernelized"}, None),
        ({"name": "softmax", "pre_sbn": True, "post_sbn": True}, "ppSBN in causal attention"),
        ({"name": "rmfa", "pre_sbn": True, "post_sbn": True}, "ppSBN in causal attention"),
        ({"name": "favor"}, None),  # the chunked causal path
        ({"name": "linear"}, None),
        ({"name": "rmfa"}, None),
    ],
)
def test_decoder_blocks_compile_only_where_causal_compile_is_correct(attention, eager_reason):
    model = _seq2seq(attention)
    parts, eager = compile_plan(model)
    names = [n for n, _ in parts]
    if eager_reason is None:
        assert names == ["encoder", "blocks.0", "blocks.1"] and eager == []
    else:
        assert names == ["encoder"]
        assert len(eager) == 2
        assert all(line.startswith(f"blocks.{i}: {eager_reason}") for i, line in enumerate(eager))


def _fit_args(root: Path, name: str, *extra: str) -> list[str]:
    return [
        "fit", "--config", "lra_listops.yaml",
        "--data.data_dir", str(root / "data"), "--data.train_size", "32", "--data.val_size", "8",
        "--data.test_size", "8", "--data.batch_size", "8", "--data.generate_min_length", "20",
        "--data.generate_max_length", "60", "--data.max_len", "64",
        "--model.init_args.d_model", "16", "--model.init_args.num_layers", "1",
        "--model.init_args.dropout", "0.0", "--trainer.max_steps", "3",
        "--trainer.val_check_interval", "3", "--trainer.log_every_n_steps", "1",
        "--trainer.accelerator", "cpu", "--trainer.devices", "1",
        "--trainer.enable_progress_bar", "false", "--wandb_mode", "disabled",
        "--seed_everything", "3", "--runs_dir", str(root / "runs"), "--experiment", name,
        *extra,
    ]  # fmt: skip


def _fit(root: Path, name: str, *extra: str) -> Path:
    main(_fit_args(root, name, *extra))
    return root / "runs" / name / "version_0"


def _aot_config(tmp_path: Path) -> Path:
    cfg = yaml.safe_load((CONFIG_DIR / "trainer/compile.yaml").read_text())
    cfg["trainer"]["callbacks"][0]["init_args"]["backend"] = "aot_eager"
    path = tmp_path / "compile_aot.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _column(run: Path, key: str) -> list[float]:
    with open(run / "metrics.csv", newline="") as f:
        return [float(r[key]) for r in csv.DictReader(f) if r.get(key)]


@pytest.mark.parametrize(
    "backend",
    [
        # ~40 s each (tracing forward and backward per new shape): the default run checks
        # the plan above and tests/attention/test_attention_compile.py the backends.
        pytest.param([], id="softmax", marks=pytest.mark.slow),
        pytest.param(
            ["--config", "attention/rmfa_exp.yaml"], id="macformer", marks=pytest.mark.slow
        ),
    ],
)
def test_a_compiled_fit_equals_the_eager_one(tmp_path, capfd, backend):
    cfg = _aot_config(tmp_path)
    eager = _fit(tmp_path, "eager", *backend)
    compiled = _fit(tmp_path, "compiled", *backend, "--config", str(cfg))
    assert "compile (aot_eager): model" in capfd.readouterr().err
    losses = _column(eager, "train/loss_step")
    assert len(losses) == 3
    # Same aten operations in the same order: equal to float32 rounding (a few ulps).
    assert _column(compiled, "train/loss_step") == pytest.approx(losses, rel=1e-5)
    assert _column(compiled, "test/acc") == _column(eager, "test/acc")
    a = torch.load(eager / "checkpoints/last.ckpt", weights_only=True)["state_dict"]
    b = torch.load(compiled / "checkpoints/last.ckpt", weights_only=True)["state_dict"]
    assert list(a) == list(b)  # no "_orig_mod." keys: checkpoints interchange
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-6)


def test_compile_needs_a_model_attribute():
    class NoModel(torch.nn.Module):
        pass

    with pytest.raises(ValueError, match="has no .model to compile"):
        CompileModel().setup(None, NoModel(), "fit")


@pytest.mark.slow
def test_a_compiled_ddp_fit_equals_the_eager_one(tmp_path):
    """Two gloo processes (Lightning's launcher re-runs the command, so a subprocess)."""
    ddp = ["--trainer.devices", "2", "--trainer.strategy", "ddp"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name, extra in (
        ("eager", ddp),
        ("compiled", [*ddp, "--config", str(_aot_config(tmp_path))]),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "macformer_lit", *_fit_args(tmp_path, name, *extra)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "MEMBER: 2/2" in proc.stdout + proc.stderr
    eager, compiled = (tmp_path / "runs" / n / "version_0" for n in ("eager", "compiled"))
    losses = _column(eager, "train/loss_step")
    assert len(losses) == 3
    assert _column(compiled, "train/loss_step") == pytest.approx(losses, rel=1e-5)
    assert _column(compiled, "test/loss") == pytest.approx(_column(eager, "test/loss"), rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "attention", [[], ["--config", "attention/linear.yaml"]], ids=["softmax", "linear"]
)
def test_a_compiled_translator_trains_and_decodes_as_the_eager_one(tmp_path, attention):
    """With linear attention the decoder's chunked causal path is compiled too."""

    def fit(name, *extra):
        main(
            ["fit", "--config", "translation_synthetic.yaml", *attention, *extra,
             "--data.data_dir", str(tmp_path / "data"), "--data.train_size", "64",
             "--data.val_size", "8", "--data.test_size", "8", "--data.batch_size", "16",
             "--data.tokenizer_vocab_size", "300", "--data.max_len", "48",
             "--model.init_args.d_model", "32", "--model.init_args.num_heads", "2",
             "--model.init_args.ffn_dim", "64", "--model.init_args.num_encoder_layers", "1",
             "--model.init_args.num_decoder_layers", "1", "--model.init_args.dropout", "0.0",
             "--trainer.max_steps", "3", "--trainer.val_check_interval", "3",
             "--trainer.log_every_n_steps", "1", "--trainer.accelerator", "cpu",
             "--trainer.devices", "1", "--trainer.enable_progress_bar", "false",
             "--wandb_mode", "disabled", "--seed_everything", "3",
             "--runs_dir", str(tmp_path / "runs"), "--experiment", name]
        )  # fmt: skip
        return tmp_path / "runs" / name / "version_0"

    eager = fit("eager")
    compiled = fit("compiled", "--config", str(_aot_config(tmp_path)))
    losses = _column(eager, "train/loss_step")
    assert len(losses) == 3
    assert _column(compiled, "train/loss_step") == pytest.approx(losses, rel=1e-5)
    # Greedy decoding (eager step methods on compiled-trained weights) gives the same BLEU.
    assert _column(compiled, "test/bleu") == pytest.approx(_column(eager, "test/bleu"), abs=1e-9)
