"""The standard callbacks of a CLI run (callbacks/standard.py): one ``callbacks:`` group shown
by --print_config, each entry its settings or false, from the command line or a config
file; the keys from before the group (moved_keys.py) read at their new place."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from tiny_run import tiny_listops

from macformer_lit import moved_keys, provenance
from macformer_lit.callbacks import (
    AttentionTelemetry,
    FeatureRedraw,
    NaNGuard,
    ReleaseHostMemory,
    StandardCallbacks,
)
from macformer_lit.callbacks.distributed import RNGStateCheckpoint
from macformer_lit.callbacks.monitor import ThroughputMemoryMonitor
from macformer_lit.callbacks.preemption import (
    EpochAccumulatorsCheckpoint,
    LatestCheckpoint,
    MetricsRowsCheckpoint,
    SaveOnSigterm,
)
from macformer_lit.checkpoints import resume_changes
from macformer_lit.cli import MacformerCLI, main

ALL = (
    RNGStateCheckpoint,
    ThroughputMemoryMonitor,
    LearningRateMonitor,
    LatestCheckpoint,
    SaveOnSigterm,
    MetricsRowsCheckpoint,
)
# What each entry adds to the Trainer.
ADDS = {
    "nan_guard": [NaNGuard],
    "memory": [ReleaseHostMemory],
    "redraw": [FeatureRedraw],
    "telemetry": [AttentionTelemetry],
    "best_checkpoint": [ModelCheckpoint],
    "last_checkpoint": [LatestCheckpoint],
    "save_on_sigterm": [SaveOnSigterm],
    "metrics_rows": [MetricsRowsCheckpoint, EpochAccumulatorsCheckpoint],
    "rng_states": [RNGStateCheckpoint],
    "lr_monitor": [LearningRateMonitor],
    "throughput": [ThroughputMemoryMonitor],
}
GROUP = {
    "nan_guard": {"action": "stop", "max_reports": 3, "min_loss_scale": 1.0},
    "memory": {"every_n_steps": 0},
    "redraw": {"policy": "never", "every_n_steps": 1000, "seed": 0},
    "telemetry": {"every_n_steps": 100, "batch_size": 1, "max_queries": 256},
    "best_checkpoint": {"save_top_k": 1},
    "last_checkpoint": True,
    "save_on_sigterm": True,
    "metrics_rows": True,
    "rng_states": True,
    "lr_monitor": {"logging_interval": "step"},
    "throughput": True,
}
# A run recorded before the group, with every old group (committed, never rewritten).
OLD_RUN = Path(__file__).parents[2] / (
    "results/synthetic_ppsbn_temperature/method=softmax_ppsbn,seed=0/version_0/config.yaml"
)
OLD_GROUPS = ("nan_guard", "memory", "redraw", "telemetry", "run_callbacks")


def build(tmp_path, *extra):
    args = tiny_listops(tmp_path / "data", tmp_path / "runs", "--wandb_mode", "disabled", *extra)
    return MacformerCLI(args, run=False).trainer


def kinds(trainer) -> list[type]:
    return [type(c) for c in trainer.callbacks]


def described(trainer) -> list[tuple]:
    """Each callback's kind and the settings the group can change."""
    names = ("action", "max_reports", "min_loss_scale", "every_n_steps", "policy", "seed")
    names += ("batch_size", "max_queries", "save_top_k", "logging_interval", "monitor")
    return [
        (type(c).__name__, *((n, getattr(c, n)) for n in names if hasattr(c, n)))
        for c in trainer.callbacks
    ]


def note_lines(capsys) -> list[str]:
    err = capsys.readouterr().err
    return [ln for ln in err.splitlines() if ln.startswith("macformer_lit: note: old option")]


def test_every_standard_callback_is_on_by_default(tmp_path):
    trainer = build(tmp_path)
    for kind in ALL:
        assert kinds(trainer).count(kind) == 1, kind
    best = trainer.checkpoint_callback
    assert type(best) is ModelCheckpoint and best.monitor == "val/acc" and best.save_top_k == 1


def test_each_can_be_switched_off_or_retuned_from_the_command_line(tmp_path):
    trainer = build(
        tmp_path,
        "--callbacks.rng_states",
        "false",
        "--callbacks.throughput",
        "false",
        "--callbacks.lr_monitor",
        "false",
        "--callbacks.save_on_sigterm",
        "false",
        "--callbacks.metrics_rows",
        "false",
        "--callbacks.best_checkpoint.save_top_k",
        "3",
    )
    present = kinds(trainer)
    for kind in (RNGStateCheckpoint, ThroughputMemoryMonitor, LearningRateMonitor):
        assert kind not in present
    for kind in (SaveOnSigterm, MetricsRowsCheckpoint):
        assert kind not in present
    assert trainer.checkpoint_callback.save_top_k == 3
    assert LatestCheckpoint in present


def test_from_a_config_file_without_the_best_checkpoint(tmp_path):
    config = tmp_path / "lean.yaml"
    config.write_text(
        yaml.safe_dump(
            {"callbacks": {"best_checkpoint": False, "lr_monitor": {"logging_interval": "epoch"}}}
        )
    )
    trainer = build(tmp_path, "--config", str(config))
    # The last checkpoint is then the one the test after fit reads.
    assert type(trainer.checkpoint_callback) is LatestCheckpoint
    assert [type(c) for c in trainer.callbacks].count(LatestCheckpoint) == 1
    lr = next(c for c in trainer.callbacks if isinstance(c, LearningRateMonitor))
    assert lr.logging_interval == "epoch"


def test_print_config_shows_the_group_with_every_entry(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "macformer_lit", "fit", "--config", "listops_short_cpu.yaml",
         "--print_config"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    config = yaml.safe_load(out)
    assert config["callbacks"] == GROUP
    # Gathered in one group: none of the old ones is left.
    assert not set(OLD_GROUPS) & set(config)


def test_the_group_round_trips_through_config_yaml(tmp_path):
    """Retuned and switched-off entries in the saved config.yaml read back as given."""
    asked = ["--callbacks.telemetry", "false", "--callbacks.nan_guard.action", "skip"]
    asked += ["--callbacks.best_checkpoint.save_top_k", "2", "--callbacks.throughput", "false"]
    out = subprocess.run(
        [sys.executable, "-m", "macformer_lit", "fit", "--config", "listops_short_cpu.yaml",
         *asked, "--print_config"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    saved = tmp_path / "config.yaml"
    saved.write_text(out)
    again = subprocess.run(
        [sys.executable, "-m", "macformer_lit", "fit", "--config", str(saved), "--print_config"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    group = yaml.safe_load(again)["callbacks"]
    assert group == yaml.safe_load(out)["callbacks"]
    assert group["telemetry"] is False and group["throughput"] is False
    assert group["nan_guard"]["action"] == "skip"
    assert group["best_checkpoint"] == {"save_top_k": 2}


@pytest.mark.parametrize("name", list(ADDS))
def test_each_entry_switched_off_removes_exactly_its_callbacks(tmp_path, name):
    def added(group: StandardCallbacks) -> list[type]:
        built = group.add_to(
            [],
            run_dir=tmp_path,
            monitor=("val/acc", "max"),
            checkpointing=True,
            logging=True,
            resume_command="",
        )
        return [type(c) for c in built]

    every = added(StandardCallbacks())
    assert sorted(map(str, every)) == sorted(str(k) for ks in ADDS.values() for k in ks)
    assert added(StandardCallbacks(**{name: False})) == [k for k in every if k not in ADDS[name]]


def test_every_entry_switched_off_from_a_config_file_leaves_the_run_its_own(tmp_path):
    config = tmp_path / "bare.yaml"
    config.write_text(yaml.safe_dump({"callbacks": dict.fromkeys(GROUP, False)}))
    present = {k.__name__ for k in kinds(build(tmp_path, "--config", str(config)))}
    # Lightning adds a ModelCheckpoint of its own where checkpointing is on and none is given.
    standard = {k.__name__ for ks in ADDS.values() for k in ks} - {"ModelCheckpoint"}
    assert not present & standard, present & standard
    assert {"ShareRunDir", "RecordRun", "SaveRunConfig"} <= present


@pytest.mark.parametrize(
    "kind, init_args, check",
    [
        (NaNGuard, {"action": "skip"}, ("action", "skip")),
        (ReleaseHostMemory, {"every_n_steps": 5}, ("every_n_steps", 5)),
        (FeatureRedraw, {"policy": "steps", "every_n_steps": 2}, ("policy", "steps")),
        (AttentionTelemetry, {"every_n_steps": 7}, ("every_n_steps", 7)),
    ],
)
def test_a_user_callback_of_the_same_kind_replaces_the_standard_one(
    tmp_path, kind, init_args, check
):
    config = tmp_path / "own.yaml"
    path = f"{kind.__module__}.{kind.__name__}"
    config.write_text(
        yaml.safe_dump({"trainer": {"callbacks": [{"class_path": path, "init_args": init_args}]}})
    )
    trainer = build(tmp_path, "--config", str(config))
    ours = [c for c in trainer.callbacks if isinstance(c, kind)]
    assert len(ours) == 1
    assert getattr(ours[0], check[0]) == check[1]


def test_old_options_are_read_at_their_new_place_with_a_note(tmp_path, capsys):
    old = build(
        tmp_path,
        *("--nan_guard.action", "skip", "--memory.every_n_steps", "2"),
        *("--redraw.policy", "steps", "--telemetry.every_n_steps=50"),
        *("--run_callbacks.save_top_k", "3", "--run_callbacks.lr_logging_interval", "epoch"),
        *("--run_callbacks.throughput", "false", "--run_callbacks.rng_states=false"),
    )
    (note,) = note_lines(capsys)
    for moved in (
        "--nan_guard.action → --callbacks.nan_guard.action",
        "--telemetry.every_n_steps → --callbacks.telemetry.every_n_steps",
        "--run_callbacks.save_top_k → --callbacks.best_checkpoint.save_top_k",
        "--run_callbacks.lr_logging_interval → --callbacks.lr_monitor.logging_interval",
        "--run_callbacks.{throughput,rng_states} → --callbacks.{throughput,rng_states}",
    ):
        assert moved in note, note
    new = build(
        tmp_path,
        *("--callbacks.nan_guard.action", "skip", "--callbacks.memory.every_n_steps", "2"),
        *("--callbacks.redraw.policy", "steps", "--callbacks.telemetry.every_n_steps=50"),
        *("--callbacks.best_checkpoint.save_top_k", "3"),
        *("--callbacks.lr_monitor.logging_interval", "epoch"),
        *("--callbacks.throughput", "false", "--callbacks.rng_states=false"),
    )
    assert note_lines(capsys) == []
    assert described(old) == described(new)
    assert described(new) != described(build(tmp_path))


def _without_subcommand_keys(text: str) -> str:
    # ckpt_path and weights_only belong to the subcommands a run=False CLI does not have.
    return "".join(
        ln for ln in text.splitlines(True) if not ln.startswith(("ckpt_path:", "weights_only:"))
    )


def test_an_old_config_yaml_is_read_at_the_new_place_with_a_note(tmp_path, capsys):
    text = _without_subcommand_keys(OLD_RUN.read_text())
    assert all(f"\n{g}:\n" in text for g in OLD_GROUPS)
    old = tmp_path / "old.yaml"
    old.write_text(text)
    config = yaml.safe_load(text)
    for group in OLD_GROUPS:
        del config[group]
    new = tmp_path / "new.yaml"
    new.write_text(yaml.safe_dump({**config, "callbacks": GROUP}))
    here = ["--runs_dir", str(tmp_path / "runs"), "--data.data_dir", str(tmp_path / "data")]
    here += ["--wandb_mode", "disabled"]
    from_old = MacformerCLI(["--config", str(old), *here], run=False).trainer
    (note,) = note_lines(capsys)
    assert "nan_guard → callbacks.nan_guard" in note and "redraw → callbacks.redraw" in note
    assert "run_callbacks.save_top_k → callbacks.best_checkpoint.save_top_k" in note
    from_new = MacformerCLI(["--config", str(new), *here], run=False).trainer
    assert note_lines(capsys) == []
    assert described(from_old) == described(from_new)


def test_a_saved_config_read_back_has_the_group_as_a_new_run_records_it():
    """What report, sweep and a resume compare (provenance.effective_config)."""
    config = provenance.effective_config(yaml.safe_load(OLD_RUN.read_text()), [])
    assert config["callbacks"] == GROUP
    assert not set(OLD_GROUPS) & set(config)
    # A change a resume recorded before the keys moved applies at their new place.
    change = {"key": "run_callbacks.save_top_k", "old": 1, "new": 4}
    later = provenance.effective_config(
        yaml.safe_load(OLD_RUN.read_text()), [{"changes": [change]}]
    )
    assert later["callbacks"]["best_checkpoint"] == {"save_top_k": 4}


def test_a_sweep_sees_an_older_run_as_unchanged_and_a_switched_entry_as_changed():
    """A run recorded before the group and before nan_guard had min_loss_scale: the same
    settings now are no change, so the sweep does not run its point again."""
    from macformer_lit.sweep import changed_settings

    older = OLD_RUN.parents[3] / "synthetic_ppsbn/method=softmax,seed=0/version_0/config.yaml"
    recorded = provenance.effective_config(yaml.safe_load(older.read_text()), [])
    assert "min_loss_scale" not in recorded["callbacks"]["nan_guard"]
    now = {k: v for k, v in recorded.items() if k != "callbacks"}
    assert changed_settings(recorded, {**now, "callbacks": GROUP}) == []
    off = {**GROUP, "redraw": False}
    assert changed_settings(recorded, {**now, "callbacks": off}) == [
        "callbacks.redraw: true -> false"
    ]


def test_a_resume_that_switches_an_entry_is_compared_whole():
    on = {"callbacks": {"redraw": GROUP["redraw"], "telemetry": GROUP["telemetry"]}}
    off = {"callbacks": {"redraw": False, "telemetry": False}}
    refused, allowed = resume_changes(on, off)
    # Switching the redraws off changes what is trained; the telemetry only observes.
    assert refused == [
        "callbacks.redraw: checkpoint has {policy: never, every_n_steps: 1000, seed: 0}, "
        "this run false"
    ]
    assert [c["key"] for c in allowed] == ["callbacks.telemetry"]


@pytest.mark.parametrize(
    "argv, expected",
    [
        # run_callbacks ignored the settings of an entry it switched off.
        (
            ["--run_callbacks.save_top_k", "3", "--run_callbacks.best_checkpoint", "false"],
            ["--callbacks.best_checkpoint", "false"],
        ),
        # ... and true kept them.
        (
            ["--run_callbacks.lr_logging_interval=epoch", "--run_callbacks.lr_monitor", "true"],
            ["--callbacks.lr_monitor.logging_interval=epoch"],
        ),
        (
            ["--run_callbacks", "{throughput: false, save_top_k: 2}", "--x", "1"],
            ["--callbacks.throughput", "false", "--callbacks.best_checkpoint", "{save_top_k: 2}"]
            + ["--x", "1"],
        ),
        # Unknown keys stay as given, to be refused as given.
        (["--run_callbacks.foo", "1"], ["--run_callbacks.foo", "1"]),
        (["--memory", "{every_n_steps: 3}"], ["--callbacks.memory", "{every_n_steps: 3}"]),
    ],
)
def test_old_options_move_as_run_callbacks_meant_them(argv, expected):
    assert moved_keys.migrate_args(argv)[0] == expected


def to_old_layout(config: dict) -> dict:
    """``config`` as a run recorded before the group held it."""
    out = dict(config)
    group = out.pop("callbacks")
    for name in ("nan_guard", "memory", "redraw", "telemetry"):
        out[name] = group[name]
    flags = {k: bool(group[k]) for k in moved_keys.FLAGS}
    out["run_callbacks"] = {
        **flags,
        "save_top_k": group["best_checkpoint"]["save_top_k"],
        "lr_logging_interval": group["lr_monitor"]["logging_interval"],
    }
    return out


def test_a_resume_of_a_run_recorded_with_the_old_keys(tmp_path, capsys):
    """Not refused with the same settings; refused, naming the new key, when one that
    changes what is trained differs."""
    quiet = ["--wandb_mode", "disabled", "--trainer.enable_progress_bar", "false"]
    quiet += ["--experiment", "a", "--test_after_fit", "false"]

    def fit(*extra: str) -> list[str]:
        return ["fit", *tiny_listops(tmp_path / "data", tmp_path / "runs", *quiet, *extra,
                                     small_model=True)]  # fmt: skip

    main(fit("--trainer.max_steps", "2"))
    run = tmp_path / "runs/a/version_0"
    config = yaml.safe_load((run / "config.yaml").read_text())
    (run / "config.yaml").write_text(yaml.safe_dump(to_old_layout(config), sort_keys=False))
    last = run / "checkpoints/last.ckpt"
    ckpt = torch.load(last, weights_only=True)
    recorded = ckpt[provenance.CHECKPOINT_KEY]
    recorded["config"] = to_old_layout(recorded["config"])
    torch.save(ckpt, last)
    capsys.readouterr()

    with pytest.raises(SystemExit) as err:
        main(fit("--trainer.max_steps", "4", "--callbacks.redraw.policy", "steps",
                 "--ckpt_path", "last"))  # fmt: skip
    assert err.value.code == 2
    assert "callbacks.redraw.policy: checkpoint has never, this run steps" in (
        capsys.readouterr().err
    )
    main(fit("--trainer.max_steps", "4", "--ckpt_path", "last"))
    assert "would change what is trained" not in capsys.readouterr().err
    assert torch.load(last, weights_only=True)["global_step"] == 4
    assert not (tmp_path / "runs/a/version_1").exists()
