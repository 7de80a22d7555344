"""Refuse a checkpoint that does not fit the model being built, with a message saying why.

Without this, loading a checkpoint trained with another vocabulary or attention backend
fails deep inside ``load_state_dict`` with a list of tensor shapes; this names the setting.
"""

from __future__ import annotations

import inspect
from typing import Any

from macformer_lit.models import EncoderClassifier, Seq2SeqTransformer

# Model options that change no parameter's shape or meaning; every other option of the
# models' constructors does, and so does the task option choosing the classifier's class.
NOT_STRUCTURAL = ("dropout",)
TASK_STRUCTURAL = ("dual_encoder",)


def _structural() -> tuple[str, ...]:
    names: list[str] = []
    for cls in (EncoderClassifier, Seq2SeqTransformer):
        for name, p in inspect.signature(cls.__init__).parameters.items():
            if p.kind is p.KEYWORD_ONLY and name not in NOT_STRUCTURAL and name not in names:
                names.append(name)
    return (*names, *TASK_STRUCTURAL)


# Settings that change the parameters' shapes or meaning; a mismatch cannot be loaded.
STRUCTURAL = _structural()


def _backend(spec: Any) -> str:
    if isinstance(spec, dict):
        return ", ".join(f"{k}={v}" for k, v in spec.items())
    return str(spec)


def check_checkpoint_compatible(current: dict, checkpoint: dict) -> None:
    """Raise ``ValueError`` listing every structural setting that differs."""
    saved = checkpoint.get("hyper_parameters") or {}
    problems = []
    for key in STRUCTURAL:
        if key in saved and key in current and saved[key] != current[key]:
            if "attention" in key:
                problems.append(
                    f"{key}: checkpoint has {{{_backend(saved[key])}}}, "
                    f"this run {{{_backend(current[key])}}}"
                )
            else:
                problems.append(f"{key}: checkpoint has {saved[key]!r}, this run {current[key]!r}")
    if problems:
        hint = ""
        if any(p.startswith(("vocab_size", "pad_id", "max_len")) for p in problems):
            hint = (
                "\nThe data side differs (vocabulary, tokenizer or max_len): use the data "
                "settings the checkpoint was trained with."
            )
        raise ValueError(
            "this checkpoint does not fit the model of this run:\n  - "
            + "\n  - ".join(problems)
            + hint
        )


class CheckpointCompatibility:
    """LightningModule mixin: check a checkpoint's settings before its weights load."""

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        check_checkpoint_compatible(dict(self.hparams), checkpoint)
        super().on_load_checkpoint(checkpoint)
