"""One training step (forward, backward, optimiser) of each LRA preset's model, for every
attention backend and execution path, as ratios to the eager fp32 softmax step of the same run.

What runs. The model, batch shape and optimiser come from the shipped presets
(``configs/lra_{listops,text,retrieval,image,pathfinder}.yaml``): sizes, dropout, pooling and
``dual_encoder`` from ``model.init_args``; vocabulary, classes, ``max_len`` and ``pad_id`` from
the preset's DataModule (instantiated with its ``init_args``, no data read); batch size from
``data.init_args.batch_size``; ``gradient_clip_val`` and ``max_steps`` from ``trainer``. The
model is built by ``LitClassifier`` (``EncoderClassifier``, or ``DualEncoderClassifier`` for
Retrieval), the optimiser by the task's ``adamw_warmup_linear`` (AdamW with the preset's lr,
weight decay, betas, eps, no decay on biases, norms and embeddings; the LambdaLR schedule steps
too). A step is ``zero_grad(set_to_none=True)``, the forward and the cross-entropy loss (under
``torch.autocast`` for the bf16 paths, as Lightning's ``bf16-mixed``), ``backward``, gradient
clipping by norm (``clip_grad_norm_``, the preset's value), ``optimizer.step``,
``scheduler.step``. Inputs: random token ids of the preset's length with a padding mask, as the
DataModules give one (all True by default; ``--length-fraction`` pads a share).

Backends (``--backends``), options read from ``configs/attention/*.yaml``: ``softmax``
(softmax.yaml, torch SDPA), ``macformer`` (rmfa_exp.yaml: RMFA exp + ppSBN), ``rmfa_nosbn``
(the same without ppSBN), ``softmax_ppsbn`` (softmax_ppsbn.yaml), ``favor`` (favor.yaml),
``linear`` (linear.yaml), ``macformer_learns`` (maclaurin_ppsbn.yaml), ``macformer_fast``
(maclaurin_ppsbn_fast.yaml: the same with bf16 rows and the compiled map),
``macformer_native`` (the same with ``native_map: true``: the native map on CPUs),
``macformer_fused`` (maclaurin_ppsbn_fused.yaml: map and products fused, float32: the native
kernel on CPUs, Triton's on GPUs), ``macformer_fused_bf16`` (the same with ``feature_dtype:
bfloat16``: bfloat16 dot products), ``macformer_fused_bf16_eager_sbn`` (the same with
ppSBN's eager passes: ``native_sbn: false``), ``macformer_fused_bf16_triton_sbn`` (the same
with ``triton_sbn: true``: ppSBN's passes as Triton kernels on a GPU),
``macformer_sign_split`` (``macformer_native`` with ``input_map: sign_split`` and native
ppSBN: 2,145 features at head_dim 32), ``macformer_auto``
(maclaurin_ppsbn_auto.yaml: the kernels this machine chooses),
``maclaurin_nosbn``
(maclaurin.yaml), ``release`` (rmfa_exp_release.yaml), ``uniform``, ``uniform_prefix`` (not
in the default set), and
``torch``: the same model written with torch's own modules,
``nn.TransformerEncoder(nn.TransformerEncoderLayer(d_model, nhead, ffn, dropout,
activation="gelu", batch_first=True, norm_first=True), num_layers, norm=LayerNorm)`` with
``src_key_padding_mask``, the same embeddings, masked mean pooling and head: the row a user
would otherwise write. ``nn.TransformerEncoderLayer(dropout=p)`` also drops attention weights,
which on CPU sends SDPA to its math path with (B, H, N, N) matrices (docs/pitfalls.md §2); the
``torch`` row sets the attention-weight dropout to the preset's attention dropout (0), and the
optional ``torch_dropout`` row keeps torch's default (skipped when its N×N matrices would not
fit in memory).

Paths (``--paths``): ``eager`` fp32 (always run: the reference), ``bf16`` (``torch.autocast``
bf16 on the device; ppSBN and the feature maps compute in fp32 inside), ``fp16`` (CUDA only:
``torch.autocast`` fp16 with a ``GradScaler``, unscaled before clipping, as Lightning's
``16-mixed``; fp16 rows against the fp16 GEMM peak), ``compile``
(``torch.compile(model, dynamic=True)``) and ``compile+bf16``. A compiled case's first step
is a cold compile, reported separately with the graphs and graph breaks it compiled
(``torch._dynamo.utils.counters``): inductor's caches are off and ``torch._dynamo.reset()``
runs before it, so it shares nothing with the cases compiled before it. Dynamo keeps one cache
per code object and every case runs the same model code, so the reset drops the other cases'
graphs: each compiled case then compiles once more in an untimed step, and frames compiled
after that are reported as recompiles. A case that fails (to build, compile or run) is reported as
``failed: <first line>``, not a crash.

Method (docs/pitfalls.md §9). Per preset, every (backend, path) case runs ``--warmup``
untimed rounds (at least one: the first records each case's first-step time, its compile on
compiled paths), then ``--rounds`` timed rounds; each round runs every case once in a freshly
shuffled (seeded) order. A case's
ratio in a round is its time over the eager fp32 softmax step's time in that round; tables
give the median of those ratios, the median time, tokens/s = real (non-padding) tokens of the
batch / median time, achieved GFLOP/s = counted FLOPs / median time and its share of the
GEMM peak (fp32 ``torch.mm`` of two square matrices, bf16 for bf16 rows, median of
``--gemm-calls`` calls or of those that fit in ``--gemm-budget`` seconds, at least 3, same
threads, measured at the start and the end of the run, the higher
taken). On CUDA every step is bracketed by ``torch.cuda.synchronize()``.

FLOPs, counted analytically per backend, in multiply-adds (MAC), FLOP = 2 MAC. Per encoder
layer and encoded sequence batch (B sequences of N tokens, d_model m, H heads of d = m/H,
FFN f): q/k/v/o projections 4·B·N·m², FFN 2·B·N·m·f, and attention: softmax (and
softmax+ppSBN, torch): Q·Kᵀ and P·V, 2·B·H·N²·d; uniform: none (the mean of v is a
reduction); feature-map backends: the map on q and on k,
2·B·H·N·S·d (S = ω rows: ``_omega.shape[0]`` for RMFA, the random matrix's rows for FAVOR+,
0 for linear's elu+1), then φ(k)ᵀ[v, 1] and φ(q)ᵀ·state, 2·B·H·N·D'·(d+1), D' = the feature
rows the layer's map actually returns (read from a forward of each layer). Summed over layers
(each RMFA layer has its own draw), twice for Retrieval's two documents; the head adds
B·(in·f + f·classes) (in = m, or 4m for Retrieval); embeddings, pooling and all elementwise
work (LayerNorm, GELU, softmax exponentials, dropout, ppSBN, RMFA's degree products, masks,
AdamW) are not counted. FLOPs use the padded length N (what the kernels compute). A training
step counts 3 × forward (backward = 2 × forward).

Memory: peak bytes of one more (untimed) step per case: on CUDA
``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()`` minus what was
allocated before; on CPU the peak of the running sum of the allocator's allocations and frees
recorded by ``torch.profiler`` (``profile_memory=True``) during the step, as
attention_speed.py measures it (weights, optimiser state and the batch excluded: they exist
before the step).

    python -m benchmarks.train_step                          # the committed CPU run
    python -m benchmarks.train_step --paths eager,bf16,compile,compile+bf16
    python -m benchmarks.train_step --presets listops        # one preset
    python -m benchmarks.train_step --device cuda            # on a GPU -> train_step_cuda.*
    python -m benchmarks.train_step --presets listops --max-len 64 --batch 2 --rounds 1 \\
        --warmup 0 --gemm-n 256 --out /tmp/ts             # a smoke run (seconds)
    python -m benchmarks.train_step --render benchmarks/results/train_step.json
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import importlib
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from macformer_lit import yamlio
from macformer_lit.attention import attention_cores, pieces
from macformer_lit.attention.feature_attention import FeatureAttention
from macformer_lit.attention.spec import sbn_options
from macformer_lit.attention.uniform import UniformAttention
from macformer_lit.models.classifier import pool

try:
    from benchmarks._common import (
        cpu_allocation_peak,
        csv_comment_header,
        machine_info,
        md_header,
        md_table,
        median,
        progress,
    )
except ImportError:  # run as a script: python benchmarks/train_step.py
    from _common import (
        cpu_allocation_peak,
        csv_comment_header,
        machine_info,
        md_header,
        md_table,
        median,
        progress,
    )

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PRESETS = ("listops", "text", "retrieval", "image", "pathfinder")
PATHS = ("eager", "bf16", "fp16", "compile", "compile+bf16")
# torch.autocast's dtype of each path that runs under it (the rest run in fp32); its GEMM
# peak is measured in that dtype, and fp16 (with a GradScaler, as Lightning's 16-mixed) only
# runs on a GPU.
AMP_DTYPES = {"bf16": torch.bfloat16, "compile+bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_BACKENDS = "softmax,macformer,rmfa_nosbn,softmax_ppsbn,favor,linear,torch"
SBN_KEYS = tuple(sbn_options())  # the ppSBN wrapper's spec options, from its signature
# torch_dropout's (B, H, N, N) matrices: ~9 bytes per entry per layer kept for backward
# (fp32 softmax output and dropped output, bool mask), plus one transient fp32 matrix.
MATH_PATH_BYTES_PER_ENTRY = 13


def default_config_dir() -> Path:
    """The repository's ``configs/``, else the copy shipped inside the package."""
    repo = ROOT / "configs"
    if (repo / "lra_listops.yaml").is_file():
        return repo
    import macformer_lit

    return Path(macformer_lit.__file__).resolve().parent / "configs"


# --------------------------------------------------------------------------- presets, backends


def load_preset(name: str, config_dir: Path, args) -> dict:
    """Everything a step needs from ``lra_<name>.yaml`` (JSON-able)."""
    path = config_dir / f"lra_{name}.yaml"
    cfg = yamlio.load(path.read_text())
    init = dict(cfg["model"]["init_args"])
    data = cfg["data"]
    module, cls = data["class_path"].rsplit(".", 1)
    data_args = dict(data.get("init_args") or {})
    dm = getattr(importlib.import_module(module), cls)(**data_args)
    trainer = cfg.get("trainer") or {}
    length = dm.max_len if not args.max_len else min(args.max_len, dm.max_len)
    return {
        "name": name,
        "config": f"configs/lra_{name}.yaml",
        "model_init_args": init,
        "vocab_size": int(dm.vocab_size),
        "num_classes": int(dm.num_classes),
        "max_len": int(dm.max_len),
        "pad_id": int(dm.pad_id),
        "batch": int(args.batch or data_args["batch_size"]),
        "length": int(length),
        "dual": bool(init.get("dual_encoder", False)),
        "gradient_clip_val": trainer.get("gradient_clip_val"),
        "gradient_clip_algorithm": trainer.get("gradient_clip_algorithm") or "norm",
        "max_steps": int(trainer.get("max_steps") or 10000),
    }


def attention_yaml(config_dir: Path, name: str) -> dict:
    return dict(
        yamlio.load((config_dir / "attention" / f"{name}.yaml").read_text())["model"]["attention"]
    )


@dataclass
class Backend:
    name: str
    label: str
    attention: dict | None  # spec for our models; None: torch's nn.TransformerEncoder
    source: str
    torch_attention_dropout: bool = False  # torch rows: keep dropout on attention weights


def all_backends(config_dir: Path) -> list[Backend]:
    rmfa = attention_yaml(config_dir, "rmfa_exp")
    rmfa_plain = {k: v for k, v in rmfa.items() if k not in SBN_KEYS}
    return [
        Backend("softmax", "softmax (SDPA)", attention_yaml(config_dir, "softmax"),
                "attention/softmax.yaml"),
        Backend("macformer", "Macformer (RMFA exp + ppSBN)", rmfa, "attention/rmfa_exp.yaml"),
        Backend("macformer_recompute", "Macformer, recompute: true", {**rmfa, "recompute": True},
                "attention/rmfa_exp.yaml + recompute: true"),
        Backend("rmfa_nosbn", "RMFA exp, no ppSBN", rmfa_plain,
                "attention/rmfa_exp.yaml without pre_sbn/post_sbn/sbn_*"),
        Backend("softmax_ppsbn", "softmax + ppSBN", attention_yaml(config_dir, "softmax_ppsbn"),
                "attention/softmax_ppsbn.yaml"),
        Backend("favor", "FAVOR+", attention_yaml(config_dir, "favor"), "attention/favor.yaml"),
        Backend("linear", "linear (elu+1)", attention_yaml(config_dir, "linear"),
                "attention/linear.yaml"),
        Backend("macformer_learns", "degree-2 Maclaurin + ppSBN, temperature",
                attention_yaml(config_dir, "maclaurin_ppsbn"), "attention/maclaurin_ppsbn.yaml"),
        Backend("macformer_fast", "degree-2 Maclaurin + ppSBN, bf16 rows, compiled map",
                attention_yaml(config_dir, "maclaurin_ppsbn_fast"),
                "attention/maclaurin_ppsbn_fast.yaml"),
        Backend("macformer_native",
                "degree-2 Maclaurin + ppSBN, bf16 rows, native map (CPU) / compiled map",
                {**attention_yaml(config_dir, "maclaurin_ppsbn_fast"), "native_map": True},
                "attention/maclaurin_ppsbn_fast.yaml + native_map: true"),
        Backend("macformer_fused",
                "degree-2 Maclaurin + ppSBN, fused float32 products (native CPU / Triton GPU)",
                attention_yaml(config_dir, "maclaurin_ppsbn_fused"),
                "attention/maclaurin_ppsbn_fused.yaml"),
        Backend("macformer_fused_bf16",
                "degree-2 Maclaurin + ppSBN, fused products, bf16 inputs (native CPU / Triton GPU)",
                {**attention_yaml(config_dir, "maclaurin_ppsbn_fused"),
                 "feature_dtype": "bfloat16"},
                "attention/maclaurin_ppsbn_fused.yaml + feature_dtype: bfloat16"),
        Backend("macformer_fused_bf16_eager_sbn",
                "the same with ppSBN's eager passes (native_sbn: false)",
                {**attention_yaml(config_dir, "maclaurin_ppsbn_fused"),
                 "feature_dtype": "bfloat16", "native_sbn": False},
                "attention/maclaurin_ppsbn_fused.yaml + feature_dtype: bfloat16, "
                "native_sbn: false"),
        Backend("macformer_fused_bf16_triton_sbn",
                "the same with ppSBN's passes as Triton kernels on a GPU (triton_sbn: true)",
                {**attention_yaml(config_dir, "maclaurin_ppsbn_fused"),
                 "feature_dtype": "bfloat16", "triton_sbn": True},
                "attention/maclaurin_ppsbn_fused.yaml + feature_dtype: bfloat16, "
                "triton_sbn: true"),
        Backend("macformer_sign_split",
                "degree-2 Maclaurin + ppSBN on [x+, x-] (input_map: sign_split), bf16 rows, "
                "native map and ppSBN (CPU) / compiled map",
                {**attention_yaml(config_dir, "maclaurin_ppsbn_fast"), "native_map": True,
                 "native_sbn": True, "input_map": "sign_split"},
                "attention/maclaurin_ppsbn_fast.yaml + native_map: true, native_sbn: true, "
                "input_map: sign_split"),
        Backend("macformer_auto", "degree-2 Maclaurin + ppSBN, kernels chosen by the machine",
                attention_yaml(config_dir, "maclaurin_ppsbn_auto"),
                "attention/maclaurin_ppsbn_auto.yaml"),
        Backend("maclaurin_nosbn", "degree-2 Maclaurin, no ppSBN",
                attention_yaml(config_dir, "maclaurin"), "attention/maclaurin.yaml"),
        Backend("release", "RMFA as released (prefix sums, row pre-SBN)",
                attention_yaml(config_dir, "rmfa_exp_release"),
                "attention/rmfa_exp_release.yaml"),
        Backend("uniform", "uniform", attention_yaml(config_dir, "uniform"),
                "attention/uniform.yaml"),
        Backend("uniform_prefix", "uniform over prefixes", attention_yaml(config_dir,
                "uniform_prefix"), "attention/uniform_prefix.yaml"),
        Backend("torch", "nn.TransformerEncoder (what you would write)", None,
                "torch.nn, attention-weight dropout = the preset's attention dropout"),
        Backend("torch_dropout", "nn.TransformerEncoder, dropout on attention weights", None,
                "torch.nn, TransformerEncoderLayer(dropout=p) as is", True),
    ]  # fmt: skip


def select_backends(config_dir: Path, wanted: str) -> list[Backend]:
    backends = all_backends(config_dir)
    names = [n for n in wanted.split(",") if n]
    unknown = set(names) - {b.name for b in backends}
    if unknown:
        have = [b.name for b in backends]
        raise SystemExit(f"unknown backend(s) {sorted(unknown)}; have {have}")
    if "softmax" not in names:
        names.insert(0, "softmax")  # the reference
    return [b for b in backends if b.name in names]


def select_paths(wanted: str) -> list[str]:
    names = [n for n in wanted.split(",") if n]
    unknown = set(names) - set(PATHS)
    if unknown:
        raise SystemExit(f"unknown path(s) {sorted(unknown)}; have {list(PATHS)}")
    return [p for p in PATHS if p in names or p == "eager"]


# ------------------------------------------------------------------------------------- models


class TorchEncoderClassifier(nn.Module):
    """The preset's model written with ``nn.TransformerEncoder``: token + learned position
    embeddings, pre-LN layers (GELU), final LayerNorm, masked mean pooling, the same head
    (on ``[e1, e2, e1*e2, e1-e2]`` for two documents)."""

    def __init__(
        self,
        *,
        vocab_size: int,
        num_classes: int,
        max_len: int,
        d_model: int,
        num_heads: int,
        num_layers: int,
        ffn_dim: int,
        dropout: float,
        dual: bool,
        attention_dropout: float | None,
    ) -> None:
        super().__init__()
        self.dual = dual
        self.token_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_len, d_model)
        self.dropout = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(
            d_model,
            num_heads,
            dim_feedforward=ffn_dim,
            dropout=dropout,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.encoder = nn.TransformerEncoder(
            layer, num_layers, norm=nn.LayerNorm(d_model), enable_nested_tensor=False
        )
        if attention_dropout is not None:
            for lay in self.encoder.layers:
                lay.self_attn.dropout = attention_dropout
        self.head = nn.Sequential(
            nn.Linear((4 if dual else 1) * d_model, ffn_dim),
            nn.GELU(),
            nn.Linear(ffn_dim, num_classes),
        )

    def embed(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.dropout(self.token_emb(ids) + self.pos_emb(positions))
        return pool(self.encoder(x, src_key_padding_mask=~mask), mask, "mean")

    def forward(self, *batch: torch.Tensor) -> torch.Tensor:
        if not self.dual:
            return self.head(self.embed(*batch))
        e1, e2 = self.embed(*batch[:2]), self.embed(*batch[2:])
        return self.head(torch.cat([e1, e2, e1 * e2, e1 - e2], dim=-1))


def build_model(preset: dict, backend: Backend) -> nn.Module:
    init = preset["model_init_args"]
    if backend.attention is None:
        attention = init.get("attention") or {}
        return TorchEncoderClassifier(
            vocab_size=preset["vocab_size"],
            num_classes=preset["num_classes"],
            max_len=preset["max_len"],
            d_model=init["d_model"],
            num_heads=init["num_heads"],
            num_layers=init["num_layers"],
            ffn_dim=init["ffn_dim"],
            dropout=init["dropout"],
            dual=preset["dual"],
            attention_dropout=None
            if backend.torch_attention_dropout
            else float(attention.get("dropout", 0.0)),
        )
    from macformer_lit.tasks import LitClassifier  # imports Lightning

    lit = LitClassifier(
        **{
            **init,
            "attention": dict(backend.attention),
            "vocab_size": preset["vocab_size"],
            "num_classes": preset["num_classes"],
            "max_len": preset["max_len"],
            "pad_id": preset["pad_id"],
        }
    )
    return lit.model


def attention_layout(model: nn.Module, backend: Backend, preset: dict) -> list[dict]:
    """Per encoder layer: the attention kind and, for feature maps, S (ω rows) and D'."""
    init = preset["model_init_args"]
    H = init["num_heads"]
    d = init["d_model"] // H
    if backend.attention is None:
        return [{"kind": "softmax"} for _ in range(init["num_layers"])]
    layers = []
    for _, core in attention_cores(model):
        if isinstance(core, UniformAttention):
            layers.append({"kind": "uniform"})
            continue
        if not isinstance(core, FeatureAttention):
            layers.append({"kind": "softmax"})
            continue
        if hasattr(core, "_omega"):
            S = int(core._omega.shape[0])
        elif hasattr(core, "weight"):
            S = int(core.weight.shape[0])
        else:
            S = 0
        with torch.no_grad():
            x = torch.randn(1, H, 4, d, dtype=core_dtype(core))
            # Through the core's input map first (sign_split doubles the map's input).
            rows = int(core._key_features(core.kernel_inputs(x, x)[1], None, None)[0].shape[-2])
        layers.append({"kind": "feature", "S": S, "D": rows})
    return layers


def core_dtype(core: nn.Module) -> torch.dtype:
    for t in core.buffers():
        if t.is_floating_point():
            return t.dtype
    return torch.float32


def count_flops(preset: dict, layout: list[dict]) -> dict:
    """Analytic FLOPs of one forward and one training step (see the module docstring)."""
    init = preset["model_init_args"]
    B, N = preset["batch"], preset["length"]
    m, H, f = init["d_model"], init["num_heads"], init["ffn_dim"]
    C = preset["num_classes"]
    d = m // H
    docs = 2 if preset["dual"] else 1
    mac = {"projections": 0, "ffn": 0, "attention": 0, "feature_map": 0, "head": 0}
    for layer in layout:
        mac["projections"] += 4 * B * N * m * m
        mac["ffn"] += 2 * B * N * m * f
        if layer["kind"] == "softmax":
            mac["attention"] += 2 * B * H * N * N * d
        elif layer["kind"] == "uniform":
            pass  # the mean of v: a reduction, elementwise work (not counted)
        else:
            mac["feature_map"] += 2 * B * H * N * layer["S"] * d
            mac["attention"] += 2 * B * H * N * layer["D"] * (d + 1)
    mac = {k: docs * v for k, v in mac.items()}
    mac["head"] = B * ((4 if preset["dual"] else 1) * m * f + f * C)
    forward = {k: 2 * v for k, v in mac.items()}
    total = sum(forward.values())
    return {"forward_parts": forward, "forward": total, "step": 3 * total}


# -------------------------------------------------------------------------------- measuring


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def make_batch(preset: dict, fraction: float, seed: int, device: str):
    """Random ids with a padding mask (True = real); with fraction < 1 each sequence's
    real length is uniform in [fraction·N, N], the first one full (the batch is padded to
    its longest). Returns the model inputs, labels and the number of real tokens."""
    g = torch.Generator().manual_seed(seed)
    B, N = preset["batch"], preset["length"]
    inputs, real = [], 0
    for _ in range(2 if preset["dual"] else 1):
        lo = max(1, math.ceil(fraction * N))
        lengths = torch.randint(lo, N + 1, (B,), generator=g)
        lengths[0] = N
        mask = torch.arange(N)[None, :] < lengths[:, None]
        ids = torch.randint(0, preset["vocab_size"], (B, N), generator=g)
        ids = ids.masked_fill(~mask, preset["pad_id"])
        inputs += [ids.to(device), mask.to(device)]
        real += int(mask.sum())
    labels = torch.randint(0, preset["num_classes"], (B,), generator=g).to(device)
    return inputs, labels, real


def dynamo_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "frames": int(counters["frames"]["total"]),
    }


class Case:
    """One (backend, path) at one preset: model, optimiser, batch, and a step."""

    def __init__(self, preset, backend: Backend, path: str, batch, args) -> None:
        from macformer_lit.tasks.optim import adamw_warmup_linear

        self.preset, self.backend, self.path, self.device = preset, backend, path, args.device
        self.key = f"{backend.name}|{path}"
        self.result: dict = {"backend": backend.name, "path": path, "status": "ok", "times_s": []}
        torch.manual_seed(args.seed)  # the same initial weights and draws for every path
        model = build_model(preset, backend)
        self.layout = attention_layout(model, backend, preset)
        self.model = model.to(args.device).train()
        init = preset["model_init_args"]
        opt = adamw_warmup_linear(
            self.model,
            lr=init.get("lr", 1e-4),
            weight_decay=init.get("weight_decay", 0.0),
            betas=tuple(init.get("betas", (0.9, 0.999))),
            eps=init.get("eps", 1e-6),
            warmup_steps=init.get("warmup_steps", 1000),
            total_steps=preset["max_steps"],
        )
        self.optimizer = opt["optimizer"]
        self.scheduler = opt["lr_scheduler"]["scheduler"]
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.compiled = path.startswith("compile")
        self.forward = torch.compile(self.model, dynamic=True) if self.compiled else self.model
        self.amp_dtype = AMP_DTYPES.get(path)  # None: fp32
        # fp16 runs on CUDA only (skip_reason), with Lightning's 16-mixed GradScaler.
        self.scaler = torch.amp.GradScaler("cuda") if path == "fp16" else None
        self.inputs, self.labels = batch
        self.clip = preset["gradient_clip_val"]
        self.clip_algorithm = preset["gradient_clip_algorithm"]
        self.phase = "first"  # then "again" (see measure), then "steady"
        if self.compiled:
            self.result["compile"] = {"graphs": 0, "graph_breaks": 0, "recompiles": 0}

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        amp = self.amp_dtype is not None
        with torch.autocast(
            self.device.split(":")[0], self.amp_dtype or torch.bfloat16, enabled=amp
        ):
            logits = self.forward(*self.inputs)
            loss = F.cross_entropy(logits.float(), self.labels)
        if self.scaler is not None:  # as Lightning's 16-mixed: scale, unscale before clipping
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.optimizer)
        else:
            loss.backward()
        if self.clip:
            if self.clip_algorithm == "value":
                torch.nn.utils.clip_grad_value_(self.params, self.clip)
            else:
                torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skipped when the scaled gradients overflowed
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()

    def __call__(self) -> None:
        if not self.compiled:
            self.step()
            return
        before = dynamo_counts()
        self.step()
        after = dynamo_counts()
        c = self.result["compile"]
        if self.phase == "first":  # the cold compile
            c["graphs"] += after["graphs"] - before["graphs"]
            c["graph_breaks"] += after["graph_breaks"] - before["graph_breaks"]
        elif self.phase == "steady":  # frames compiled after the first step and its redo
            c["recompiles"] += after["frames"] - before["frames"]

    def fail(self, err: BaseException) -> None:
        self.result["status"] = failure(err)


def failure(err: BaseException) -> str:
    """``failed: <type>: <first line of the message>`` for the table."""
    lines = str(err).strip().splitlines()
    first = lines[0].strip() if lines else ""
    return f"failed: {type(err).__name__}: {first}"[:200].replace("|", "/")


def compile_again(cases: list[Case], device: str, preset: str) -> float:
    """After the cold compiles (``torch._dynamo.reset()`` before each), every compiled case
    but the last lost its graphs: one more untimed step each compiles them again, so that no
    timed step compiles. Returns the seconds it took."""
    t0 = time.perf_counter()
    again = [c for c in cases if c.compiled and c.result["status"] == "ok"]
    for case in again:
        case.phase = "again"
        try:
            elapsed = time_call(case, device)
        except Exception as err:
            case.fail(err)
            progress(f"[{preset}] {case.key}: {case.result['status']}")
            continue
        case.result["compile"]["again_s"] = elapsed
        progress(f"[{preset}] compiled again (untimed) {case.key:<28} {elapsed * 1e3:10.1f} ms")
    for case in cases:
        case.phase = "steady"
    return time.perf_counter() - t0


def time_call(case: Case, device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    case()
    sync(device)
    return time.perf_counter() - t0


def peak_memory(case: Case, device: str) -> tuple[int, list[str]]:
    """Peak extra bytes allocated during one step, and the SDPA kernels the step ran."""
    wanted = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")
    if device.startswith("cuda"):
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        case()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - base, []
    peak, events = cpu_allocation_peak(case)
    ops = sorted(
        {
            e["name"]
            for e in events
            if isinstance(e.get("name"), str)
            and e["name"].startswith("aten::")
            and any(w in e["name"] for w in wanted)
        }
        - {"aten::scaled_dot_product_attention"}
    )
    return int(peak), ops


# Op groups of a profile (ATen names, self time): matrix products, SDPA's fused kernels,
# and copies (dtype casts, .contiguous(), cat's writes).
PROFILE_GROUPS = {
    "GEMM": ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::addbmm"),
    "SDPA": ("aten::_scaled_dot_product",),
    "copies": ("aten::copy_", "aten::cat", "aten::fill_", "aten::zero_"),
}


def profile_step(case: Case, device: str, top: int) -> dict:
    """One more step under ``torch.profiler``: total self time, the ``top`` ops by self time
    (ms, calls) and the share of each of ``PROFILE_GROUPS`` (the rest is elementwise work,
    reductions, the optimiser's foreach kernels and Python-side dispatch)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    sync(device)
    with profile(activities=activities) as prof:
        case()
        sync(device)
    ops = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    # ATen calls made from outside ATen (an op's own inner calls not counted): how many
    # operations the step dispatches, each a kernel launch or more on a GPU.
    calls = sum(
        1
        for e in prof.events()
        if e.name.startswith("aten::")
        and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))
    )
    attr = "self_device_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    total = sum(getattr(e, attr) for e in ops) or 1.0
    ops.sort(key=lambda e: -getattr(e, attr))
    shares = {
        group: sum(getattr(e, attr) for e in ops if e.key.startswith(prefixes)) / total
        for group, prefixes in PROFILE_GROUPS.items()
    }
    return {
        "clock": "device" if device.startswith("cuda") else "cpu",
        "total_ms": total / 1e3,
        "aten_calls": calls,
        "shares": shares,
        "top": [[e.key, getattr(e, attr) / 1e3, e.count] for e in ops[:top]],
    }


def gemm_peak(
    device: str, dtype: torch.dtype, n: int, calls: int, budget_s: float, seed: int
) -> dict:
    """Median time of ``torch.mm`` of two n×n matrices -> GFLOP/s (2n³ FLOPs a call); at most
    ``calls`` calls, fewer (at least 3) once they took ``budget_s`` (bf16 without hardware
    support runs ~50× slower than fp32 on an AVX2 CPU)."""
    g = torch.Generator().manual_seed(seed)
    a, b = (torch.randn(n, n, generator=g).to(device=device, dtype=dtype) for _ in range(2))
    c = torch.empty(n, n, device=device, dtype=dtype)
    torch.mm(a, b, out=c)  # warm-up
    times: list[float] = []
    while len(times) < calls and (len(times) < 3 or sum(times) < budget_s):
        sync(device)
        t0 = time.perf_counter()
        torch.mm(a, b, out=c)
        sync(device)
        times.append(time.perf_counter() - t0)
    return {
        "n": n,
        "calls": len(times),
        "times_s": times,
        "gflops": 2 * n**3 / median(times) / 1e9,
    }


def memory_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def path_runs_on(path: str, device: str) -> bool:
    """Whether ``path`` can run on ``device``: fp16 only on a GPU."""
    return path != "fp16" or device.startswith("cuda")


def dtype_name(path: str) -> str:
    """The dtype a path's steps compute in, as the GEMM peaks are keyed: float32, bfloat16,
    float16."""
    return str(AMP_DTYPES.get(path, torch.float32)).removeprefix("torch.")


def skip_reason(preset: dict, backend: Backend, device: str, path: str = "eager") -> str:
    """Why a case cannot run here, or '': fp16 off a GPU, ``torch_dropout`` (SDPA's math
    path, N×N matrices) where they would not fit in memory."""
    if not path_runs_on(path, device):
        return "skipped: fp16 (a GradScaler, as Lightning's 16-mixed) is a GPU path"
    if not backend.torch_attention_dropout or device.startswith("cuda"):
        return ""
    init = preset["model_init_args"]
    B, N, H = preset["batch"], preset["length"], init["num_heads"]
    docs = 2 if preset["dual"] else 1
    need = MATH_PATH_BYTES_PER_ENTRY * B * H * N * N * init["num_layers"] * docs
    have = memory_available()
    if have is not None and need > 0.7 * have:
        return (
            f"skipped: SDPA's math path would keep ~{need / 2**30:.0f} GiB of (B, H, N, N) "
            f"matrices; {have / 2**30:.0f} GiB available"
        )
    return ""


def estimate_work(preset: dict, n_cases: int) -> float:
    """Relative cost of a preset (for the time estimate): softmax step FLOPs × cases."""
    layers = preset["model_init_args"]["num_layers"]
    return count_flops(preset, [{"kind": "softmax"}] * layers)["step"] * n_cases


def run(args) -> dict:
    device = args.device
    config_dir = Path(args.configs) if args.configs else default_config_dir()
    backends = select_backends(config_dir, args.backends)
    paths = select_paths(args.paths)
    names = [n for n in args.presets.split(",") if n]
    unknown = set(names) - set(PRESETS)
    if unknown:
        raise SystemExit(f"unknown preset(s) {sorted(unknown)}; have {list(PRESETS)}")
    compiling = any(p.startswith("compile") for p in paths)
    with contextlib.ExitStack() as stack:
        if args.whole_batch:
            stack.enter_context(pieces.whole_batch())
        if compiling:
            import torch._dynamo.config as dynamo_config
            import torch._inductor.config as inductor_config

            # A cold compile every run. Every backend and path recompiles the shared model
            # code (Encoder.forward, ...): dynamo's default of 8 entries per code object would
            # silently fall back to eager; past 64 the case fails instead.
            stack.enter_context(inductor_config.patch(force_disable_caches=True))
            stack.enter_context(
                dynamo_config.patch(
                    recompile_limit=64,
                    accumulated_recompile_limit=4096,
                    fail_on_recompile_limit_hit=True,
                )
            )
        return measure(args, device, backends, paths, names, config_dir, compiling)


def measure(args, device, backends, paths, names, config_dir, compiling) -> dict:
    rng = random.Random(args.seed)
    presets = [load_preset(n, config_dir, args) for n in names]
    n_cases = len(backends) * len(paths)
    work = [estimate_work(p, n_cases) for p in presets]
    gemm_n = args.gemm_n or (8192 if device.startswith("cuda") else 2048)
    dtypes = {"float32": torch.float32}
    for p in paths:
        if p in AMP_DTYPES and path_runs_on(p, device):
            dtypes[dtype_name(p)] = AMP_DTYPES[p]
    peaks: dict = {}

    def measure_peaks(when: str) -> None:
        for name, dt in dtypes.items():
            r = gemm_peak(device, dt, gemm_n, args.gemm_calls, args.gemm_budget, args.seed)
            peaks.setdefault(name, {})[when] = r
            progress(f"GEMM peak {name} ({when}): {r['gflops']:.1f} GFLOP/s (n={gemm_n})")

    measure_peaks("start")
    start = time.perf_counter()
    loads: list[float] = []
    out_presets = []
    for pi, preset in enumerate(presets):
        if compiling:
            torch._dynamo.reset()  # no preset reuses another's graphs: a cold first step
        inputs, labels, real = make_batch(preset, args.length_fraction, args.seed, device)
        cases: list[Case] = []
        results: list[dict] = []
        for backend in backends:
            for path in paths:
                reason = skip_reason(preset, backend, device, path)
                if reason:
                    results.append({"backend": backend.name, "path": path, "status": reason})
                    continue
                try:
                    case = Case(preset, backend, path, (inputs, labels), args)
                except Exception as err:  # reported in the table, not a crash
                    status = failure(err)
                    results.append({"backend": backend.name, "path": path, "status": status})
                    progress(f"[{preset['name']}] {backend.name} {path}: {status}")
                    continue
                case.result["layout"] = case.layout
                case.result["flops"] = count_flops(preset, case.layout)
                cases.append(case)
                results.append(case.result)
        untimed = max(1, args.warmup)
        total = untimed + args.rounds
        for r in range(total):
            live = [c for c in cases if c.result["status"] == "ok"]
            order = live[:]
            rng.shuffle(order)
            t0 = time.perf_counter()
            phase = "first step" if r == 0 else "warm-up" if r < untimed else "timed"
            for case in order:
                if r == 0 and case.compiled:
                    torch._dynamo.reset()  # a cold compile, sharing nothing with other cases
                try:
                    elapsed = time_call(case, device)
                except Exception as err:
                    case.fail(err)
                    progress(f"[{preset['name']}] {case.key}: {case.result['status']}")
                    continue
                if r == 0:
                    case.result["first_step_s"] = elapsed
                elif r >= untimed:
                    case.result["times_s"].append(elapsed)
                progress(
                    f"[{preset['name']}] round {r + 1}/{total} ({phase}) "
                    f"{case.backend.name:<14} {case.path:<13} {elapsed * 1e3:10.1f} ms"
                )
            if r == 0:
                first_round = time.perf_counter() - t0
                again = compile_again(cases, device, preset["name"])
                t0 += again  # the steady round time below excludes it
            now = time.perf_counter()
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
            loads.append(load)
            line = (
                f"[{preset['name']}] round {r + 1}/{total} ({phase}) done: {len(order)} steps "
                f"in {now - t0:.1f} s, total {now - start:.1f} s, load {load:.2f}"
            )
            if r >= 1:
                # Steady rounds scale with FLOPs; compiling does not. The memory pass costs
                # about one more round.
                per_round = now - t0
                steady = total + (0 if args.no_memory else 1)
                left_here = (total - 1 - r + (0 if args.no_memory else 1)) * per_round
                fixed = max(0.0, first_round - per_round) + again
                later = sum(fixed + steady * per_round * w / work[pi] for w in work[pi + 1 :])
                left = left_here + later
                line += f"; about {left / 60:.1f} min left (later presets scaled by FLOPs)"
            progress(line)
        if not args.no_memory:
            for case in cases:
                if case.result["status"] != "ok":
                    continue
                try:
                    peak, ops = peak_memory(case, device)
                except Exception as err:
                    case.fail(err)
                    continue
                case.result["peak_memory_bytes"] = peak
                if ops:
                    case.result["sdpa_ops"] = ops
        if args.profile:
            for case in cases:
                if case.result["status"] == "ok":
                    case.result["profile"] = profile_step(case, device, args.profile)
        summary = summarise({"results": results, "real_tokens": real}, peaks_now(peaks))
        for row in summary:
            progress(
                f"  [{preset['name']}] {row['backend']:<14} {row['path']:<13} "
                + (
                    row["status"]
                    if row["status"] != "ok"
                    else f"median {row['median_s'] * 1e3:10.1f} ms  ratio {row['ratio']:.3g}"
                )
            )
        out_presets.append({**preset, "real_tokens": real, "results": results})
        del cases, inputs, labels
    wall = time.perf_counter() - start
    measure_peaks("end")
    return {
        "presets": out_presets,
        "backends": [
            {"name": b.name, "label": b.label, "source": b.source, "attention": b.attention}
            for b in backends
        ],
        "paths": paths,
        "gemm_peaks": peaks,
        "threads": torch.get_num_threads(),
        "wall_s": wall,
        "loads": loads,
    }


# ------------------------------------------------------------------------------ summarising


def peaks_now(peaks: dict) -> dict[str, float]:
    """GFLOP/s per dtype: the higher of the measurements taken so far."""
    return {k: max(v["gflops"] for v in m.values()) for k, m in peaks.items()}


def summarise(preset: dict, peaks: dict[str, float]) -> list[dict]:
    """Per case: median time, tokens/s, ratio, GFLOP/s, % of peak, memory and its ratio."""
    results = preset["results"]
    ref = next(
        (
            r
            for r in results
            if r["backend"] == "softmax" and r["path"] == "eager" and r["status"] == "ok"
        ),
        None,
    )
    rows = []
    for r in results:
        row = {"backend": r["backend"], "path": r["path"], "status": r["status"]}
        xs = r.get("times_s") or []
        if r["status"] != "ok" or not xs:
            if r["status"] == "ok":
                row["status"] = "no timed rounds"
            rows.append(row)
            continue
        t = median(xs)
        ratio = float("nan")
        if ref is not None and len(ref["times_s"]) == len(xs):
            ratio = median([a / b for a, b in zip(xs, ref["times_s"])])
        flops = r["flops"]["step"]
        peak = peaks.get(dtype_name(r["path"]), float("nan"))
        mem, mem_ref = r.get("peak_memory_bytes"), (ref or {}).get("peak_memory_bytes")
        row.update(
            rounds=len(xs),
            median_s=t,
            min_s=min(xs),
            max_s=max(xs),
            tokens_per_s=preset["real_tokens"] / t,
            ratio=ratio,
            flops_step=flops,
            gflops=flops / t / 1e9,
            pct_peak=100 * flops / t / 1e9 / peak,
            peak_mem_bytes=mem,
            mem_ratio=mem / mem_ref if mem is not None and mem_ref else float("nan"),
            first_step_s=r.get("first_step_s", float("nan")),
            compile=r.get("compile"),
        )
        rows.append(row)
    return rows


def fmt(x: float | None, digits: int = 3) -> str:
    if x is None or x != x:
        return "–"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


METHOD_MD = """\
## Method

One training step of each preset's model: `zero_grad(set_to_none=True)`, forward and
cross-entropy loss (under `torch.autocast(bf16)` on the bf16 paths, as Lightning's
`bf16-mixed`; fp16 with a GradScaler, unscaled before clipping, on the fp16 path, as
`16-mixed`), backward, gradient clipping by norm (the preset's `gradient_clip_val`), AdamW
`step` (the task's `adamw_warmup_linear`: the preset's lr, weight decay, eps) and the LR
schedule's `step`. Model and batch shape from the preset YAML (model built by
`LitClassifier`: `EncoderClassifier`, `DualEncoderClassifier` for Retrieval); random token ids
with a padding mask. Every case runs the warm-up rounds (at least one; the first step, which
compiles on compiled paths, is reported as "first step"), then the timed rounds; each round
runs every case once in a freshly shuffled order.

- **ratio**: median over rounds of (case time / eager fp32 softmax time in the same round).
- **tokens/s**: real (non-padding) tokens of the batch / median time.
- **GFLOP/s**: counted FLOPs of the step (below) / median time; **% peak**: that over the
  GEMM peak measured in this run (fp32 `torch.mm` of two square matrices; bf16 and fp16 rows
  against the bf16 and fp16 peaks).
- **peak MiB**: peak extra bytes allocated during one more, untimed step (CPU: running sum of
  the allocator's allocations and frees recorded by `torch.profiler(profile_memory=True)`;
  CUDA: `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`, minus what was
  allocated before); **mem ratio**: that over the eager fp32 softmax step's.
- Compiled paths: `torch.compile(model, dynamic=True)`. **first step** is a cold compile
  (inductor caches off, `torch._dynamo.reset()` before it); **graphs / breaks** are what it
  compiled (`torch._dynamo.utils.counters`). The resets drop the other cases' graphs, so each
  compiled case compiles once more in an untimed step; **recompiles** counts frames compiled
  after that.

## FLOP counting

Analytic, in multiply-adds (FLOP = 2 × multiply-adds), per encoder layer and batch of B
sequences of N tokens (d_model m, H heads of d = m/H, FFN f): q/k/v/o projections
4·B·N·m², FFN 2·B·N·m·f; attention: softmax, softmax + ppSBN and nn.TransformerEncoder
2·B·H·N²·d (Q·Kᵀ and P·V); uniform none (the mean of v is a reduction); feature-map
backends 2·B·H·N·S·d for the map on q and on k (S = ω
rows: RMFA's `_omega.shape[0]`, FAVOR+'s random matrix rows, 0 for linear's elu+1) plus
2·B·H·N·D'·(d+1) for φ(k)ᵀ[v, 1] and φ(q)ᵀ·state (D' = feature rows the layer's map returns,
read from a forward; each RMFA layer has its own draw). Summed over layers, twice for
Retrieval's two documents, plus the head B·(in·f + f·classes) (in = m, 4m for Retrieval).
Not counted: embeddings, pooling and elementwise work (LayerNorm, GELU, softmax exponentials,
dropout, ppSBN, RMFA's degree products, masks, AdamW). N is the padded length (what the
kernels compute). Training step = 3 × forward (backward = 2 × forward).
"""


def layout_note(layout: list[dict]) -> str:
    feats = [x for x in layout if x["kind"] == "feature"]
    if not feats:
        return ""
    return "; ".join(f"layer {i}: S={x['S']}, D'={x['D']}" for i, x in enumerate(feats))


def preset_title(p: dict) -> str:
    init = p["model_init_args"]
    docs = " × 2 documents" if p["dual"] else ""
    total = p["batch"] * p["length"] * (2 if p["dual"] else 1)
    return (
        f"## {p['name']} (`{p['config']}`): B={p['batch']}, N={p['length']}{docs}, "
        f"{p['real_tokens']:,} real of {total:,} tokens; d_model {init['d_model']}, "
        f"{init['num_heads']} heads, {init['num_layers']} layers, FFN {init['ffn_dim']}, "
        f"dropout {init['dropout']}, lr {init.get('lr')}, clip {p['gradient_clip_val']}"
    )


def write_outputs(res: dict, out: Path, stem: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    info, extra, device = res["machine"], res["run"], res["args"]["device"]
    peaks = peaks_now(res["gemm_peaks"])
    labels = {b["name"]: b["label"] for b in res["backends"]}
    fields = [
        "device", "threads", "preset", "backend", "path", "status", "B", "N", "real_tokens",
        "rounds", "median_s", "min_s", "max_s", "tokens_per_s", "ratio_to_eager_softmax",
        "flops_step", "gflops_per_s", "pct_of_gemm_peak", "peak_mem_bytes",
        "mem_ratio_to_eager_softmax", "first_step_s", "graphs", "graph_breaks", "recompiles",
    ]  # fmt: skip
    csv_rows = []
    md = [md_header("Training step: LRA presets × attention backends × paths", info, extra)]
    md.append(METHOD_MD)
    for p in res["presets"]:
        rows = summarise(p, peaks)
        md.append(preset_title(p) + "\n")
        table = []
        for row in rows:
            base = {
                "device": device,
                "threads": res["threads"],
                "preset": p["name"],
                "backend": row["backend"],
                "path": row["path"],
                "status": row["status"],
                "B": p["batch"],
                "N": p["length"],
                "real_tokens": p["real_tokens"],
            }
            label = labels.get(row["backend"], row["backend"])
            if row["status"] != "ok":
                table.append([label, row["path"], row["status"], *["–"] * 10])
                csv_rows.append(base)
                continue
            c = row["compile"]
            comp = "–" if c is None else f"{c['graphs']} / {c['graph_breaks']} / {c['recompiles']}"
            mem = row["peak_mem_bytes"]
            table.append(
                [
                    label,
                    row["path"],
                    fmt(row["median_s"] * 1e3),
                    fmt(row["tokens_per_s"]),
                    fmt(row["ratio"]),
                    fmt(row["flops_step"] / 1e9),
                    fmt(row["gflops"]),
                    fmt(row["pct_peak"]),
                    fmt(None if mem is None else mem / 2**20),
                    fmt(row["mem_ratio"]),
                    fmt(row["first_step_s"]),
                    comp,
                    str(row["rounds"]),
                ]
            )
            base.update(
                rounds=row["rounds"],
                median_s=f"{row['median_s']:.6g}",
                min_s=f"{row['min_s']:.6g}",
                max_s=f"{row['max_s']:.6g}",
                tokens_per_s=f"{row['tokens_per_s']:.6g}",
                ratio_to_eager_softmax=f"{row['ratio']:.6g}",
                flops_step=row["flops_step"],
                gflops_per_s=f"{row['gflops']:.6g}",
                pct_of_gemm_peak=f"{row['pct_peak']:.4g}",
                peak_mem_bytes="" if mem is None else mem,
                mem_ratio_to_eager_softmax=f"{row['mem_ratio']:.6g}",
                first_step_s=f"{row['first_step_s']:.6g}",
                **(
                    {} if c is None else {k: c[k] for k in ("graphs", "graph_breaks", "recompiles")}
                ),
            )
            csv_rows.append(base)
        header = [
            "backend", "path", "ms", "tokens/s", "ratio", "GFLOP/step", "GFLOP/s", "% peak",
            "peak MiB", "mem ratio", "first step (s)", "graphs / breaks / recompiles", "rounds",
        ]  # fmt: skip
        md.append(md_table(header, table) + "\n")
        notes = []
        seen = set()
        for r in p["results"]:
            layout = layout_note(r.get("layout") or [])
            if layout and r["backend"] not in seen:
                seen.add(r["backend"])
                notes.append(f"- {labels.get(r['backend'], r['backend'])}: {layout}")
        kernels: dict[str, list[str]] = {}
        for r in p["results"]:
            if r.get("sdpa_ops"):
                kernels.setdefault(", ".join(r["sdpa_ops"]), []).append(
                    f"{r['backend']} {r['path']}"
                )
        for ops, who in kernels.items():
            notes.append(f"- SDPA kernels seen ({'; '.join(who)}): {ops}")
        if notes:
            md += ["Feature rows per layer and SDPA kernels:\n", *notes, ""]
        profiled = [r for r in p["results"] if r.get("profile")]
        if profiled:
            md.append(
                "Profiles (one more step under `torch.profiler`, ATen self time; the profiler "
                "itself slows small ops, so read shares, not times):\n"
            )
            for r in profiled:
                prof = r["profile"]
                shares = ", ".join(f"{g} {100 * v:.0f} %" for g, v in prof["shares"].items())
                tops = "; ".join(f"`{k}` {ms:.1f} ms ×{n}" for k, ms, n in prof["top"])
                calls = prof.get("aten_calls")  # absent from runs before it was counted
                calls = "" if calls is None else f"; {calls:,} top-level ATen calls"
                md.append(
                    f"- {labels.get(r['backend'], r['backend'])}, {r['path']}: "
                    f"{prof['total_ms']:.0f} ms of {prof['clock']} self time; {shares}"
                    f"{calls}. Top: {tops}"
                )
            md.append("")
    md.append("## Backends\n")
    for b in res["backends"]:
        spec = "" if b["attention"] is None else f": `{json.dumps(b['attention'])}`"
        md.append(f"- **{b['name']}** ({b['label']}), {b['source']}{spec}")
    md.append("")
    (out / f"{stem}.md").write_text("\n".join(md))
    with open(out / f"{stem}.csv", "w", newline="") as f:
        f.write(csv_comment_header(info, extra))
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(csv_rows)
    plot(res, peaks, out / f"{stem}.png")


def plot(res: dict, peaks: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = res["presets"]
    backends = [b["name"] for b in res["backends"]]
    paths = res["paths"]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(2, len(presets), figsize=(4.2 * len(presets) + 1, 8.5), squeeze=False)
    width = 0.8 / len(paths)
    for col, p in enumerate(presets):
        rows = {(r["backend"], r["path"]): r for r in summarise(p, peaks)}
        for row_i, (key, ylabel) in enumerate(
            (("ratio", "step time / eager fp32 softmax"), ("mem_ratio", "peak memory / softmax"))
        ):
            ax = axes[row_i, col]
            for j, path_name in enumerate(paths):
                xs, ys, failed = [], [], []
                for i, b in enumerate(backends):
                    r = rows.get((b, path_name))
                    x = i + (j - (len(paths) - 1) / 2) * width
                    if r is not None and r["status"].startswith("failed"):
                        failed.append(x)
                    if r is None or r["status"] != "ok" or not (r.get(key) == r.get(key)):
                        continue
                    xs.append(x)
                    ys.append(r[key])
                label = path_name if col == 0 and row_i == 0 else None
                color = colors[j % len(colors)]
                # Bars from 1 (the reference) up or down to the ratio.
                ax.bar(xs, [y - 1.0 for y in ys], width, bottom=1.0, color=color, label=label)
                ax.plot(failed, [1.0] * len(failed), "x", color=color, ms=8, mew=2)
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
            ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
            ax.tick_params(axis="y", which="minor", labelsize=7)
            ax.set_xticks(range(len(backends)), backends, rotation=45, ha="right", fontsize=8)
            ax.grid(True, axis="y", which="both", alpha=0.3)
            ax.set_ylabel(ylabel)
            if row_i == 0:
                ax.set_title(f"{p['name']}: B={p['batch']}, N={p['length']}", fontsize=10)
    fig.legend(loc="lower center", ncol=len(paths), fontsize=9)
    info = res["machine"]
    fig.suptitle(
        f"One training step per LRA preset, ratio to eager fp32 softmax (same run; × = failed); "
        f"{res['args']['device']}, {info.get('gpu', info['cpu'])}, threads={res['threads']}",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0.04, 1, 0.96))
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --------------------------------------------------------------------------------------- cli


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.train_step",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default cpu)")
    p.add_argument(
        "--presets",
        default=",".join(PRESETS),
        help=f"comma-separated LRA presets (default all: {','.join(PRESETS)})",
    )
    p.add_argument(
        "--backends",
        default=DEFAULT_BACKENDS,
        help=f"comma-separated backends (softmax always runs; default {DEFAULT_BACKENDS}; "
        "also torch_dropout: nn.TransformerEncoderLayer with dropout on attention weights)",
    )
    p.add_argument(
        "--paths",
        default="eager,bf16",
        help="comma-separated paths from eager,bf16,fp16,compile,compile+bf16 (eager always "
        "runs; fp16 on CUDA only; "
        "default eager,bf16: compiling every backend costs minutes on 2 CPU cores)",
    )
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (default 3)")
    p.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed rounds before the timed ones, at least one is run: its step is each "
        "case's first (the compile, on compiled paths), reported separately (default 1)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU intra-op threads (default 0: torch's default); recorded in the header",
    )
    p.add_argument(
        "--length-fraction",
        type=float,
        default=1.0,
        help="real length of each sequence uniform in [fraction·N, N], the first full "
        "(default 1: no padding; the padding mask is passed either way)",
    )
    p.add_argument(
        "--max-len",
        type=int,
        default=0,
        help="cap every preset's sequence length N (smoke runs; default 0: the preset's)",
    )
    p.add_argument(
        "--batch", type=int, default=0, help="batch size for every preset (default: the preset's)"
    )
    p.add_argument(
        "--gemm-n",
        type=int,
        default=0,
        help="size of the square matrices of the GEMM peak (default 2048 on CPU, 8192 on CUDA)",
    )
    p.add_argument(
        "--gemm-calls", type=int, default=5, help="timed torch.mm calls, median (default 5)"
    )
    p.add_argument(
        "--gemm-budget",
        type=float,
        default=10.0,
        help="stop the GEMM peak's calls (after at least 3) once they took this many seconds",
    )
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory step")
    p.add_argument(
        "--whole-batch",
        action="store_true",
        help="run the CPU's batch-piece passes (Maclaurin map, ppSBN) over the whole batch, "
        "as on a GPU: what a GPU step keeps, measured on the CPU",
    )
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after timing, profile one more step of each case and list its N ops with the "
        "most self time, with the shares of GEMMs, SDPA and copies (default 0: off)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="inputs, weights and round order (default 0)"
    )
    p.add_argument(
        "--configs", default="", help="configs folder (default: the repository's configs/)"
    )
    p.add_argument("--out", default=str(RESULTS), help="output folder")
    p.add_argument("--name", default="", help="file stem (default train_step[_cuda])")
    p.add_argument(
        "--render",
        default="",
        metavar="JSON",
        help="re-render the tables, CSV and plot from a previous run's raw JSON (no measuring)",
    )
    args = p.parse_args(argv)
    for name in ("rounds", "warmup", "threads", "max_len", "batch", "gemm_n"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    if args.profile < 0:
        p.error("--profile must be >= 0")
    if args.rounds < 1 or args.gemm_calls < 1:
        p.error("--rounds and --gemm-calls must be >= 1")
    if not 0.0 < args.length_fraction <= 1.0:
        p.error("--length-fraction must be in (0, 1]")
    return args


def default_stem(device: str) -> str:
    return "train_step" if device == "cpu" else "train_step_cuda"


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.render:
        res = json.loads(Path(args.render).read_text())
        stem = args.name or default_stem(res["args"]["device"])
        write_outputs(res, Path(args.out), stem)
        progress(f"re-rendered {args.render} into {args.out}/{stem}.*")
        return
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for, but torch.cuda.is_available() is False")
    info = machine_info(args.device)  # before --threads: it records torch's default
    threads_before = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    argv_used = sys.argv[1:] if argv is None else list(argv)
    extra = {
        "intra-op threads used": str(torch.get_num_threads()),
        "float32 matmul precision": torch.get_float32_matmul_precision(),
        "presets": args.presets,
        "backends": args.backends,
        "paths": args.paths,
        "rounds": f"{max(1, args.warmup)} untimed (the first is the first step) + "
        f"{args.rounds} timed per case; order shuffled every round",
        "padding": "none (all-True padding mask)"
        if args.length_fraction == 1.0
        else f"real lengths uniform in [{args.length_fraction}·N, N]",
        "batch pieces": "off (--whole-batch: every pass over the whole batch, as on a GPU)"
        if args.whole_batch
        else "the package's default (on a CPU the Maclaurin map and ppSBN run in batch pieces "
        f"of {pieces.PIECE_BYTES >> 20} MiB)",
        "command": " ".join(["python -m benchmarks.train_step", *argv_used]),
    }
    progress("\n".join(f"{k}: {v}" for k, v in {**info, **extra}.items()))
    try:
        res = run(args)
    finally:
        torch.set_num_threads(threads_before)
    for name, m in res["gemm_peaks"].items():
        extra[f"GEMM peak {name}"] = (
            f"{max(v['gflops'] for v in m.values()):.1f} GFLOP/s (torch.mm {m['start']['n']}², "
            f"median of {m['start']['calls']} and {m['end']['calls']} calls; start "
            f"{m['start']['gflops']:.1f}, end {m['end']['gflops']:.1f})"
        )
    extra["wall time"] = f"{res['wall_s']:.0f} s"
    if hasattr(os, "getloadavg"):
        extra["load average at end (1/5/15 min)"] = "{:.2f} / {:.2f} / {:.2f}".format(
            *os.getloadavg()
        )
    res = {"machine": info, "run": extra, **res, "args": vars(args)}
    res = json.loads(json.dumps(res))  # render exactly what --render will read back
    stem = args.name or default_stem(args.device)
    write_outputs(res, Path(args.out), stem)
    progress(f"wrote {args.out}/{stem}.{{md,csv,json,png}} in {res['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
