"""The promise of the README's "How to add a backend": one file, one registry line, one
YAML, and nothing else edited. ``toy_backend.py`` is written that way; here it gets the
contract tests (in a pytest run that loads it as a plugin), the CLI's spec checks and
``--help`` line, and a real fit through ``--config <its yaml>``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import toy_backend

from macformer_lit.attention import BACKENDS, build_attention
from macformer_lit.attention.reference import reference_forward
from macformer_lit.attention.spec import check_attention_spec, describe_backends
from macformer_lit.cli import MacformerCLI

HERE = Path(__file__).resolve().parent


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(BACKENDS, "toy", toy_backend.ToyAttention)


def test_the_contract_tests_cover_a_backend_registered_in_one_line():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "toy_backend",
            "-k",
            "toy",
            "-x",
            str(HERE / "test_attention_contract.py"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=HERE.parents[1],
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    # Every contract test ran for the toy backend, bare and wrapped in ppSBN, and passed.
    summary = result.stdout.strip().splitlines()[-1]
    passed = int(summary.split(" passed")[0].split()[-1])
    assert passed >= 30 and "failed" not in summary and "error" not in summary, summary


def test_its_reference_is_derived_from_the_feature_maps(toy):
    torch.manual_seed(0)
    attn = build_attention({"name": "toy", "chunk_size": 4}, head_dim=8, num_heads=2).double()
    q, k, v = (torch.randn(2, 2, 11, 8, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[1, 7:] = False
    for causal in (False, True):
        out = attn(q, k, v, key_padding_mask=mask, causal=causal)
        ref = reference_forward(attn, q, k, v, key_padding_mask=mask, causal=causal)
        # Real queries only; the same sums in another order (chunked vs dense) in float64.
        torch.testing.assert_close(
            out[mask[:, None].expand(2, 2, 11)],
            ref[mask[:, None].expand(2, 2, 11)],
            rtol=1e-10,
            atol=1e-12,
        )


def test_its_options_come_from_its_signature(toy):
    assert (
        "  toy: denominator='fallback' (one of: 'fallback', 'clamp', 'abs', 'none'), "
        "denominator_eps=0.001 (float), chunk_size=64 (int)" in describe_backends()
    )
    check_attention_spec({"name": "toy", "pre_sbn": True}, head_dim=8, num_heads=2)
    with pytest.raises(
        ValueError, match="option chunk_size='8' of attention backend 'toy' must be int"
    ):
        check_attention_spec({"name": "toy", "chunk_size": "8"}, head_dim=8, num_heads=2)
    with pytest.raises(
        ValueError,
        match="attention backend 'toy' has no option.s. kernel; its "
        "options are: chunk_size, denominator, ",
    ):
        build_attention({"name": "toy", "kernel": "exp"}, head_dim=8, num_heads=2)


def test_it_trains_through_the_cli_from_its_yaml(toy, tmp_path):
    config = tmp_path / "toy.yaml"
    config.write_text(toy_backend.TOY_YAML)
    args = [
        "fit",
        "--config",
        "listops_short_cpu.yaml",
        "--config",
        str(config),
        "--data.data_dir",
        str(tmp_path / "data"),
        "--data.train_size",
        "16",
        "--data.val_size",
        "8",
        "--data.test_size",
        "8",
        "--data.batch_size",
        "4",
        "--runs_dir",
        str(tmp_path / "runs"),
        "--trainer.max_steps",
        "3",
        "--trainer.val_check_interval",
        "3",
        "--trainer.enable_progress_bar",
        "false",
        "--wandb_mode",
        "disabled",
    ]
    cli = MacformerCLI(args)
    layers = [m for m in cli.model.modules() if isinstance(m, toy_backend.ToyAttention)]
    assert len(layers) == cli.model.hparams.num_layers
    assert all(m.chunk_size == 8 for m in layers)
    assert cli.trainer.global_step == 3
