"""Feature redraw: only in training, on schedule, identical across ranks, restored from
checkpoints; and the Lightning callbacks (redraw + telemetry) inside a real tiny fit."""

from __future__ import annotations

import copy
import csv
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from macformer_lit.attention import (
    BACKENDS,
    attention_cores,
    build_attention,
    random_feature_backends,
)
from macformer_lit.attention.reference import (
    first_order_attention,
    kernelized_attention,
    nmse,
    uniform_attention,
)
from macformer_lit.callbacks.redraw import FeatureRedraw
from macformer_lit.callbacks.telemetry import AttentionTelemetry

RANDOM = [name for name, cls in BACKENDS.items() if getattr(cls, "random_features", False)]


def _model(name, seed):
    torch.manual_seed(seed)
    layers = [
        build_attention(name, head_dim=8, num_heads=2, num_features=16),
        build_attention(name, head_dim=8, num_heads=2, num_features=16, pre_sbn=True),
    ]
    return nn.ModuleList(layers)


def _features(model):
    return [
        {k: v.clone() for k, v in b.state_dict().items()} for b in random_feature_backends(model)
    ]


def _same(a, b):
    return all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b)
    )


def _trainer(step=0, epoch=0):
    return SimpleNamespace(global_step=step, current_epoch=epoch)


@pytest.mark.parametrize("name", RANDOM)
def test_redraw_on_schedule_and_only_in_training(name):
    model, callback = _model(name, 0), FeatureRedraw(policy="steps", every_n_steps=10)
    start = _features(model)
    model.eval()
    callback.on_train_batch_start(_trainer(step=10), model, None, 0)
    assert _same(_features(model), start)
    model.train()
    for step in (0, 7):
        callback.on_train_batch_start(_trainer(step=step), model, None, 0)
    assert _same(_features(model), start)
    callback.on_train_batch_start(_trainer(step=10), model, None, 0)
    first = _features(model)
    assert not _same(first, start)
    assert [int(b.redraw_index) for b in random_feature_backends(model)] == [1, 1]
    callback.on_train_batch_start(_trainer(step=10), model, None, 1)  # gradient accumulation
    assert _same(_features(model), first)
    callback.on_train_batch_start(_trainer(step=20), model, None, 0)
    assert not _same(_features(model), first)


@pytest.mark.parametrize("name", RANDOM)
def test_epoch_and_never_policies(name):
    model = _model(name, 0).train()
    start = _features(model)
    never = FeatureRedraw(policy="never")
    never.on_train_batch_start(_trainer(step=1000), model, None, 0)
    never.on_train_epoch_start(_trainer(epoch=3), model)
    assert _same(_features(model), start)
    epoch = FeatureRedraw(policy="epoch")
    epoch.on_train_epoch_start(_trainer(epoch=0), model)
    assert _same(_features(model), start)
    epoch.on_train_epoch_start(_trainer(epoch=1), model)
    assert not _same(_features(model), start)


@pytest.mark.parametrize("name", RANDOM)
def test_redraw_is_identical_across_ranks_and_distinct_across_layers(name):
    """Two ranks = two separately built models (different initial draws), same seed."""
    rank0, rank1 = _model(name, 0).train(), _model(name, 1).train()
    assert not _same(_features(rank0), _features(rank1))
    for model in (rank0, rank1):
        FeatureRedraw(policy="steps", every_n_steps=5, seed=7).on_train_batch_start(
            _trainer(step=5), model, None, 0
        )
    assert _same(_features(rank0), _features(rank1))
    layer0, layer1 = _features(rank0)
    assert not torch.equal(
        *(next(v for k, v in f.items() if k != "redraw_index") for f in (layer0, layer1))
    )
    q = torch.randn(2, 2, 6, 8)
    torch.testing.assert_close(rank0[0](q, q, q), rank1[0](q, q, q), rtol=0, atol=0)


@pytest.mark.parametrize(
    "name", [n if n == "rmfa" else pytest.param(n, marks=pytest.mark.slow) for n in RANDOM]
)
def test_setup_gives_every_rank_the_draw_of_rank_zero(name, tmp_path):
    """Real DDP (2 gloo processes, about 13 s) with each rank seeded differently, so the
    ranks' own draws differ and only FeatureRedraw.setup's broadcast can make them agree
    (DDP's buffer broadcast is off). DDP must run in a subprocess: in-process it would
    re-launch pytest's command line."""
    script = Path(__file__).with_name("ddp_redraw_probe.py")
    proc = subprocess.run(
        [sys.executable, str(script), name, str(tmp_path)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONHASHSEED": "0"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert not _same(r0["built"], r1["built"])  # without the broadcast the ranks disagree
    assert _same(r0["started"], r0["built"])
    assert _same(r1["started"], r0["built"])


@pytest.mark.parametrize("name", RANDOM)
def test_redrawn_features_survive_a_checkpoint(name):
    model = _model(name, 0).train()
    callback = FeatureRedraw(policy="steps", every_n_steps=3)
    callback.on_train_batch_start(_trainer(step=6), model, None, 0)
    state = copy.deepcopy(model.state_dict())
    resumed = _model(name, 1).train()
    resumed.load_state_dict(state)
    assert _same(_features(resumed), _features(model))
    assert callback.redraw(resumed, 2) == 0  # already holds draw 2: left alone
    q = torch.randn(2, 2, 6, 8)
    torch.testing.assert_close(resumed[1](q, q, q, causal=True), model[1](q, q, q, causal=True))


class _TinyModule(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 3 * 16)
        self.attn = nn.ModuleList(
            [
                build_attention(
                    "rmfa", head_dim=8, num_heads=2, num_features=32, pre_sbn=True, post_sbn=True
                ),
                build_attention("favor", head_dim=8, num_heads=2, num_features=32),
                build_attention("softmax", head_dim=8, num_heads=2),
            ]
        )

    def training_step(self, batch, batch_idx):
        (x,) = batch
        q, k, v = self.proj(x).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        mask = torch.ones(x.shape[:2], dtype=torch.bool)
        mask[0, -3:] = False
        out = sum(a(q, k, v, key_padding_mask=mask, causal=True) for a in self.attn)
        return out.pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _CaptureCoreInputs(pl.Callback):
    """Each core's first training call at every step: what telemetry measured (batch_size 1)."""

    def __init__(self):
        self.calls: dict[tuple[int, int], tuple] = {}

    def on_fit_start(self, trainer, pl_module):
        for layer, (_, core) in enumerate(attention_cores(pl_module)):
            core.register_forward_hook(self._hook(trainer, layer), with_kwargs=True)

    def _hook(self, trainer, layer):
        def hook(module, args, kwargs, output):
            key = (trainer.global_step, layer)
            if module.training and key not in self.calls:
                mask = kwargs.get("key_padding_mask")
                causal = kwargs.get("causal", False)
                self.calls[key] = (*(t[:1].detach().clone() for t in args[:3]), mask[:1], causal)

        return hook


def test_callbacks_in_a_tiny_fit(tmp_path):
    pl.seed_everything(0)
    module = _TinyModule()
    start = _features(module)
    data = torch.utils.data.TensorDataset(torch.randn(16, 12, 8))
    capture = _CaptureCoreInputs()
    trainer = pl.Trainer(
        max_steps=5,
        logger=pl.loggers.CSVLogger(tmp_path),
        log_every_n_steps=1,
        callbacks=[
            capture,
            FeatureRedraw(policy="steps", every_n_steps=2),
            AttentionTelemetry(every_n_steps=2),
        ],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    assert [int(b.redraw_index) for b in random_feature_backends(module)] == [2, 2]
    assert not _same(_features(module), start)
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    logged = {int(r["step"]): r for r in rows if r.get("telemetry/layer0/nmse")}
    assert sorted(logged) == [0, 2, 4]
    # Recompute step 4 (its draw is the one the cores still hold) on the captured inputs.
    cores = [core for _, core in attention_cores(module)]
    for layer, core in enumerate(cores):
        q, k, v, mask, causal = capture.calls[4, layer]
        with torch.no_grad():
            out = core.eval()(q, k, v, key_padding_mask=mask, causal=causal)
        exact = kernelized_attention(q, k, v, "exp", mask, causal)
        logits = (q @ k.transpose(-1, -2)).double() / 8**0.5
        keep = (mask[:, None, None, :] & torch.ones(12, 12, dtype=torch.bool).tril()).expand_as(
            logits
        )
        expected = {
            "nmse": nmse(out, exact),
            "nmse_uniform": nmse(uniform_attention(q, k, v, mask, causal), exact),
            "nmse_first_order": nmse(first_order_attention(q, k, v, "exp", mask, causal), exact),
            "logit_min": logits[keep].min(),
            "logit_max": logits[keep].max(),
        }
        for key, value in expected.items():
            got = float(logged[4][f"telemetry/layer{layer}/{key}"])
            assert got == pytest.approx(float(value), rel=1e-5, abs=1e-12), (layer, key)
    # The uniform baseline is far from exact (the measurement is not trivially 0) ...
    assert all(float(r["telemetry/layer0/nmse_uniform"]) > 1e-6 for r in logged.values())
    # ... while a softmax core is exact attention with the exp kernel: float32 rounding only.
    assert all(float(r["telemetry/layer2/nmse"]) < 1e-12 for r in logged.values())
    # The denominator policy acts on random-feature cores only; linear's is not one here.
    assert [f"telemetry/layer{i}/denominator_engaged" in rows[0] for i in range(3)] == [
        True,
        True,
        False,
    ]
    # pre-SBN bounds the logits of layer 0 by 1/√d
    assert (
        max(abs(float(r["telemetry/layer0/logit_max"])) for r in logged.values()) <= 8**-0.5 + 1e-6
    )
