"""``torch.compile`` for the task's model, from a config (``configs/trainer/compile.yaml``).

Off unless configured. ``nn.Module.compile`` compiles each part in place, so parameter
names, checkpoints and the optimiser are the same as in an eager run, and a compiled run
resumes an eager checkpoint and the other way round. What is compiled:

- every encoder (bidirectional attention: every backend, with or without ppSBN, compiles
  as one graph, forward and backward, at any sequence length after one dynamic compile;
  ``tests/attention/test_attention_compile.py``);
- a decoder block only when its causal self-attention compiles correctly: every backend
  without ppSBN, the chunked causal path of ``rmfa``, ``favor`` and ``linear`` included.
  Causal ppSBN in training traces correctly through AOTAutograd (``aot_eager``; its running
  statistics are rebound, not updated in place, when compiled), but with inductor on the
  CPU one input gave other outputs than eager (cause not found; docs/pitfalls.md §8).
  Those decoder blocks stay eager, and the run says so.

Decoding (greedy and beam search) runs the blocks' ``step`` methods, which stay eager.
"""

from __future__ import annotations

import logging

import lightning as L
from lightning.pytorch.utilities import rank_zero_only
from torch import nn

from macformer_lit.attention import PPSBNAttention

log = logging.getLogger(__name__)


def causal_compile_unsafe(backend: nn.Module) -> str | None:
    """Why a causal self-attention ``backend`` must stay eager (see the module docstring),
    or None if it compiles."""
    if isinstance(backend, PPSBNAttention):
        return "ppSBN in causal attention (inductor differed from eager on one input)"
    return None


def compile_plan(model: nn.Module) -> tuple[list[tuple[str, nn.Module]], list[str]]:
    """The parts of ``model`` to compile, and a line for each part left eager: the whole
    model when it has no decoder; else its encoder and each decoder block whose causal
    self-attention compiles correctly."""
    decoders = [
        (name, child)
        for name, child in model.named_children()
        if isinstance(child, nn.ModuleList)
        and len(child)
        and all(hasattr(b, "self_attn") for b in child)
    ]
    if not decoders:
        return [("model", model)], []
    parts = [(name, child) for name, child in model.named_children() if name == "encoder"]
    eager: list[str] = []
    for name, blocks in decoders:
        for i, block in enumerate(blocks):
            why = causal_compile_unsafe(block.self_attn.backend)
            if why is None:
                parts.append((f"{name}.{i}", block))
            else:
                eager.append(f"{name}.{i}: {why}")
    return parts, eager


class CompileModel(L.Callback):
    """Compile ``pl_module.model``'s parts with ``torch.compile`` once, at setup.

    Args:
        backend: ``torch.compile``'s backend (``inductor`` generates code; ``aot_eager``
            only traces, for checking that a model compiles).
        mode: ``torch.compile``'s mode (None, ``reduce-overhead``, ``max-autotune``).
        dynamic: compile for varying sequence lengths once instead of once per length.
        fullgraph: fail on any graph break instead of splitting the graph.
    """

    def __init__(
        self,
        backend: str = "inductor",
        mode: str | None = None,
        dynamic: bool = True,
        fullgraph: bool = False,
    ) -> None:
        self.backend, self.mode, self.dynamic, self.fullgraph = backend, mode, dynamic, fullgraph
        self.compiled: list[str] = []
        self.eager: list[str] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.compiled or self.eager:
            return  # fit then test: compiled once
        model = getattr(pl_module, "model", None)
        if not isinstance(model, nn.Module):
            raise ValueError(
                f"compile: {type(pl_module).__name__} has no .model to compile; remove "
                "CompileModel from trainer.callbacks"
            )
        parts, self.eager = compile_plan(model)
        for name, part in parts:
            part.compile(
                backend=self.backend,
                mode=self.mode,
                dynamic=self.dynamic,
                fullgraph=self.fullgraph,
            )
            self.compiled.append(name)
        line = f"compile ({self.backend}): {', '.join(self.compiled) or 'nothing'}"
        if self.eager:
            line += "; left eager: " + "; ".join(self.eager)
        if rank_zero_only.rank == 0:
            log.info(line)
