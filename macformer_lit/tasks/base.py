"""What LitClassifier and LitTranslator share: the stages, the step methods around one
``_shared_step(batch, stage)``, how a stage metric is logged, and the optimiser."""

from __future__ import annotations

import inspect
import typing
from typing import Any, ClassVar

import lightning as L
import torch
from torchmetrics import Metric

from macformer_lit.attention.spec import ParsedSpec, parse_spec, spec_arguments

from .compat import CheckpointCompatibility
from .optim import adamw_warmup_linear

STAGES = ("train", "val", "test")


class LitTask(CheckpointCompatibility, L.LightningModule):
    """Base of the tasks. Subclasses implement ``_shared_step(batch, stage) -> loss`` and
    save ``lr``, ``weight_decay``, ``betas``, ``eps`` and ``warmup_steps`` with
    ``save_hyperparameters()`` (checked by ``optim.check_optim_args``).

    A task's own options are its keyword parameters; the model's come in ``**model`` and go
    to the model's constructor untouched, so they are written once, in the model's
    signature (``model_classes``): LightningCLI reads them from there (jsonargparse follows
    ``**model`` into the constructor call, written as a direct call ``Model(**model)`` for
    it to do so), and ``record_model_defaults`` records every one of them,
    defaults included, in the hyper-parameters the checkpoint keeps and the compatibility
    check reads.
    """

    model_classes: ClassVar[tuple[type, ...]] = ()

    @classmethod
    def _constructors(cls) -> list[Any]:
        """The ``__init__`` of each model class and of its bases up to ``nn.Module``."""
        return [
            c.__init__
            for model_cls in cls.model_classes
            for c in model_cls.__mro__
            if "__init__" in vars(c) and issubclass(c, torch.nn.Module) and c is not torch.nn.Module
        ]

    @classmethod
    def model_defaults(cls) -> dict[str, Any]:
        """Every model option with a default, from the model classes' signatures."""
        defaults: dict[str, Any] = {}
        for init in cls._constructors():
            for name, p in inspect.signature(init).parameters.items():
                if p.kind is p.KEYWORD_ONLY and p.default is not p.empty:
                    defaults.setdefault(name, p.default)
        return defaults

    @classmethod
    def option_hints(cls) -> dict[str, Any]:
        """The type of every option, the task's own and its models'."""
        hints: dict[str, Any] = {}
        for init in [cls.__init__, *cls._constructors()]:
            for name, hint in typing.get_type_hints(init).items():
                hints.setdefault(name, hint)
        hints.pop("return", None)
        return hints

    def record_model_defaults(self) -> None:
        """After ``save_hyperparameters``: the model options left at their defaults join the
        ones given in ``hparams``, so a checkpoint records every option of its model."""
        for key, default in self.model_defaults().items():
            if key not in self._hparams:
                self._hparams[key] = default
                self._hparams_initial[key] = default

    @classmethod
    def parse_specs(cls, model: dict[str, Any]) -> dict[str, ParsedSpec]:
        """Each attention spec among the model options (``AttentionSpec`` arguments), parsed
        once: the values the model builds from. A spec given as a bare name (or a value)
        becomes its mapping in ``model``, before ``save_hyperparameters`` reads it, so the
        checkpoints and config.yaml keep the mapping. A spec left empty stays: the model's
        default (softmax, or for a role, as ``attention``)."""
        specs = {}
        for key in spec_arguments(cls.option_hints()):
            if not model.get(key):
                continue
            specs[key] = parse_spec(model[key], check_types=False)
            if isinstance(model[key], (str, ParsedSpec)):
                model[key] = specs[key].as_dict()
        return specs

    def _shared_step(self, batch, stage: str) -> torch.Tensor:
        raise NotImplementedError

    def training_step(self, batch, batch_idx):
        return self._shared_step(batch, "train")

    def validation_step(self, batch, batch_idx):
        self._shared_step(batch, "val")

    def test_step(self, batch, batch_idx):
        self._shared_step(batch, "test")

    def log_stage_metric(self, stage: str, name: str, metric: Metric, weight: int) -> None:
        """Log ``stage/name`` once an epoch, in the progress bar outside training."""
        self.log(
            f"{stage}/{name}",
            metric,
            on_step=False,
            on_epoch=True,
            prog_bar=stage != "train",
            batch_size=weight,
        )

    def configure_optimizers(self):
        hp = self.hparams
        return adamw_warmup_linear(
            self,
            lr=hp.lr,
            weight_decay=hp.weight_decay,
            betas=tuple(hp.betas),
            eps=hp.eps,
            warmup_steps=hp.warmup_steps,
            total_steps=int(self.trainer.estimated_stepping_batches),
        )
