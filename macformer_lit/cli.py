"""``python -m macformer_lit {fit,validate,test,predict,sweep,report}`` through LightningCLI.

The only module that knows every part: it links the DataModule's ``vocab_size``,
``num_classes``, ``max_len`` and ``pad_id`` into the model, resolves bare config names to
the shipped ``configs/`` folder, and lays out each run as

    runs/<experiment>/version_<n>/{config.yaml, metrics.csv, checkpoints/, wandb/}

with a CSV logger and Weights & Biases (offline without credentials) by default, and
``provenance.yaml`` recording what ran (``provenance.py``). ``--ckpt_path last`` resumes from
the newest version of the experiment that has a ``checkpoints/last.ckpt``, and keeps writing
into that version; a resume that would change what is trained is refused
(``checkpoints.check_fits``), and the first ``config.yaml`` is never rewritten.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import textwrap
import typing
from importlib import import_module
from pathlib import Path
from typing import Any, Literal

# Lightning 2.6 still calls deprecated jsonargparse APIs; the warnings only confuse users.
os.environ.setdefault("JSONARGPARSE_DEPRECATION_WARNINGS", "off")

import warnings  # noqa: E402

import lightning as L  # noqa: E402
from jsonargparse import DefaultHelpFormatter  # noqa: E402
from lightning.pytorch.cli import (  # noqa: E402
    LightningArgumentParser,
    LightningCLI,
    SaveConfigCallback,
)
from lightning.pytorch.loggers import CSVLogger, Logger  # noqa: E402
from lightning.pytorch.plugins.io import CheckpointIO  # noqa: E402
from lightning.pytorch.utilities import rank_zero_info  # noqa: E402
from lightning.pytorch.utilities.exceptions import (  # noqa: E402
    MisconfigurationException,
    SIGTERMException,
)

from macformer_lit import interrupts, locks, provenance  # noqa: E402
from macformer_lit.attention.spec import (  # noqa: E402
    ParsedSpec,
    check_attention_spec,
    describe_backends,
    parse_spec,
    spec_arguments,
)
from macformer_lit.callbacks import (  # noqa: E402
    AttentionTelemetry,
    FeatureRedraw,
    NaNGuard,
    ReleaseHostMemory,
)
from macformer_lit.callbacks.predictions import PredictionWriter  # noqa: E402
from macformer_lit.callbacks.standard import RunCallbacks  # noqa: E402
from macformer_lit.checkpoints import (  # noqa: E402
    CheckpointError,
    SafeCheckpointIO,
    check_fits,
    load_checkpoint,
    resolve_ckpt_path,
)
from macformer_lit.loggers import (  # noqa: E402
    AutoWandbLogger,
    Mode,
    RunCSVLogger,
    check_wandb_mode,
    finish_wandb_quietly,
)
from macformer_lit.models.dropout import set_mask_generator  # noqa: E402
from macformer_lit.preflight import (  # noqa: E402
    UsageError,
    check_config_file,
    check_experiment,
    check_feature_memory,
    check_folder,
    check_launch,
    check_model_size,
    check_schedule,
    check_seeds,
    check_task_data,
    check_task_given,
    check_trainer_values,
    disk_full,
    install_parser_loaders,
    short_parse_error,
)
from macformer_lit.runs import (  # noqa: E402
    RunFolder,
    launch_rank,
    next_version,
    version_folder,
)
from macformer_lit.tasks.base import LitTask  # noqa: E402

# Lightning's own use of a deprecated torch pytree API; nothing a user can act on.
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
# Rank 0's run folder, inherited by the ranks Lightning launches for DDP.
RUN_DIR_ENV = "MACFORMER_RUN_DIR"
# Run folders this process claimed and has not started a loop in yet.
_PENDING: list[RunFolder] = []


class ShareRunDir(L.Callback):
    """Every rank takes rank 0's run folder once the process group is up.

    Ranks that Lightning launches inherit the folder through ``MACFORMER_RUN_DIR``. Under
    torchrun or SLURM all ranks start at once and each guesses the next free
    ``version_<n>`` before any process group exists; only rank 0 creates its folder, and
    at setup it broadcasts the path, so that what the other ranks write (NaN forensics,
    sharded checkpoints) and the messages they print name the same folder.
    """

    def __init__(self, cli: MacformerCLI) -> None:
        self.cli = cli

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        shared = Path(trainer.strategy.broadcast(str(self.cli.run_dir), src=0))
        if shared != self.cli.run_dir:
            self.cli.run_dir = shared
            # Trainer.default_root_dir has no setter; it reads this attribute.
            trainer._default_root_dir = str(shared)

    # Once a loop starts, the folder holds the run (a failure later keeps it, with its
    # checkpoints and NaN forensics); before that, a failed start removes it (main()).
    def _started(self, *_) -> None:
        for folder in _PENDING:
            folder.keep()

    on_train_start = on_test_start = on_predict_start = _started

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "validate":
            self._started()


class RecordRun(L.Callback):
    """``provenance.yaml``: one entry when this process's first loop starts (rank 0), so a
    run that fails to start records nothing; and every checkpoint carries the config it
    trained with, which a resume is compared with (``checkpoints.check_fits``)."""

    def __init__(self, cli: MacformerCLI) -> None:
        self.cli = cli
        self.written = False

    def _record(self, trainer: L.Trainer, *_) -> None:
        if self.written or not trainer.is_global_zero:
            return
        self.written = True
        cli = self.cli
        trainer_cfg = cli._cfg(cli.config).get("trainer") or {}
        provenance.append(
            cli.run_dir,
            provenance.entry(
                trainer,
                subcommand=cli.subcommand,
                argv=cli.original_argv,
                asked_precision=trainer_cfg.get("precision"),
                checkpoint=cli._checkpoint_info,
                changes=cli._resume_changes,
            ),
        )

    on_train_start = on_test_start = on_predict_start = _record

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "validate":
            self._record(trainer)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        if self.cli._run_config is not None:
            checkpoint[provenance.CHECKPOINT_KEY] = {
                "config": self.cli._run_config,
                "precision": str(trainer.precision),
                "world_size": trainer.world_size,
            }


# DataModule attributes linked into the model; a link whose source or target is absent is
# skipped (Lightning data modules without bos/eos, models without num_classes).
LINKED = ("vocab_size", "num_classes", "max_len", "pad_id", "bos_id", "eos_id")


class ConfigNotFound(SystemExit):
    pass


def task_configs() -> list[str]:
    """The shipped configs that name a model and data (the others are overlays)."""
    return sorted(
        p.name for p in CONFIG_DIR.glob("*.yaml") if "class_path:" in p.read_text(errors="replace")
    )


def shipped_configs() -> list[str]:
    return sorted(str(p.relative_to(CONFIG_DIR)) for p in CONFIG_DIR.rglob("*.yaml"))


# Shipped configs that were renamed: the old name gets one line saying what to write.
RENAMED_CONFIGS = {
    "lra_listops_cpu.yaml": "listops_short_cpu.yaml (the CPU main job; it trains on short "
    "ListOps trees, so it is no longer named after the LRA task, which is lra_listops.yaml)",
}


def resolve_config(name: str) -> str:
    """A path that exists is used as is; otherwise look in the shipped ``configs/``."""
    if Path(name).is_file():
        return name
    renamed = RENAMED_CONFIGS.get(name) or RENAMED_CONFIGS.get(f"{name}.yaml")
    if renamed:
        raise ConfigNotFound(f"macformer_lit: error: config {name!r} was renamed: use {renamed}")
    for candidate in (CONFIG_DIR / name, CONFIG_DIR / f"{name}.yaml"):
        if candidate.is_file():
            return str(candidate)
    raise ConfigNotFound(
        f"macformer_lit: error: config {name!r} is neither a file nor a config shipped in "
        f"{CONFIG_DIR}.\nShipped configs: {', '.join(shipped_configs())}"
    )


def resolve_config_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Rewrite every ``--config NAME`` / ``-c NAME`` / ``--config=NAME``; also return the
    config stems, which name the experiment by default."""
    out, stems = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        value = None
        if arg in ("--config", "-c") and i + 1 < len(argv):
            value, i = argv[i + 1], i + 1
            out.append(arg)
        elif arg.startswith("--config="):
            value = arg.split("=", 1)[1]
            out.append("--config")
        else:
            out.append(arg)
        if value is not None:
            path = resolve_config(value)
            check_config_file(path)
            out.append(path)
            stems.append(config_stem(path))
        i += 1
    return out, stems


def config_stem(path: str) -> str:
    """The config's part of an experiment name: a shipped config by its place in
    ``configs/`` (``attention/rmfa_exp.yaml`` -> ``attention-rmfa_exp``), any other file by
    its file name alone (``/abs/dir/my.yaml`` -> ``my``)."""
    resolved = Path(path).resolve()
    shipped = CONFIG_DIR.resolve()
    if resolved.is_relative_to(shipped):
        return resolved.relative_to(shipped).with_suffix("").as_posix().replace("/", "-")
    return resolved.stem


class SaveRunConfig(SaveConfigCallback):
    """``config.yaml`` in the run folder, and the same resolved config in the W&B run."""

    def save_config(self, trainer, pl_module, stage) -> None:
        config = self.parser.dump(self.config, skip_none=False, format="yaml")
        for lg in trainer.loggers:
            if isinstance(lg, AutoWandbLogger):
                from macformer_lit import yamlio

                lg.experiment.config.update({"cli": yamlio.load(config)}, allow_val_change=True)


class _CurrentStderr(logging.StreamHandler):
    """A handler writing to ``sys.stderr`` as it is at each record, not as it was when the
    first run of the process installed it: a later ``main()`` in the same process (a notebook,
    a test, stderr redirected meanwhile) still gets the lines, never a closed stream."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _show_package_logs() -> None:
    """Let the data modules' info lines (truncation counts, split notes) reach the console."""
    logger = logging.getLogger("macformer_lit")
    if not logger.handlers:
        handler = _CurrentStderr()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


DESCRIPTION = (
    "macformer_lit: train and evaluate Transformers whose attention is exact softmax or a "
    "random-feature approximation (Macformer's RMFA with ppSBN, SchoenbAt, Performer's "
    "FAVOR+, linear) on Long Range Arena and Multi30K."
)
SUBCOMMANDS = {
    "fit": "train, then test the best checkpoint",
    "validate": "score a checkpoint on the validation split",
    "test": "score a checkpoint on the test split",
    "predict": "write a checkpoint's predictions to predictions.csv",
    "report": "tables and plots from finished runs (report --help)",
    "sweep": "run a grid of fits from a sweep file (sweep --help)",
}
EPILOG = "subcommands: " + "; ".join(f"{k}: {v}" for k, v in SUBCOMMANDS.items())


def _import_class(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(import_module(module), name)


def _is_task(model) -> bool:
    """Whether the model config names one of our tasks (``LitTask``: linear-decay schedule)."""
    class_path = model.get("class_path") if model is not None and "class_path" in model else None
    if not isinstance(class_path, str):
        return False
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(import_module(module), name)
    except Exception:  # not importable here: jsonargparse reports it
        return False
    return isinstance(cls, type) and issubclass(cls, LitTask)


def attention_arguments(class_path: str | None) -> list[str]:
    """The model's options typed ``AttentionSpec`` (its attention specs): a task's own and
    its model classes' (``LitTask.option_hints``), or any other class's constructor's."""
    if not class_path:
        return []
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(import_module(module), name)
        is_task = isinstance(cls, type) and issubclass(cls, LitTask)
        hints = cls.option_hints() if is_task else typing.get_type_hints(cls.__init__)
    except Exception:  # not importable here: jsonargparse reports it
        return []
    return spec_arguments(hints)


def parse_attention_arguments(keys: list[str], init) -> dict[str, Any]:
    """Each attention argument ``keys`` of the model's ``init`` parsed once, into the value
    the checks and the trial build take (``attention.ParsedSpec``), or the ``ValueError``
    that ``_check_attention`` raises once the checks before it have passed; anything else
    is kept as given, for ``check_attention_spec`` to refuse. A bare name becomes its
    mapping in ``init``: config.yaml records the mapping."""
    specs: dict[str, Any] = {}
    for key in keys:
        spec = init.get(key)
        spec = spec.as_dict() if hasattr(spec, "as_dict") else spec
        if not isinstance(spec, (dict, str)):
            specs[key] = spec
            continue
        try:
            specs[key] = parse_spec(spec)
        except ValueError as err:
            specs[key] = err
            continue
        if isinstance(spec, str):
            init[key] = specs[key].as_dict()
    return specs


# A model's role-specific attention arguments; ``attention`` fills every role it lacks.
ROLE_ARGUMENTS = {
    "encoder_attention": "encoder",
    "decoder_attention": "decoder",
    "cross_attention": "cross",
}


def attention_roles(key: str, keys: list[str], init) -> tuple[str, ...]:
    """Where the model builds the attention argument ``key``: its own role, or (for a
    shared ``attention``) the encoder's and each role whose own argument is not set."""
    if key in ROLE_ARGUMENTS:
        return (ROLE_ARGUMENTS[key],)
    roles = [r for k, r in ROLE_ARGUMENTS.items() if k in keys and not init.get(k)]
    return tuple(roles) if roles else ("encoder",)


class _HelpFormatter(DefaultHelpFormatter):
    """Descriptions and epilogs keep their lines (each wrapped on its own, continuation
    lines indented): the epilog lists one backend a line."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        lines = []
        for line in text.splitlines():
            lead = indent + " " * (len(line) - len(line.lstrip()))
            lines.append(
                textwrap.fill(
                    line.strip(), width, initial_indent=lead, subsequent_indent=lead + "    "
                )
            )
        return "\n".join(lines)


class _Parser(LightningArgumentParser):
    """jsonargparse's parser whose errors are one line (``preflight.short_parse_error``)
    instead of the usage block and every union the value passed through."""

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:  # jsonargparse trying alternatives: not the user's error
            return super().error(message, ex)
        prog = self.prog.replace(" [options]", "")
        raise UsageError(f"{short_parse_error(message)}  (options: {prog} --help)")


class MacformerCLI(LightningCLI):
    def __init__(self, args: list[str] | None = None, run: bool = True) -> None:
        _show_package_logs()
        self.original_argv = list(sys.argv[1:] if args is None else args)
        install_parser_loaders(self.original_argv)  # a key given twice in any YAML is refused
        if args is None:
            # Rewrite sys.argv itself: LightningCLI warns when given both args and argv.
            sys.argv[1:], self.config_stems = resolve_config_args(sys.argv[1:])
            argv = None
        else:
            argv, self.config_stems = resolve_config_args(list(args))
        # An overlay config (attention/, schedule/) alone: one line naming a task config.
        check_task_given(sys.argv[1:] if argv is None else argv, task_configs())
        super().__init__(
            model_class=L.LightningModule,
            datamodule_class=L.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            parser_kwargs={
                "prog": "macformer_lit",
                "parser_mode": "omegaconf",
                "description": DESCRIPTION,
                "epilog": EPILOG,
                "formatter_class": _HelpFormatter,
                # fit/validate/test/predict --help end with the attention backends' options.
                **{
                    name: {"epilog": describe_backends(), "formatter_class": _HelpFormatter}
                    for name in ("fit", "validate", "test", "predict")
                },
            },
            parser_class=_Parser,
            save_config_callback=SaveRunConfig,
            # Only new folders get a config.yaml (a resume in place skips it: instantiate_trainer).
            save_config_kwargs={"overwrite": True},
            auto_configure_optimizers=False,
            args=argv,
            run=run,
        )

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # Always-on callbacks with their own config groups (``--nan_guard.action skip``,
        # ``--redraw.policy steps``, ``--telemetry.every_n_steps 50``,
        # ``--memory.every_n_steps 0``).
        parser.add_lightning_class_args(NaNGuard, "nan_guard")
        parser.add_lightning_class_args(ReleaseHostMemory, "memory")
        parser.add_lightning_class_args(FeatureRedraw, "redraw")
        parser.add_lightning_class_args(AttentionTelemetry, "telemetry")
        # The other standard callbacks, each switchable (callbacks/standard.py).
        parser.add_class_arguments(RunCallbacks, "run_callbacks")
        for name in LINKED:
            parser.link_arguments(f"data.{name}", f"model.init_args.{name}", apply_on="instantiate")
        parser.add_argument(
            "--experiment",
            type=str | None,
            default=None,
            help="Run folder name under --runs_dir (default: the config names joined by '+').",
        )
        parser.add_argument("--runs_dir", type=str, default="runs", help="Root of all runs.")
        parser.add_argument(
            "--test_after_fit",
            type=bool,
            default=True,
            help="After fit, test the best checkpoint and print test accuracy.",
        )
        parser.add_argument(
            "--dropout_masks",
            type=Literal["fast", "torch"],
            default="fast",
            help="How dropout draws its masks on the CPU: fast (four masks per 64-bit draw, p "
            "rounded to a multiple of 2^-16) or torch (nn.Dropout's Bernoulli masks, 4x slower; "
            "runs recorded before 2026-11-25 used them: replay those with torch).",
        )
        parser.add_argument("--wandb_mode", type=Mode, default="auto", help="W&B mode.")
        parser.add_argument("--wandb_project", type=str, default="macformer_lit")

    def _parse_ckpt_path(self) -> None:
        """Never load a checkpoint's hyper-parameters over the command line (LightningCLI's
        default): the model is built as asked, and ``checkpoints.check_fits`` refuses a
        checkpoint that contradicts it."""

    # ---- run folder -------------------------------------------------------------------
    def _cfg(self, config):
        return config[self.subcommand] if self.subcommand else config

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        super().parse_arguments(parser, args)
        # Before the seed is set and anything is built: a mistake is the only line printed.
        subcommand = self.config.get("subcommand")
        self._preflight(self.config[subcommand] if subcommand else self.config)

    def before_instantiate_classes(self) -> None:
        cfg = self._cfg(self.config)
        experiment = cfg.get("experiment") or "+".join(self.config_stems) or "default"
        exp_dir = Path(cfg.get("runs_dir") or "runs") / experiment
        self.resuming = False
        self._run_config = None  # this run's config, plain (a fit's; recorded in checkpoints)
        self._resume_changes: list[dict] = []
        self._checkpoint_info = None
        # Our checkpoints hold only tensors and plain containers: load them without
        # unpickling arbitrary objects unless the user asks otherwise (--weights_only false).
        if "weights_only" in cfg and cfg.get("weights_only") is None:
            cfg.weights_only = True
        self._checkpoint = None
        asked = cfg.get("ckpt_path")
        resolved = resolve_ckpt_path(self.subcommand, asked, exp_dir) if self.subcommand else None
        if resolved is not None:
            cfg.ckpt_path = str(resolved)
            # Structure only (mmap): the weights are read once, by the Trainer.
            self._checkpoint = load_checkpoint(
                resolved, weights_only=cfg.get("weights_only") is not False, mmap=True
            )
            self._checkpoint_info = {
                "path": str(resolved),
                "step": self._checkpoint.get("global_step"),
            }
            model = cfg.get("model")
            init = model.get("init_args") if model is not None and "init_args" in model else None
            saved_config = None
            if self.subcommand == "fit":
                self._run_config = self._plain_config(cfg)
                saved_config = self._saved_config(resolved)
            if init is not None:
                self._resume_changes = check_fits(
                    resolved,
                    self._checkpoint,
                    # The data-linked sizes are known once the data is built.
                    {k: v for k, v in vars(init).items() if k not in LINKED},
                    subcommand=self.subcommand,
                    run_class_path=model.get("class_path"),
                    saved_config=saved_config,
                    run_config=self._run_config,
                )
        elif self.subcommand == "fit":
            self._run_config = self._plain_config(cfg)
        if self.subcommand == "fit" and asked == "last":
            found = None if resolved is None else resolved.parent.parent
            if found is None:
                rank_zero_info(
                    f"--ckpt_path last: nothing to resume under {exp_dir}; starting anew"
                )
                cfg.ckpt_path = None
            else:
                self.run_dir, self.resuming = found, True
                cfg.ckpt_path = str(found / "checkpoints" / "last.ckpt")
                rank_zero_info(f"Resuming from {cfg.ckpt_path}")
        self._check_attention(cfg)
        if not self.resuming:
            inherited = os.environ.get(RUN_DIR_ENV)
            if inherited and os.environ.get("LOCAL_RANK", "0") != "0":
                # A rank Lightning launched for DDP: rank 0 already claimed the folder.
                self.run_dir = Path(inherited)
            elif launch_rank() != 0:
                # torchrun / SLURM: a guess that ShareRunDir replaces by rank 0's folder.
                self.run_dir = version_folder(exp_dir, next_version(exp_dir))
            else:
                # Last, once every check has passed: a failed start removes it (main()).
                folder = RunFolder(exp_dir)
                _PENDING.append(folder)
                self.run_dir = folder.claim()
                os.environ[RUN_DIR_ENV] = str(self.run_dir)
        if os.environ.get("LOCAL_RANK", "0") == "0" and launch_rank() == 0:
            # One process writes a run folder; the other ranks write into rank 0's.
            locks.note(locks.hold(self.run_dir, self.subcommand or "run"))
        self.experiment = experiment
        set_mask_generator(cfg.get("dropout_masks") or "fast")

    def _plain_config(self, cfg) -> dict:
        """This run's config as config.yaml would hold it, as plain YAML values."""
        import yaml

        text = self._parser(self.subcommand).dump(cfg, skip_none=False, skip_check=True)
        return yaml.safe_load(text) or {}

    def _saved_config(self, ckpt: Path) -> dict | None:
        """The config the checkpoint trained with: recorded in it, else its run folder's
        ``config.yaml`` with the changes its resumes recorded; None when neither exists."""
        import yaml

        from macformer_lit import yamlio

        recorded = self._checkpoint.get(provenance.CHECKPOINT_KEY)
        if isinstance(recorded, dict) and isinstance(recorded.get("config"), dict):
            return recorded["config"]
        folder = ckpt.parent.parent
        try:
            config = yamlio.load_file(folder / "config.yaml")
            entries = provenance.read(folder)
        except (OSError, yaml.YAMLError, UnicodeDecodeError, provenance.RecordError):
            config = None
        if not isinstance(config, dict):
            rank_zero_info(
                f"--ckpt_path {ckpt}: no config recorded with it or beside it; only its model "
                "settings are compared with this run's"
            )
            return None
        return provenance.effective_config(config, entries)

    def _preflight(self, cfg) -> None:
        """Names, paths, trainer values and sizes, checked before anything is built."""
        if cfg.get("experiment") is not None:
            check_experiment(cfg.get("experiment"))
        check_folder(cfg.get("runs_dir") or "runs", "--runs_dir", write=True)
        data = cfg.get("data")
        data_init = data.get("init_args") if data is not None and "init_args" in data else None
        if data_init is not None and isinstance(data_init.get("data_dir"), str):
            check_folder(data_init.get("data_dir"), "--data.data_dir", write=False)
        for warning in check_trainer_values(cfg.get("trainer") or {}):
            if os.environ.get("LOCAL_RANK", "0") == "0" and launch_rank() == 0:
                print(f"macformer_lit: warning: {warning}", file=sys.stderr, flush=True)
        model = cfg.get("model")
        # Launch and environment (preflight.py, loggers.py): each one line, before any build.
        check_launch(cfg.get("trainer") or {})
        check_seeds(cfg)
        if self.config.get("subcommand") == "fit":
            check_schedule(cfg.get("trainer") or {}, linear_decay=_is_task(model))
        logger = (cfg.get("trainer") or {}).get("logger")
        if (logger is None or logger is True) and cfg.get("wandb_mode") != "disabled":
            check_wandb_mode(cfg.get("wandb_mode"))
        try:  # a model and data of different tasks (preflight.check_task_data)
            classes = (
                _import_class(model.get("class_path")),
                _import_class(data.get("class_path")),
            )
        except Exception:  # not importable here: jsonargparse reports it
            classes = None
        if classes is not None:
            check_task_data(*classes, LINKED)
        init = model.get("init_args") if model is not None and "init_args" in model else None
        self._attention_specs: dict[str, Any] = {}
        if init is not None:
            keys = attention_arguments(model.get("class_path"))
            self._attention_specs = parse_attention_arguments(keys, init)
            data_max = data_init.get("max_len") if data_init is not None else None
            max_len = data_max if data_max is not None else init.get("max_len")
            source = "--data.max_len" if data_max is not None else "--model.init_args.max_len"
            check_model_size(max_len, init.get("d_model"), source=source)
            d_model, heads = init.get("d_model"), init.get("num_heads")
            for key in keys:
                spec = self._attention_specs.get(key)
                if not (isinstance(d_model, int) and isinstance(heads, int) and heads > 0):
                    break
                # Before the trial build of _check_attention, which allocates the draw.
                check_feature_memory(
                    spec if isinstance(spec, ParsedSpec) else None,
                    where=f"model.init_args.{key}",
                    batch_size=data_init.get("batch_size") if data_init is not None else None,
                    max_len=max_len,
                    num_heads=heads,
                    head_dim=max(d_model // heads, 1),
                    num_layers=init.get("num_layers", init.get("num_encoder_layers")),
                    precision=(cfg.get("trainer") or {}).get("precision"),
                )

    def _check_attention(self, cfg) -> None:
        """Every attention spec of the model (its arguments typed ``AttentionSpec``, parsed
        in ``_preflight``), checked at parse time by a trial build (attention/spec.py)."""
        model = cfg.get("model")
        init = model.get("init_args") if model is not None and "init_args" in model else None
        if init is None or "d_model" not in init or "num_heads" not in init:
            return  # not one of our models: its own constructor checks
        d_model, num_heads = init.get("d_model"), init.get("num_heads")
        if not (isinstance(d_model, int) and isinstance(num_heads, int)) or num_heads < 1:
            return
        if d_model % num_heads:
            raise ValueError(
                f"model.init_args.d_model={d_model} is not divisible by num_heads={num_heads}"
            )
        keys = attention_arguments(model.get("class_path"))
        layers = init.get("num_layers", init.get("num_encoder_layers"))
        for key in keys:
            spec = self._attention_specs.get(key)
            if isinstance(spec, ValueError):
                raise ValueError(f"model.init_args.{key}: {spec}")
            check_attention_spec(
                spec,
                head_dim=d_model // num_heads,
                num_heads=num_heads,
                where=f"model.init_args.{key}",
                roles=attention_roles(key, keys, init),
                num_layers=layers if isinstance(layers, int) else None,
            )

    def instantiate_trainer(self, **kwargs) -> L.Trainer:
        cfg = self._cfg(self.config_init)
        self._check_checkpoint_fits_model()
        trainer_cfg = cfg.get("trainer", {})
        run_dir = self.run_dir
        kwargs.setdefault("default_root_dir", str(run_dir))
        logger = trainer_cfg.get("logger")
        if logger is None or logger is True:
            loggers: list[Logger] = [RunCSVLogger(str(run_dir))]
            if cfg.get("wandb_mode") != "disabled":
                loggers.append(
                    AutoWandbLogger(
                        save_dir=str(run_dir),
                        project=cfg.get("wandb_project") or "macformer_lit",
                        name=f"{self.experiment}/{run_dir.name}",
                        mode=cfg.get("wandb_mode") or "auto",
                    )
                )
            kwargs["logger"] = loggers
        callbacks = trainer_cfg.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
        callbacks.insert(0, ShareRunDir(self))
        callbacks = cfg.get("run_callbacks").add_to(
            callbacks,
            run_dir=run_dir,
            monitor=getattr(self.model, "checkpoint_monitor", (None, "min")),
            checkpointing=trainer_cfg.get("enable_checkpointing", True) is not False,
            logging=bool(kwargs.get("logger", logger)),
            resume_command=resume_command(self.original_argv),
        )
        # Every load (resume, test after fit, validate/test/predict) goes through the
        # same safe path, checkpointing on or off.
        plugins = trainer_cfg.get("plugins") or []
        plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            safe = cfg.get("weights_only") is not False
            kwargs["plugins"] = [*plugins, SafeCheckpointIO(weights_only=safe)]
        if self.subcommand == "predict":
            callbacks.append(PredictionWriter())
        callbacks.append(RecordRun(self))
        kwargs["callbacks"] = callbacks
        try:
            trainer = super().instantiate_trainer(**kwargs)
        except (ValueError, TypeError, MisconfigurationException) as err:
            # Lightning's own checks while building the Trainer (accelerator, strategy,
            # devices, precision, loop limits): a settings problem, worth one line rather
            # than a traceback from its internals.
            if not _raised_under(err, LIGHTNING_DIR):
                raise
            hint = ""
            if "gpu" in str(err).lower() or "cuda" in str(err).lower():
                hint = " (on a machine without a GPU use --trainer.accelerator cpu or auto)"
            raise ValueError(f"invalid trainer settings: {err}{hint}") from None
        self._check_precision(trainer)
        for callback in trainer.callbacks:
            # The first config.yaml of a run stays; a resume's changes go to provenance.yaml.
            if isinstance(callback, SaveRunConfig) and self.resuming:
                callback.save_to_log_dir = False
        return trainer

    def _check_precision(self, trainer: L.Trainer) -> None:
        """A resumed fit trains in the precision its checkpoint trained in: the same
        ``--trainer.precision`` can run another one on another machine (16-mixed runs bf16
        on a CPU, fp16 on a GPU)."""
        if self.subcommand != "fit" or self._checkpoint is None:
            return
        recorded = self._checkpoint.get(provenance.CHECKPOINT_KEY)
        used = recorded.get("precision") if isinstance(recorded, dict) else None
        if used is not None and used != str(trainer.precision):
            path = self._checkpoint_info["path"]
            raise CheckpointError(
                f"this resume would change what is trained (--ckpt_path {path}): precision: "
                f"checkpoint trained in {used}, this run would train in {trainer.precision} "
                f"on {type(trainer.accelerator).__name__.replace('Accelerator', '')}. A resume "
                f"continues the same training: resume where --trainer.precision runs {used}, "
                "or leave out --ckpt_path to start a new run with these settings"
            )

    def before_fit(self) -> None:
        # The test after fit reads the test split: an empty one stops the run now.
        if self._cfg(self.config_init).get("test_after_fit") and hasattr(
            self.datamodule, "test_at_fit"
        ):
            self.datamodule.test_at_fit = True

    # ---- after the run ----------------------------------------------------------------
    def after_fit(self) -> None:
        cfg = self._cfg(self.config_init)
        trainer = self.trainer
        if cfg.get("test_after_fit") and not trainer.interrupted:
            ckpt = trainer.checkpoint_callback
            best = ckpt.best_model_path if ckpt is not None else ""
            results = trainer.test(
                self.model,
                datamodule=self.datamodule,
                ckpt_path=best or None,
                weights_only=cfg.get("weights_only") is not False,
            )
            self._report(results)
        else:
            self._report(None)

    def after_test(self) -> None:
        self._report(None)

    def after_validate(self) -> None:
        if self.trainer.is_global_zero:
            print(f"Run folder: {self.run_dir}", flush=True)

    def after_predict(self) -> None:
        writer = next(c for c in self.trainer.callbacks if isinstance(c, PredictionWriter))
        if self.trainer.is_global_zero and writer.path is not None:
            print(f"Run folder: {self.run_dir}", flush=True)
            print(f"Predictions: {writer.path} ({writer.count} examples)", flush=True)

    def _check_checkpoint_fits_model(self) -> None:
        """The checkpoint against the model as built, data-linked sizes included."""
        if self._checkpoint is None or not hasattr(self.model, "hparams"):
            return
        check_fits(
            Path(self._cfg(self.config).ckpt_path),
            self._checkpoint,
            dict(self.model.hparams),
            subcommand=self.subcommand,
        )

    def _report(self, results: list[dict] | None) -> None:
        if not self.trainer.is_global_zero:
            return
        lines = [f"Run folder: {self.run_dir}"]
        metrics = (results or [{}])[0] or {
            k: float(v) for k, v in self.trainer.callback_metrics.items() if k.startswith("test/")
        }
        if "test/acc" in metrics:
            line = f"test/acc = {metrics['test/acc']:.4f}"
            majority = majority_baseline(self.datamodule)
            if majority is not None:
                line += f"  (majority-class baseline on this test split: {majority:.4f})"
            lines.append(line)
        for key in sorted(metrics):
            if key not in ("test/acc", "test/majority_acc"):  # the latter is on acc's line
                lines.append(f"{key} = {metrics[key]:.4f}")
        for lg in self.trainer.loggers:
            if isinstance(lg, CSVLogger):
                lines.append(f"CSV metrics: {Path(lg.log_dir) / 'metrics.csv'}")
            elif isinstance(lg, AutoWandbLogger):
                where = lg.run_dir()
                if lg.mode == "offline" and where:
                    lines.append(f"W&B offline run: {where}  (upload: wandb sync {where})")
                elif lg.mode == "disabled":
                    lines.append("W&B: disabled (WANDB_MODE or --wandb_mode)")
                elif where:
                    lines.append(f"W&B run: {where}")
        ckpt = self.trainer.checkpoint_callback
        if ckpt is not None and ckpt.dirpath and Path(ckpt.dirpath).is_dir():
            lines.append(f"Checkpoints: {ckpt.dirpath} (resume: --ckpt_path last)")
        print("\n".join(lines), flush=True)


def resume_command(argv: list[str]) -> str:
    """The command line that resumes ``argv``'s fit from its ``last.ckpt``."""
    import shlex

    kept, i = [], 0
    while i < len(argv):
        if argv[i] == "--ckpt_path":
            i += 2
            continue
        if not argv[i].startswith("--ckpt_path="):
            kept.append(argv[i])
        i += 1
    return shlex.join(["python", "-m", "macformer_lit", *kept, "--ckpt_path", "last"])


def majority_baseline(datamodule) -> float | None:
    """Share of the most frequent label in the DataModule's test split, if it has one."""
    datasets = getattr(datamodule, "datasets", None)
    labels = getattr((datasets or {}).get("test"), "labels", None)
    if labels is None or len(labels) == 0:
        return None
    counts: dict[int, int] = {}
    for y in labels:
        counts[int(y)] = counts.get(int(y), 0) + 1
    return max(counts.values()) / len(labels)


def main(args: list[str] | None = None) -> None:
    argv = sys.argv[1:] if args is None else list(args)
    if args is None:
        # A closed stdout or terminal (``fit ... | head -3``) never fails a run.
        interrupts.forgiving_streams()
    # SIGINT, SIGTERM and SIGHUP end in one line and 128 + the signal (_interrupted).
    previous = interrupts.install()
    try:
        _main(args, argv)
    except interrupts.Interrupted as err:  # sweep and report; the others answer in _main
        with contextlib.suppress(OSError, ValueError):
            print(f"macformer_lit: interrupted ({err.name})", file=sys.stderr, flush=True)
        raise SystemExit(err.exit_code) from None
    finally:
        interrupts.restore(previous)


def _main(args: list[str] | None, argv: list[str]) -> None:
    if argv and argv[0] in ("sweep", "report"):
        import_module(f"macformer_lit.{argv[0]}").main(argv[1:])
        return
    if argv and not argv[0].startswith("-") and argv[0] not in SUBCOMMANDS:
        print(
            f"macformer_lit: error: unknown subcommand {argv[0]!r}; usage: macformer_lit "
            f"{{{','.join(SUBCOMMANDS)}}} ... (macformer_lit --help)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    try:
        MacformerCLI(args)
        _close_process_group()
    except BaseException as err:
        _abandon_unstarted()
        # W&B's closing lines ("You can sync this run ...") would print after the error.
        if isinstance(err, SIGTERMException):
            # Stopped on purpose, last.ckpt saved: preempted, the shell's code for the signal.
            code = interrupts.exit_code(getattr(err, "stop_signal", 15))
            finish_wandb_quietly(code, preempted=True)
            raise SystemExit(code) from None
        finish_wandb_quietly()
        if isinstance(err, ConfigNotFound):
            print(err.code, file=sys.stderr)
            raise SystemExit(2) from None
        if isinstance(err, interrupts.Interrupted):
            _interrupted(err, argv)
        if isinstance(err, UsageError):
            print(f"macformer_lit: error: {err.code}", file=sys.stderr)
            raise SystemExit(2) from None
        user_error = (
            _our_error(err) if isinstance(err, (ValueError, OSError, FloatingPointError)) else None
        )
        if user_error is None:
            # Lightning's or torch's writes too: one line.
            user_error = disk_full(err, started=not _PENDING or any(f.kept for f in _PENDING))
        if user_error is None:
            raise
        print(f"macformer_lit: error: {user_error}", file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        _PENDING.clear()
        locks.release_all()


def _close_process_group() -> None:
    """Destroy the default process group once a run has ended normally. A rank that exits
    with a gloo group alive can abort while the interpreter shuts down ("terminate called
    without an active exception", exit code -6, after the run's work is done): gloo's worker
    threads still hold work objects then (pytorch/pytorch#179291): 3 of 12 torchrun runs of
    tests/distributed/test_launchers.py on a loaded 2-core CPU, none of 18 since. Not after
    an error: destroying a group while another rank may still be inside a collective can
    hang."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _interrupted(err: interrupts.Interrupted, argv: list[str]) -> typing.NoReturn:
    """One line for a stop signal outside a graceful fit loop, and 128 + the signal. An
    interrupted ``validate``/``test``/``predict`` leaves no folder: it scored nothing whole."""
    subcommand = argv[0] if argv and argv[0] in SUBCOMMANDS else "run"
    # A resumed fit claims no folder; a new one keeps its folder once training started.
    started = not _PENDING or any(f.kept for f in _PENDING)
    if subcommand != "fit":
        for folder in _PENDING:
            folder.kept = False
        _abandon_unstarted()
        what = f"{subcommand} interrupted ({err.name}); nothing was kept"
    elif started:
        what = (
            f"fit interrupted ({err.name}) without saving; it goes on from its last checkpoint "
            f"with: {resume_command(argv)}"
        )
    else:
        what = f"fit interrupted ({err.name}) before training started; nothing was kept"
    with contextlib.suppress(OSError, ValueError):
        print(f"macformer_lit: {what}", file=sys.stderr, flush=True)
    raise SystemExit(err.exit_code) from None


def _abandon_unstarted() -> None:
    """Remove the run folders of a run that failed before any loop started, closing the
    offline W&B run inside first (its closing lines would bury the error)."""
    folders = [f.path for f in _PENDING if not f.kept and f.path is not None]
    if not folders:
        return
    wandb = sys.modules.get("wandb")
    run = getattr(wandb, "run", None) if wandb is not None else None
    inside = run is not None and any(
        Path(run.dir).resolve().is_relative_to(f.resolve()) for f in folders
    )
    if inside:
        import io

        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            wandb.finish(exit_code=1)
    for folder in _PENDING:
        folder.abandon()


PACKAGE_DIR = Path(__file__).resolve().parent
LIGHTNING_DIR = Path(L.__file__).resolve().parent


def _raised_under(err: BaseException, folder: Path) -> bool:
    """Whether ``err`` was raised by code in ``folder`` (its traceback's last frame)."""
    tb, last = err.__traceback__, None
    while tb is not None:
        last, tb = tb.tb_frame.f_code.co_filename, tb.tb_next
    return last is not None and Path(last).resolve().is_relative_to(folder)


def _our_error(err: BaseException) -> BaseException | None:
    """The deepest error in ``err``'s chain that this package raised on purpose (bad
    config values, missing or malformed data, NaN forensics), or None for anything else.

    jsonargparse wraps errors raised while building the model or DataModule in a
    "Does not validate against any of the Union subtypes" message; the user needs only
    ours.
    """
    found = None
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        ours = _raised_under(err, PACKAGE_DIR)
        if ours and isinstance(err, (ValueError, OSError, FloatingPointError)):
            found = err
        # ``raise ... from None`` replaced its context with a message of its own.
        err = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
    return found
