"""FSDP through the real CLI (2 gloo processes on CPU, ``configs/trainer/fsdp.yaml``) for the
seq2seq model: parameters really sharded, training equal to DDP's step for step (with
gradient clipping active), test metrics and translations of the FSDP run equal to those
of one plain process on its checkpoint, ``--ckpt_path last`` resuming exactly, random
features and pre-SBN statistics identical on both ranks, and a clear error instead of a
hang when the ranks would run different numbers of evaluation batches.

The test sets hold 13 examples with batches of 4: the ranks score 7 and 6 examples in two
batches each. The validation sets hold 9: shares of 5 and 4, which batches of 4 would cut
into 2 and 1 (a hang under FSDP); the loaders make them 2 and 2. ``max_len_a 0`` gives
every sentence the same decoding budget, so that the
translations do not depend on which sentences share a batch (1 process vs 2).
"""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import pytest
import torch
from ddp_probe import metric, read_rows, run_cli
from torch.distributed.fsdp import FullyShardedDataParallel

CLIP = 0.05  # below the gradient norm of these runs, so that clipping acts (asserted)

TRANSLATION = [
    "--config",
    "translation_synthetic.yaml",
    "--data.train_size",
    "32",
    "--data.val_size",
    "9",  # shares of 5 and 4: 2 + 2 batches of at most 4 (even counts, as FSDP needs)
    "--data.test_size",
    "13",
    "--data.batch_size",
    "4",
    "--data.tokenizer_vocab_size",
    "300",
    "--model.init_args.d_model",
    "16",
    "--model.init_args.num_heads",
    "2",
    "--model.init_args.num_encoder_layers",
    "2",
    "--model.init_args.num_decoder_layers",
    "1",
    "--model.init_args.ffn_dim",
    "32",
    # A budget that grows with the source (0.5 tokens per source token + 2): this tiny model,
    # barely trained, says much the same to every source, so the translations differ by
    # their lengths at least, and a sentence decoded with another's budget shows.
    "--model.init_args.max_len_a",
    "0.5",
    "--model.init_args.max_len_b",
    "2",
    # Untied embeddings and a small step keep the decoder close to its random start.
    "--model.init_args.tie_embeddings",
    "false",
    "--model.init_args.share_embeddings",
    "false",
    "--model.init_args.lr",
    "1e-4",
    "--model.init_args.warmup_steps",
    "1",
    "--trainer.gradient_clip_val",
    str(CLIP),
    "--trainer.max_steps",
    "6",
    "--trainer.max_epochs",
    "-1",
    "--trainer.val_check_interval",
    "3",
    "--trainer.log_every_n_steps",
    "1",
    "--trainer.deterministic",
    "true",
    "--trainer.enable_progress_bar",
    "false",
    "--wandb_mode",
    "disabled",
]


def fsdp(devices: int) -> list[str]:
    preset = ["--config", "trainer/fsdp.yaml"] if devices > 1 else []
    return [*preset, "--trainer.accelerator", "cpu", "--trainer.devices", str(devices)]


class FSDPProbe(L.Callback):
    """Saves to ``<out>/rank<r>.pt``: this rank's and the whole model's parameter counts
    at the start of training, the global gradient norm before every optimiser step (before
    clipping), and every ``(source ids, translation ids)`` decoded in test."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.state: dict = {"grad_norms": [], "translations": []}

    def on_train_start(self, trainer, pl_module) -> None:
        model = trainer.strategy.model
        local = sum(p.numel() for p in model.parameters())
        with FullyShardedDataParallel.summon_full_params(model):
            full = sum(p.numel() for p in model.parameters())
        units = len(FullyShardedDataParallel.fsdp_modules(model))
        self.state["params"] = {"local": local, "full": full, "units": units}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # Each rank holds its own shard of every gradient: the squares add up over ranks.
        sq = sum(
            p.grad.double().square().sum() for p in pl_module.parameters() if p.grad is not None
        )
        sq = trainer.strategy.reduce(torch.as_tensor(sq, dtype=torch.float64), reduce_op="sum")
        self.state["grad_norms"].append(float(sq.sqrt()))

    def on_test_start(self, trainer, pl_module) -> None:
        # The translations as scored (after each sentence's own length budget).
        translate = pl_module.translate

        def recording(batch):
            hypotheses = translate(batch)
            src_ids, mask = batch["src_ids"], batch["src_padding_mask"]
            sources = [tuple(row[m].tolist()) for row, m in zip(src_ids, mask)]
            self.state["translations"] += list(zip(sources, hypotheses))
            return hypotheses

        pl_module.translate = recording

    def on_test_end(self, trainer, pl_module) -> None:
        del pl_module.translate
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save(self.state, self.out / f"rank{trainer.global_rank}.pt")


def probe_config(tmp: Path, name: str) -> list[str]:
    path = tmp / f"{name}.yaml"
    path.write_text(
        "trainer:\n  callbacks:\n    - class_path: test_fsdp.FSDPProbe\n"
        f"      init_args:\n        out: {tmp / name}\n"
    )
    return ["--config", str(path)]


def stage_metrics(run_dir: Path) -> dict[str, float]:
    """The ``test/*`` values of a run's metrics.csv."""
    rows = read_rows(run_dir / "metrics.csv")
    return {k: float(v) for r in rows for k, v in r.items() if k.startswith("test/") and v}


def load(path: Path):
    return torch.load(path, weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """FSDP fit (and test of its best checkpoint) on 2 processes; the same checkpoint
    tested by 1 plain process; the same fit under DDP."""
    tmp = tmp_path_factory.mktemp("fsdp")
    common = [*TRANSLATION, "--data.data_dir", str(tmp / "data"), "--runs_dir", str(tmp / "runs")]
    proc = run_cli(
        ["fit", *common, *fsdp(2), *probe_config(tmp, "probe_fsdp"), "--experiment", "fsdp"],
        cwd=tmp,
    )
    assert "MEMBER: 2/2" in proc.stdout + proc.stderr, "not a 2-process run"
    best = next((tmp / "runs/fsdp/version_0/checkpoints").glob("best-*.ckpt"))
    run_cli(
        ["test", *common, *fsdp(1), *probe_config(tmp, "probe_one"), "--experiment", "one"]
        + ["--ckpt_path", str(best)],
        cwd=tmp,
    )
    run_cli(
        ["fit", *common, "--config", "trainer/ddp.yaml", "--trainer.accelerator", "cpu"]
        + ["--trainer.devices", "2", "--experiment", "ddp", "--test_after_fit", "false"],
        cwd=tmp,
    )
    return tmp, common


@pytest.mark.slow
def test_fsdp_shards_the_parameters(runs):
    tmp, _ = runs
    ranks = [load(tmp / f"probe_fsdp/rank{r}.pt")["params"] for r in (0, 1)]
    full, units = ranks[0]["full"], ranks[0]["units"]
    # The root unit (embeddings, decoder, output layer) and the two encoder blocks.
    assert units == 3
    assert ranks[0]["local"] + ranks[1]["local"] == full > 4000
    for rank in ranks:
        # Each unit's flat parameter splits in two halves, up to one element of padding.
        assert abs(rank["local"] - full / 2) <= units, (rank, full)


def test_fsdp_trains_like_ddp_with_clipping_by_norm(runs):
    tmp, _ = runs
    norms = load(tmp / "probe_fsdp/rank0.pt")["grad_norms"]
    assert len(norms) == 6 and min(norms) > CLIP  # every step was clipped
    fsdp_rows = read_rows(tmp / "runs/fsdp/version_0/metrics.csv")
    ddp_rows = read_rows(tmp / "runs/ddp/version_0/metrics.csv")
    fsdp_loss, ddp_loss = metric(fsdp_rows, "train/loss_step"), metric(ddp_rows, "train/loss_step")
    assert [s for s, _ in fsdp_loss] == list(range(6))
    for (step, a), (_, b) in zip(fsdp_loss, ddp_loss, strict=True):
        assert math.isclose(a, b, rel_tol=1e-5), (step, a, b)
    for (step, a), (_, b) in zip(
        metric(fsdp_rows, "val/loss"), metric(ddp_rows, "val/loss"), strict=True
    ):
        assert math.isclose(a, b, rel_tol=1e-5), (step, a, b)


def test_fsdp_test_equals_one_process_on_its_checkpoint(runs):
    tmp, _ = runs
    two = stage_metrics(tmp / "runs/fsdp/version_0")
    one = stage_metrics(tmp / "runs/one/version_0")
    assert set(two) == set(one) == {"test/loss", "test/ppl", "test/bleu", "test/bleu_tok"}
    assert 1.0 < one["test/ppl"] < 1e4
    for key in one:
        assert math.isclose(two[key], one[key], rel_tol=1e-5), (key, two[key], one[key])
    # Six steps are too few for BLEU above 0 within this file's time budget: compare the
    # translations themselves, every test sentence decoded once over the two ranks.
    decoded = [load(tmp / f"probe_fsdp/rank{r}.pt")["translations"] for r in (0, 1)]
    assert len(decoded[0]) == 7 and len(decoded[1]) == 6
    reference = dict(load(tmp / "probe_one/rank0.pt")["translations"])
    assert len(reference) == 13 and dict(decoded[0] + decoded[1]) == reference
    assert len({tuple(h) for h in reference.values()}) >= 4 and all(reference.values())


def close(a: torch.Tensor, b: torch.Tensor, scale: float | None = None) -> bool:
    """Equal up to 1e-5 of ``scale`` (default: the largest entry of ``a``)."""
    scale = float(a.abs().max()) if scale is None else scale
    return a.shape == b.shape and float((a - b).abs().max()) <= 1e-5 * scale


def test_fsdp_checkpoint_is_the_ddp_checkpoint(runs):
    # One file, loadable with weights_only: full weights and the optimiser state of the
    # whole model, with the weight-decay groups of the task (decided on full shapes).
    tmp, _ = runs
    fsdp_ckpt, ddp_ckpt = (
        torch.load(tmp / f"runs/{name}/version_0/checkpoints/last.ckpt", weights_only=True)
        for name in ("fsdp", "ddp")
    )
    assert fsdp_ckpt["global_step"] == ddp_ckpt["global_step"] == 6
    weights = fsdp_ckpt["state_dict"]
    assert weights.keys() == ddp_ckpt["state_dict"].keys()
    # Softmax is invariant to a key bias (it adds q·b to every logit of a row), so the key
    # projections' biases get a zero gradient plus rounding noise, which the two strategies
    # sum in another order and Adam turns into steps of up to lr·(1−β1)/√(1−β2) (Kingma & Ba
    # 2015, §2.1) in any direction: their bound is twice that budget over the six steps.
    beta1, beta2 = 0.9, 0.98
    noise_budget = 2 * 6 * 1e-4 * (1 - beta1) / math.sqrt(1 - beta2)
    for key, value in ddp_ckpt["state_dict"].items():
        if key.endswith("attn.k_proj.bias"):
            assert float((value - weights[key]).abs().max()) <= noise_budget, key
        else:
            assert close(value.float(), weights[key].float()), key
    fsdp_opt, ddp_opt = fsdp_ckpt["optimizer_states"][0], ddp_ckpt["optimizer_states"][0]
    groups = [len(g["params"]) for g in ddp_opt["param_groups"]]
    assert [len(g["params"]) for g in fsdp_opt["param_groups"]] == groups and min(groups) > 0
    # DDP numbers parameters in optimiser order, FSDP in model order.
    # Some gradients are rounding noise: compare against the largest state of each kind.
    order = [i for g in fsdp_opt["param_groups"] for i in g["params"]]
    for name in ("exp_avg", "exp_avg_sq"):
        scale = max(float(s[name].abs().max()) for s in ddp_opt["state"].values())
        for i, j in enumerate(order):
            expected, found = ddp_opt["state"][i][name], fsdp_opt["state"][j][name]
            assert close(expected, found, scale), (i, name)


@pytest.mark.slow  # two more 2-process runs; the DDP and SIGKILL resume tests run by default
def test_fsdp_resume_from_last_continues_the_same_run(runs, monkeypatch):
    tmp, common = runs
    args = ["fit", *common, *fsdp(2), "--experiment", "part", "--test_after_fit", "false"]
    stop = tmp / "stop.yaml"
    stop.write_text("trainer:\n  callbacks:\n    - class_path: ddp_probe.StopAtStep\n")
    monkeypatch.setenv("STOP_AT_STEP", "3")
    run_cli([*args, "--config", str(stop)], cwd=tmp)
    last = tmp / "runs/part/version_0/checkpoints/last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 3
    monkeypatch.delenv("STOP_AT_STEP")
    proc = run_cli([*args, "--ckpt_path", "last"], cwd=tmp)
    assert "Resuming from" in proc.stdout + proc.stderr

    full = metric(read_rows(tmp / "runs/fsdp/version_0/metrics.csv"), "train/loss_step")
    part = metric(read_rows(tmp / "runs/part/version_0/metrics.csv"), "train/loss_step")
    # Stopped mid-epoch (4 batches an epoch), with dropout: the optimiser state, the data
    # position and every rank's RNG states came back.
    assert [s for s, _ in part] == list(range(6))
    for (step, a), (_, b) in zip(part, full, strict=True):
        assert math.isclose(a, b, rel_tol=1e-6), (step, a, b)


def test_fsdp_rmfa_ppsbn_features_and_statistics_identical_on_both_ranks(runs, monkeypatch):
    tmp, common = runs
    monkeypatch.setenv("DDP_PROBE_DIR", str(tmp / "state"))
    dump = tmp / "dump.yaml"
    dump.write_text("trainer:\n  callbacks:\n    - class_path: ddp_probe.StateDump\n")
    run_cli(
        ["fit", *common, "--config", "attention/rmfa_exp.yaml", *fsdp(2), "--config", str(dump)]
        + ["--model.init_args.attention.num_features", "16", "--callbacks.redraw.policy", "steps"]
        + ["--callbacks.redraw.every_n_steps", "2", "--experiment", "rmfa"]
        + ["--test_after_fit", "false"],
        cwd=tmp,
    )
    r0, r1 = (load(tmp / f"state/rank{r}.pt") for r in (0, 1))
    assert [s["step"] for s in r0] == [s["step"] for s in r1] == list(range(1, 7))
    for a, b in zip(r0, r1):
        # Encoder 2 layers, decoder self- and cross-attention: 4 random-feature layers.
        assert len(a["features"]) == len(a["sbn"]) == 4
        for fa, fb in zip(a["features"], b["features"]):
            assert fa.keys() == fb.keys()
            assert all(torch.equal(fa[k], fb[k]) for k in fa), a["step"]
        for (ma, va), (mb, vb) in zip(a["sbn"], b["sbn"]):
            assert torch.equal(ma, mb) and torch.equal(va, vb), a["step"]
    assert [int(s["features"][0]["redraw_index"]) for s in r0] == [0, 0, 1, 1, 2, 2]
    # The single-file checkpoint holds the final draw and statistics of every layer.
    weights = torch.load(tmp / "runs/rmfa/version_0/checkpoints/last.ckpt", weights_only=True)[
        "state_dict"
    ]
    layers = ["encoder.blocks.0.attn", "encoder.blocks.1.attn", "blocks.0.self_attn"]
    layers.append("blocks.0.cross_attn")
    for layer, features, (mean, var) in zip(layers, r0[-1]["features"], r0[-1]["sbn"]):
        prefix = f"model.{layer}.backend."
        for key, value in features.items():
            assert torch.equal(weights[prefix + "inner." + key], value), (layer, key)
        assert torch.equal(weights[prefix + "running_mean"], mean), layer
        assert torch.equal(weights[prefix + "running_var"], var), layer


@pytest.mark.slow
def test_fsdp_uneven_evaluation_batches_stop_with_a_message(runs):
    tmp, common = runs
    # Batches of one (the loaders can only even out batches from 2 on): one step, no
    # validation (the sanity check runs 2 batches on each rank), then the test after fit
    # with shares of 7 and 6 examples, 7 and 6 batches.
    proc = run_cli(
        ["fit", *common, *fsdp(2), "--data.eval_batch_size", "1"]
        + ["--experiment", "uneven", "--trainer.max_steps", "1"],
        cwd=tmp,
        timeout=120,
        expect_ok=False,
    )
    assert proc.returncode == 2
    assert "macformer_lit: error: FSDP runs every test batch on all ranks together" in proc.stderr
    assert "[[7], [6]] batches" in proc.stderr
