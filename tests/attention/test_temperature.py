"""ppSBN's learnable temperature: where it starts, its own learning rate, that it grows when
the loss needs sharp attention (and, at the model's rate, does not), and the telemetry."""

from __future__ import annotations

import csv
import math
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from macformer_lit.attention import build_attention
from macformer_lit.attention.reference import kernelized_attention, nmse
from macformer_lit.callbacks.telemetry import AttentionTelemetry
from macformer_lit.tasks.optim import adamw_warmup_linear

N, D = 8, 16


def _copy_task(temperature_lr, name="softmax", steps=400, **options):
    """Each position must return its own value among N random ones (q = k = v = x): with
    pre-SBN's unit rows, q_i·k_i/√d ≤ τ/√d, so attention can only pick position i once τ is
    large. Only ppSBN's parameters train, with the model's rate 1e-3. Returns (τ after,
    loss at the start, mean loss of the last 20 steps)."""
    torch.manual_seed(0)
    attn = build_attention(
        name,
        head_dim=D,
        num_heads=1,
        pre_sbn=True,
        sbn_stats="row",
        temperature_max=32.0,
        temperature_lr=temperature_lr,
        **options,
    )
    config = adamw_warmup_linear(
        attn,
        lr=1e-3,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        eps=1e-8,
        warmup_steps=0,
        total_steps=10**9,
    )
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 1, N, D, generator=g)
        loss = (attn(x, x, x) - x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
    return float(attn.temperature().detach().max()), losses[0], sum(losses[-20:]) / 20


def test_temperature_grows_until_the_copy_task_is_solved():
    """Measured: τ 1 → 15.7 in 400 steps and the loss 0.81 → 0.031 (solved: attention on
    the query's own position); at the model's rate τ reaches 1.55 and the loss stays 0.75."""
    tau, first, last = _copy_task(0.01)
    assert tau > 8.0 and last < 0.1 * first
    tau, first, last = _copy_task(None)
    assert tau < math.exp(0.5) and last > 0.8 * first


def test_temperature_grows_for_random_maclaurin_features_too():
    """The same with RMFA (h01, 256 features): measured τ 13.1, loss 0.81 → 0.11."""
    tau, first, last = _copy_task(0.01, name="rmfa", num_features=256, measure="h01")
    assert tau > 8.0 and last < 0.25 * first


def test_temperature_starts_at_its_init_and_has_its_own_group():
    attn = build_attention(
        "softmax",
        head_dim=D,
        num_heads=2,
        pre_sbn=True,
        temperature_max=32.0,
        temperature_init=8.0,
        temperature_lr=0.05,
    )
    torch.testing.assert_close(attn.temperature().flatten(), torch.full((2,), 8.0))
    groups = adamw_warmup_linear(
        attn,
        lr=1e-4,
        weight_decay=0.1,
        betas=(0.9, 0.999),
        eps=1e-6,
        warmup_steps=10,
        total_steps=100,
    )["optimizer"].param_groups
    own = [g for g in groups if any(p is attn.temperature_logit for p in g["params"])]
    assert len(own) == 1 and own[0]["initial_lr"] == 0.05 and own[0]["weight_decay"] == 0.0
    assert own[0]["params"] == [attn.temperature_logit]


@pytest.mark.parametrize(
    "options,match",
    [
        ({"temperature_max": 4.0, "temperature_init": 4.0}, "strictly between"),
        ({"temperature_max": 4.0, "temperature_init": 0.2}, "strictly between"),
        ({"temperature_max": 4.0, "temperature_lr": 0.0}, "temperature_lr must be > 0"),
        ({"temperature_init": 2.0}, "set temperature_max"),
    ],
)
def test_bad_temperature_options(options, match):
    with pytest.raises(ValueError, match=match):
        build_attention("softmax", head_dim=D, num_heads=2, pre_sbn=True, **options)


def test_telemetry_logs_each_layers_temperature(tmp_path):
    model = nn.ModuleList(
        [
            build_attention(
                "softmax",
                head_dim=D,
                num_heads=2,
                pre_sbn=True,
                temperature_max=32.0,
                temperature_init=3.0,
            ),
            build_attention("softmax", head_dim=D, num_heads=2, pre_sbn=True),
        ]
    )
    logger = CSVLogger(tmp_path, name="t")
    trainer = SimpleNamespace(global_step=0, is_global_zero=True, loggers=[logger])
    telemetry = AttentionTelemetry(every_n_steps=1)
    telemetry.on_fit_start(trainer, model)
    telemetry.on_train_batch_start(trainer, model, None, 0)
    x = torch.randn(1, 2, 5, D)
    for layer in model:
        layer(x, x, x)
    telemetry.on_train_batch_end(trainer, model, None, None, 0)
    logger.save()
    (row,) = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    assert float(row["telemetry/layer0/temperature"]) == pytest.approx(3.0)
    assert float(row["telemetry/layer0/temperature_top"]) == pytest.approx(3.0)
    assert "telemetry/layer1/temperature" not in row
    assert float(row["telemetry/layer0/nmse"]) < 1e-12  # softmax is exact at its own τ


def test_telemetry_measures_the_degree2_map_against_its_own_kernel():
    """The deterministic degree-2 map computes 1 + s + s²/2 exactly, not exp: at logits of
    a few units the telemetry's NMSE against exp attention is large, against the map's own
    kernel float32 rounding, and uniform attention's against that kernel is far above it.
    Backends without another own kernel (RMFA estimates exp itself) log no such entry."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (3.0 * torch.randn(2, 2, 40, D, generator=g) for _ in "qkv")
    telemetry = AttentionTelemetry()
    core = build_attention("maclaurin", head_dim=D, num_heads=2)
    metrics = telemetry.measure(core, q, k, v, None, False)
    assert metrics["nmse_own"] < 1e-10
    assert metrics["nmse"] > 1e-2
    assert metrics["nmse_uniform_own"] > 1e-2
    rmfa = build_attention("rmfa", head_dim=D, num_heads=2, num_features=64)
    assert "nmse_own" not in telemetry.measure(rmfa, q / 8, k / 8, v, None, False)


@pytest.mark.parametrize("input_map", ["relu", "sign_split"])
def test_telemetry_takes_the_inputs_as_the_kernel_does(input_map):
    """With ``input_map: relu`` the backend's kernel sees q⁺ and k⁺ (``sign_split``: the
    split [x⁺, x⁻]): the telemetry's exact attentions and logits take them so (NMSE against
    its own kernel float32 rounding, logits ≥ 0), where against the signed inputs' kernel the
    same output is far off."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (3.0 * torch.randn(2, 2, 40, D, generator=g) for _ in "qkv")
    telemetry = AttentionTelemetry()
    core = build_attention("maclaurin", head_dim=D, num_heads=2, input_map=input_map)
    metrics = telemetry.measure(core, q, k, v, None, False)
    assert metrics["nmse_own"] < 1e-10
    assert metrics["logit_min"] >= 0.0
    out = core(q, k, v).double()
    signed = kernelized_attention(q, k, v, core.own_kernel, None, False)
    assert nmse(out, signed) > 1e-2
