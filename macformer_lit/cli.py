"""``python -m macformer_lit {fit,validate,test,predict,sweep,report}`` through LightningCLI.

The front door: the subcommands, the arguments and how they are parsed, and ``main``. It
links the DataModule's ``vocab_size``, ``num_classes``, ``max_len`` and ``pad_id`` into the
model and lays out each run as

    runs/<experiment>/version_<n>/{config.yaml, metrics.csv, checkpoints/, wandb/}

with a CSV logger and Weights & Biases (offline without credentials) by default, and
``provenance.yaml`` recording what ran (``provenance.py``). ``--ckpt_path last`` resumes from
the newest version of the experiment that has a ``checkpoints/last.ckpt``, and keeps writing
into that version; a resume that would change what is trained is refused
(``checkpoints.check_fits``), and the first ``config.yaml`` is never rewritten.

Each LightningCLI hook calls the module that does the job: ``config_lookup`` (config
names), ``preflight`` (checks before anything is built), ``checkpoints`` (``--ckpt_path``),
``runs`` (run folders), ``assembly`` (the Trainer), ``summary`` (what a finished run
prints), ``errors`` (how a failed one ends).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import textwrap
from importlib import import_module
from pathlib import Path
from typing import Literal

# Lightning 2.6 still calls deprecated jsonargparse APIs; the warnings only confuse users.
os.environ.setdefault("JSONARGPARSE_DEPRECATION_WARNINGS", "off")

import warnings  # noqa: E402

import lightning as L  # noqa: E402
import yaml  # noqa: E402
from jsonargparse import DefaultHelpFormatter  # noqa: E402
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI  # noqa: E402

from macformer_lit import errors, interrupts, locks, moved_keys, summary  # noqa: E402
from macformer_lit.assembly import (  # noqa: E402
    SaveRunConfig,
    check_built,
    settings_errors,
    trainer_arguments,
)
from macformer_lit.attention.spec import describe_backends  # noqa: E402
from macformer_lit.callbacks.standard import StandardCallbacks  # noqa: E402
from macformer_lit.checkpoints import AskedCheckpoint, open_ckpt_path  # noqa: E402
from macformer_lit.config_lookup import (  # noqa: E402, F401  (names tests and docs use)
    CONFIG_DIR,
    RENAMED_CONFIGS,
    ConfigNotFound,
    config_stem,
    resolve_config,
    resolve_config_args,
    shipped_configs,
    task_configs,
)
from macformer_lit.loggers import Mode  # noqa: E402
from macformer_lit.models.dropout import set_mask_generator  # noqa: E402
from macformer_lit.preflight import (  # noqa: E402, F401  (parse_attention_arguments: docs)
    UsageError,
    check_attention,
    check_command,
    check_task_given,
    install_parser_loaders,
    moved_in_config_files,
    parse_attention_arguments,
    short_parse_error,
)
from macformer_lit.runs import (  # noqa: E402, F401  (RecordRun, ShareRunDir: docs)
    RecordRun,
    RunFolders,
    ShareRunDir,
    launch_rank,
    resume_command,
)

# Lightning's own use of a deprecated torch pytree API; nothing a user can act on.
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")

# DataModule attributes linked into the model; a link whose source or target is absent is
# skipped (Lightning data modules without bos/eos, models without num_classes).
LINKED = ("vocab_size", "num_classes", "max_len", "pad_id", "bos_id", "eos_id")


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
    def __init__(
        self, args: list[str] | None = None, run: bool = True, folders: RunFolders | None = None
    ) -> None:
        _show_package_logs()
        # This process's run folders; main() owns them, to remove one whose run never started.
        self.folders = folders if folders is not None else RunFolders()
        self.asked = AskedCheckpoint()
        self.original_argv = list(sys.argv[1:] if args is None else args)
        install_parser_loaders(self.original_argv)  # a key given twice in any YAML is refused
        # Old callback options at their new place (moved_keys.py); config files move theirs
        # as they are loaded (install_parser_loaders).
        if args is None:
            # Rewrite sys.argv itself: LightningCLI warns when given both args and argv.
            sys.argv[1:], self.config_stems = resolve_config_args(sys.argv[1:])
            sys.argv[1:], self.moved = moved_keys.migrate_args(sys.argv[1:])
            argv = None
        else:
            argv, self.config_stems = resolve_config_args(list(args))
            argv, self.moved = moved_keys.migrate_args(argv)
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
                    for name in self.subcommands()
                },
            },
            parser_class=_Parser,
            save_config_callback=SaveRunConfig,
            # Only new folders get a config.yaml (a resume in place skips it: check_built).
            save_config_kwargs={"overwrite": True},
            auto_configure_optimizers=False,
            args=argv,
            run=run,
        )

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # The standard callbacks, one entry each, each its settings or false
        # (callbacks/standard.py); assembly.trainer_arguments adds them to the Trainer.
        parser.add_class_arguments(StandardCallbacks, "callbacks")
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

    # No public LightningCLI hook stops it loading a checkpoint's hyper-parameters over the
    # command line: the model is built as asked, and checkpoints.check_fits refuses a misfit.
    def _parse_ckpt_path(self) -> None:
        pass

    @property
    def run_dir(self) -> Path | None:
        return self.folders.path

    def _cfg(self, config):
        return config[self.subcommand] if self.subcommand else config

    # ---- before anything is built -----------------------------------------------------------
    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        super().parse_arguments(parser, args)
        # Before the seed is set and anything is built: a mistake is the only line printed.
        subcommand = self.config.get("subcommand")
        cfg = self.config[subcommand] if subcommand else self.config
        try:
            StandardCallbacks.settle(cfg.callbacks)
        except ValueError as err:
            raise UsageError(str(err)) from None
        self.attention_specs = check_command(
            cfg,
            fit=subcommand == "fit",
            rank_zero=os.environ.get("LOCAL_RANK", "0") == "0" and launch_rank() == 0,
            linked=LINKED,
        )
        self.moved += moved_in_config_files()

    def before_instantiate_classes(self) -> None:
        cfg = self._cfg(self.config)
        experiment = cfg.get("experiment") or "+".join(self.config_stems) or "default"
        exp_dir = Path(cfg.get("runs_dir") or "runs") / experiment
        self.asked = open_ckpt_path(
            cfg, self.subcommand, exp_dir, plain_config=lambda: self._plain_config(cfg)
        )
        self._check_attention(cfg)
        # After every check: a mistake stays the only line printed.
        self._note_moved()
        # Last, once every check has passed: a failed start removes it (main()).
        self.folders.take(exp_dir, self.subcommand, resume=self.asked.resume_dir)
        self.experiment = experiment
        set_mask_generator(cfg.get("dropout_masks") or "fast")

    def _note_moved(self) -> None:
        """One line on stderr (rank 0) naming the old keys this command used and where
        they are read now."""
        if self.moved and os.environ.get("LOCAL_RANK", "0") == "0" and launch_rank() == 0:
            print(
                f"macformer_lit: note: old option names read at their new place: "
                f"{moved_keys.describe(self.moved)} (--print_config shows the new ones)",
                file=sys.stderr,
                flush=True,
            )

    def _check_attention(self, cfg) -> None:
        check_attention(cfg, self.attention_specs)

    def _plain_config(self, cfg) -> dict:
        """This run's config as config.yaml would hold it, as plain YAML values."""
        # LightningCLI's private _parser: it has no public accessor for a subcommand's parser.
        text = self._parser(self.subcommand).dump(cfg, skip_none=False, skip_check=True)
        return yaml.safe_load(text) or {}

    def instantiate_trainer(self, **kwargs) -> L.Trainer:
        self.asked.check_model(self._cfg(self.config), self.model, self.subcommand)
        kwargs = trainer_arguments(
            self._cfg(self.config_init),
            kwargs,
            subcommand=self.subcommand,
            folders=self.folders,
            experiment=self.experiment,
            model=self.model,
            argv=self.original_argv,
            asked=self.asked,
            asked_precision=(self._cfg(self.config).get("trainer") or {}).get("precision"),
        )
        with settings_errors():
            trainer = super().instantiate_trainer(**kwargs)
        check_built(trainer, subcommand=self.subcommand, asked=self.asked)
        return trainer

    # ---- the subcommands ------------------------------------------------------------------
    def before_fit(self) -> None:
        # The test after fit reads the test split: an empty one stops the run now.
        if self._cfg(self.config_init).get("test_after_fit") and hasattr(
            self.datamodule, "test_at_fit"
        ):
            self.datamodule.test_at_fit = True

    def after_fit(self) -> None:
        cfg = self._cfg(self.config_init)
        trainer = self.trainer
        results = None
        if cfg.get("test_after_fit") and not trainer.interrupted:
            ckpt = trainer.checkpoint_callback
            best = ckpt.best_model_path if ckpt is not None else ""
            results = trainer.test(
                self.model,
                datamodule=self.datamodule,
                ckpt_path=best or None,
                weights_only=cfg.get("weights_only") is not False,
            )
        summary.report(trainer, self.datamodule, self.run_dir, results)

    def after_test(self) -> None:
        summary.report(self.trainer, self.datamodule, self.run_dir, None)

    def after_validate(self) -> None:
        summary.report_folder(self.trainer, self.run_dir)

    def after_predict(self) -> None:
        summary.report_predictions(self.trainer, self.run_dir)


def main(args: list[str] | None = None) -> None:
    argv = sys.argv[1:] if args is None else list(args)
    if args is None:
        # A closed stdout or terminal (``fit ... | head -3``) never fails a run.
        interrupts.forgiving_streams()
    # SIGINT, SIGTERM and SIGHUP end in one line and 128 + the signal (errors.interrupted).
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
    folders = RunFolders()
    try:
        MacformerCLI(args, folders=folders)
        _close_process_group()
    except BaseException as err:
        subcommand = argv[0] if argv and argv[0] in SUBCOMMANDS else "run"
        errors.exit_for(err, argv=argv, subcommand=subcommand, folders=folders)
        raise
    finally:
        locks.release_all()


def _close_process_group() -> None:
    """Destroy the default process group once a run has ended normally: a rank that exits
    with a gloo group alive can abort at interpreter shutdown after its work is done
    (pytorch/pytorch#179291; docs/pitfalls.md). Not after an error: destroying a group while
    another rank may still be inside a collective can hang."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
