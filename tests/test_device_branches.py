"""Code that branches on the device (``grep -rn "cuda\\|device.type" macformer_lit``).

Where the logic is device-agnostic it is tested here on the CPU: the fallback denominator's
choice to build its means off the CPU (``fallback_means_always(device)``; no host sync, the
same values), the dropout routing, the CPU branch of the memory monitor, RNG states saved
on a GPU machine restored on one without. What needs a GPU is marked ``cuda`` and runs where
``torch.cuda.is_available()``, skipped with that reason elsewhere: the feature backends and
their fallback rows on the GPU, SDPA's flash kernel, peak GPU memory, CUDA RNG states in
checkpoints, fp16 with a real GradScaler.
"""

from __future__ import annotations

import random
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from macformer_lit.attention import build_attention, feature_attention
from macformer_lit.attention.feature_attention import fallback_means_always
from macformer_lit.attention.reference import reference_forward
from macformer_lit.callbacks.distributed import collect_rng_states, set_rng_states
from macformer_lit.callbacks.monitor import ThroughputMemoryMonitor
from macformer_lit.models import dropout as dropout_module

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU: none available")


def _hard_case(device="cpu"):
    """test_attention_denominator's inputs: unnormalised, so that with 8 random Maclaurin
    features 27 of 64 RMFA denominators are ≤ eps·n (the fallback rows)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 16, 8, generator=g, dtype=torch.float64) * 2 for _ in range(3))
    return q.to(device), k.to(device), v.to(device)


def _benign_case():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 16, 8, generator=g, dtype=torch.float64) * 0.5 for _ in "qkv")
    return q, k, v


def _feature_backend(name, device="cpu"):
    torch.manual_seed(0)
    options = {} if name == "linear" else {"num_features": 8}
    attn = build_attention(name, head_dim=8, num_heads=2, **options).double().to(device)
    attn.collect_stats = True
    return attn


# ---- the fallback denominator off the CPU ---------------------------------------------------
def test_fallback_means_are_always_built_off_the_cpu():
    assert fallback_means_always(torch.device("cpu")) is False
    for device in ("cuda", "cuda:1", "meta", "mps", "xpu"):
        assert fallback_means_always(torch.device(device)) is True, device


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "name,case", [("rmfa", _hard_case), ("rmfa", _benign_case), ("favor", _benign_case)]
)
def test_the_always_built_fallback_gives_the_same_values(name, case, causal, monkeypatch):
    """What an accelerator computes (means built for every row, picked by ``where``) is
    bit for bit what the CPU computes (means only when a row needs them)."""
    attn = _feature_backend(name)
    q, k, v = case()
    lazy = attn(q, k, v, causal=causal)
    engaged = float(attn.last_stats["denominator_engaged"])
    # The hard case has fallback rows, the benign one none: both branches of ``where``.
    assert (engaged == 27 / 64) if case is _hard_case else (engaged == 0.0)
    seen = []
    monkeypatch.setattr(
        feature_attention, "fallback_means_always", lambda device: seen.append(device) or True
    )
    always = attn(q, k, v, causal=causal)
    assert [d.type for d in seen] == ["cpu"]
    assert torch.equal(always, lazy)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["rmfa", "favor", "linear"])
def test_the_denominator_policy_never_syncs_off_the_cpu(name, causal):
    """``_normalise`` on meta tensors (no data: any host sync, e.g. ``bool(bad.any())``,
    raises) returns the fallback output's shape, as on a GPU."""
    attn = _feature_backend(name)
    B, H, N, d = 2, 2, 5, 8
    meta = dict(device="meta", dtype=torch.float64)
    out, v1 = torch.randn(B, H, N, d + 1, **meta), torch.randn(B, H, N, d + 1, **meta)
    count = torch.arange(1, N + 1, **meta)[:, None] if causal else N
    den_scale = torch.ones(B, H, **meta) if name == "rmfa" else None
    sums = (lambda: v1.cumsum(2)) if causal else (lambda: v1.sum(2, keepdim=True))
    result = attn._normalise(out, count, den_scale, sums)
    assert result.device.type == "meta" and result.shape == (B, H, N, d)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["rmfa", "favor", "linear"])
def test_feature_backends_on_the_gpu_match_the_reference(name, causal):
    """The GPU path of the denominator policy (means always built) on the hard case, fallback
    rows included, against the float64 reference: float64 rounding only (the bound of
    test_attention_denominator; no denominator lies within 1e-9 of its threshold there, so
    rounding on another device cannot move a row across it)."""
    attn = _feature_backend(name, "cuda")
    q, k, v = _hard_case("cuda")
    out = attn(q, k, v, causal=causal)
    assert out.device.type == "cuda"
    if name == "rmfa":
        assert float(attn.last_stats["denominator_engaged"]) == 27 / 64
    expected = reference_forward(attn.cpu(), *(t.cpu() for t in (q, k, v)), causal=causal)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-7, atol=1e-9)


# ---- dropout: the fast CPU masks, torch's elsewhere ----------------------------------------
def test_dropout_leaves_the_fast_masks_off_the_cpu(monkeypatch):
    calls = []
    real = F.dropout
    monkeypatch.setattr(
        dropout_module.F, "dropout", lambda *a, **kw: calls.append(a[0].device.type) or real(*a)
    )
    monkeypatch.setattr(dropout_module, "_generator", "fast")
    out = dropout_module.dropout(torch.ones(4, 8), 0.25, True)
    assert calls == [] and out.shape == (4, 8)  # the CPU takes the fast masks
    out = dropout_module.dropout(torch.ones(4, 8, device="meta"), 0.25, True)
    assert calls == ["meta"] and out.device.type == "meta"


@pytest.mark.cuda
@needs_cuda
def test_dropout_on_the_gpu_is_torchs():
    x = torch.randn(64, 256, device="cuda")
    layer = dropout_module.Dropout(0.25).train()
    torch.manual_seed(3)
    out = layer(x)
    torch.manual_seed(3)
    assert torch.equal(out, F.dropout(x, 0.25, True))


# ---- SDPA: the flash kernel on the GPU --------------------------------------------------------
@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_softmax_runs_sdpas_flash_kernel(dtype, causal):
    """Forced to the flash kernel (an error if it cannot run), the output equals the float64
    softmax attention of the same half-precision inputs up to the kernel's own rounding: it
    accumulates in float32 and rounds the probabilities and the output to ``dtype``, each a
    relative error ≤ u (2^-11 float16, 2^-8 bfloat16) on a convex combination of v, so
    |error| ≤ 2u·max|v| (theory), checked with a factor 2 to spare."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from macformer_lit.attention.reference import kernelized_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 32, generator=g).to("cuda", dtype) for _ in range(3))
    attn = build_attention("softmax", head_dim=32, num_heads=4).eval()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = attn(q, k, v, causal=causal)
    assert out.dtype == dtype
    expected = kernelized_attention(q.cpu(), k.cpu(), v.cpu(), "exp", None, causal)
    u = torch.finfo(dtype).eps / 2
    bound = 4 * u * float(v.abs().max())
    assert float((out.cpu().double() - expected).abs().max()) <= bound


# ---- the memory monitor -----------------------------------------------------------------------
def _tiny_fit(accelerator, callbacks, tmp_path, **trainer):
    from macformer_lit.data.common import PadCollate, SequenceDataset
    from macformer_lit.tasks import LitClassifier

    L.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, 12, (8,), generator=g).numpy() for _ in range(16)]
    data = DataLoader(
        SequenceDataset(seqs, [int(s[0]) % 3 for s in seqs]), batch_size=4, collate_fn=PadCollate(0)
    )
    model = LitClassifier(
        vocab_size=12,
        num_classes=3,
        max_len=8,
        pad_id=0,
        d_model=16,
        num_heads=2,
        num_layers=1,
        ffn_dim=16,
        warmup_steps=1,
    )
    trainer = L.Trainer(
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        accelerator=accelerator,
        devices=1,
        callbacks=callbacks,
        **trainer,
    )
    trainer.fit(model, data)
    return trainer


def _vm_hwm_mib() -> float:
    """The kernel's own peak resident set size of this process (/proc, kB), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM line in /proc/self/status")


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads Linux's /proc")
def test_on_the_cpu_the_monitor_logs_the_peak_rss(tmp_path):
    """The peak RSS never decreases (theory): the logged peak lies between the kernel's
    figure before the fit and after it, both read from /proc independently of the monitor;
    a unit slip (KiB for MiB) leaves that window."""
    before = _vm_hwm_mib()
    trainer = _tiny_fit("cpu", [ThroughputMemoryMonitor()], tmp_path)
    after = _vm_hwm_mib()
    metrics = trainer.callback_metrics
    logged = float(metrics["train/peak_rss_mb"])
    assert before <= logged <= after
    assert float(metrics["train/peak_rss_mb_rank0"]) == logged
    assert not any("gpu" in key for key in metrics)


class _PeakAfterMonitor(L.Callback):
    """Reads the allocator's peak right after the monitor logged its own."""

    def on_train_epoch_end(self, trainer, pl_module):
        self.peak_mb = torch.cuda.max_memory_allocated(pl_module.device) / 2**20


@pytest.mark.cuda
@needs_cuda
def test_on_the_gpu_the_monitor_logs_the_epochs_peak_allocation(tmp_path):
    """A 512 MiB tensor allocated and freed before the fit raises the allocator's peak; the
    monitor resets it when the epoch starts, so the logged peak is the tiny model's (far
    below 512 MiB) and equals the allocator's own figure."""
    big = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    del big
    assert torch.cuda.max_memory_allocated() >= 512 * 2**20
    probe = _PeakAfterMonitor()
    trainer = _tiny_fit("gpu", [ThroughputMemoryMonitor(), probe], tmp_path)
    metrics = trainer.callback_metrics
    logged = float(metrics["train/peak_gpu_mem_mb"])
    assert 0 < logged < 512
    # Between the two reads only a few scalar tensors are allocated (512-byte blocks each).
    assert logged == pytest.approx(probe.peak_mb, abs=0.01)
    assert float(metrics["train/peak_gpu_mem_mb_rank0"]) == logged
    assert "train/peak_rss_mb" not in metrics


# ---- RNG states in checkpoints ------------------------------------------------------------
def _draws(cuda=False):
    out = [torch.rand(4), np.random.rand(4), [random.random() for _ in range(4)]]
    if cuda:
        out.append(torch.rand(4, device="cuda").cpu())
    return out


def _roundtrip(states, tmp_path):
    """Through a file as Lightning loads checkpoints (``weights_only=True``)."""
    torch.save(states, tmp_path / "rng.pt")
    return torch.load(tmp_path / "rng.pt", weights_only=True)


def _same(a, b):
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))


def test_cpu_rng_states_survive_a_checkpoint(tmp_path):
    L.seed_everything(5)
    states = collect_rng_states()
    assert len(states["torch.cuda"]) == (torch.cuda.device_count() if HAS_CUDA else 0)
    first = _draws()
    set_rng_states(_roundtrip(states, tmp_path))
    _same(_draws(), first)


@pytest.mark.skipif(HAS_CUDA, reason="the restore path of a machine without a GPU")
def test_a_gpu_machines_states_restore_on_a_machine_without_one(tmp_path):
    L.seed_everything(6)
    states = collect_rng_states()
    states["torch.cuda"] = [torch.zeros(16, dtype=torch.uint8)]  # as saved beside a GPU
    first = _draws()
    set_rng_states(_roundtrip(states, tmp_path))
    _same(_draws(), first)


@pytest.mark.cuda
@needs_cuda
def test_cuda_rng_states_survive_a_checkpoint(tmp_path):
    L.seed_everything(7)
    torch.rand(3, device="cuda")  # move the CUDA generator off its seed
    states = collect_rng_states()
    assert len(states["torch.cuda"]) == torch.cuda.device_count()
    first = _draws(cuda=True)
    torch.cuda.manual_seed_all(123)  # something else in between
    set_rng_states(_roundtrip(states, tmp_path))
    _same(_draws(cuda=True), first)


# ---- fp16 with a real GradScaler on the GPU -------------------------------------------------
class _Overflow(L.Callback):
    """Multiplies the loss by 1e30 at step 2 (finite in float32 even scaled by 2^16, its
    float16 gradients overflow) and records the scale before each step and whether the step
    changed the weights."""

    def __init__(self):
        self.scales, self.changed = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.scales.append(float(trainer.precision_plugin.scaler.get_scale()))
        self.before = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.changed.append(
            any(not torch.equal(a, p) for a, p in zip(self.before, pl_module.parameters()))
        )


@pytest.mark.cuda
@needs_cuda
def test_fp16_on_the_gpu_leaves_an_overflow_to_the_grad_scaler(tmp_path, monkeypatch):
    """tests/callbacks/test_nan_guard_fp16.py's overflow, with CUDA autocast and CUDA's
    GradScaler: the scale halves once, the overflow step changes no weight, NaNGuard counts
    it and writes no forensics."""
    from macformer_lit.callbacks.nan_guard import NaNGuard
    from macformer_lit.tasks import LitClassifier

    real_step = LitClassifier.training_step

    def poisoned(self, batch, batch_idx):
        loss = real_step(self, batch, batch_idx)
        return loss * 1e30 if self.global_step == 2 else loss

    monkeypatch.setattr(LitClassifier, "training_step", poisoned)
    guard, trace = NaNGuard(), _Overflow()
    trainer = _tiny_fit("gpu", [guard, trace], tmp_path, precision="16-mixed")
    scaler = trainer.precision_plugin.scaler
    assert isinstance(scaler, torch.amp.GradScaler) and scaler._device == "cuda"
    h = 2.0**16  # GradScaler's initial scale; it grows only after 2000 clean steps
    assert trainer.global_step == 4
    assert trace.scales == [h, h, h, h / 2]
    assert trace.changed == [True, True, False, True]
    assert guard.overflows == 1 and guard.reports == 0
    assert not (tmp_path / "nan_forensics").exists()
