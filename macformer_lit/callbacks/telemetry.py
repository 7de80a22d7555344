"""Attention telemetry: how far each layer's backend is from exact attention (docs/maths.md §13).

Every ``every_n_steps`` training steps, forward hooks (``with_kwargs=True``, so the model
needs no changes) capture each attention core's inputs on the first ``batch_size``
sequences; after the step the callback reruns the core on them and logs, per layer i:

- ``telemetry/layer{i}/nmse``: NMSE against the exact kernelized attention with the
  backend's ``target_kernel`` (after pre-SBN when it wraps the core),
- ``.../nmse_uniform`` and ``.../nmse_first_order``: the same for uniform attention and the
  deterministic [1, x] map, the baselines that pre-SBN makes hard to beat,
- ``.../nmse_own`` and ``.../nmse_uniform_own``: where the backend computes another kernel
  exactly than the one it stands for (``own_kernel``: the degree-2 Maclaurin map computes
  a₀ + a₁s + a₂s², not exp), the backend's and uniform attention's NMSE against that
  kernel's exact attention,
- ``.../denominator_engaged``: fraction of rows where the denominator policy acted,
- ``.../logit_min``, ``.../logit_max``: range of q·k/√d over the real pairs,
- ``.../temperature``, ``.../temperature_top``: ppSBN's learnable τ (mean and largest over
  the heads), where the layer has one; the NMSE above is then at that τ (q is captured
  after it), against the exact kernel the core stands for.

Where a core maps q and k before its kernel (``kernel_inputs``: the Maclaurin backend's
``input_map``), the exact attentions and the logits take them mapped, as its kernel does.

Only rank 0 measures; it logs to every attached logger (``logger.log_metrics``, e.g. CSV and
W&B) at the step measured.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from macformer_lit.attention import PPSBNAttention, attention_cores
from macformer_lit.attention.reference import (
    first_order_attention,
    keep_mask,
    kernelized_attention,
    nmse,
    uniform_attention,
)


class AttentionTelemetry(Callback):
    def __init__(self, *, every_n_steps: int = 100, batch_size: int = 1, max_queries: int = 256):
        if min(every_n_steps, batch_size, max_queries) < 1:
            raise ValueError("every_n_steps, batch_size and max_queries must be >= 1")
        self.every_n_steps, self.batch_size, self.max_queries = (
            every_n_steps,
            batch_size,
            max_queries,
        )
        self._handles: list = []
        self._captured: dict[int, tuple] = {}
        self._armed = False
        self._last_step = -1
        self._temperatures: dict[int, PPSBNAttention] = {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        cores = attention_cores(pl_module)
        index = {id(core): i for i, (_, core) in enumerate(cores)}
        for module in pl_module.modules():
            if isinstance(module, PPSBNAttention) and module.temperature_max is not None:
                for _, core in attention_cores(module):
                    self._temperatures[index[id(core)]] = module
        for i, (_, core) in enumerate(cores):
            hook = self._capture_hook(i)
            self._handles.append(core.register_forward_hook(hook, with_kwargs=True))

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _capture_hook(self, layer: int):
        def hook(module, args, kwargs, output):
            if self._armed and layer not in self._captured:
                q, k, v = (list(args) + [kwargs.get(n) for n in ("q", "k", "v")[len(args) :]])[:3]
                mask = kwargs.get("key_padding_mask")
                b = self.batch_size
                self._captured[layer] = (
                    module,
                    q[:b].detach(),
                    k[:b].detach(),
                    v[:b].detach(),
                    None if mask is None else mask[:b],
                    bool(kwargs.get("causal", False)),
                )

        return hook

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int
    ) -> None:
        step = trainer.global_step
        # global_step repeats over accumulated micro-batches: measure the first one only.
        self._armed = (
            trainer.is_global_zero and step % self.every_n_steps == 0 and step > self._last_step
        )
        if self._armed:
            self._last_step = step

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        if not self._armed:
            return
        self._armed = False
        metrics = {
            f"telemetry/layer{layer}/{key}": value
            for layer, captured in sorted(self._captured.items())
            for key, value in self.measure(*captured).items()
        }
        for layer, wrapper in sorted(self._temperatures.items()):
            with torch.no_grad():
                tau = wrapper.temperature().flatten()
            metrics[f"telemetry/layer{layer}/temperature"] = float(tau.mean())
            metrics[f"telemetry/layer{layer}/temperature_top"] = float(tau.max())
        self._captured = {}
        # Straight to the loggers, at the step measured: self.log from this hook would repeat
        # the values on later steps.
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=self._last_step)

    @torch.no_grad()
    def measure(self, core, q, k, v, mask, causal) -> dict[str, float]:
        """Error and range metrics of ``core`` on one captured call."""
        n = min(q.shape[2], self.max_queries)
        q = q[:, :, :n]
        if causal:
            k, v, mask = k[:, :, :n], v[:, :, :n], None if mask is None else mask[:, :n]
        training = core.training
        core.train(False)
        try:
            out, stats = core.forward_with_stats(q, k, v, key_padding_mask=mask, causal=causal)
        finally:
            core.train(training)
        kernel = core.target_kernel
        # The exact attentions take q and k as the backend's kernel does (its input map).
        q, k = core.kernel_inputs(q, k)
        exact = kernelized_attention(q, k, v, kernel, mask, causal)
        logits = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
        keep = keep_mask(q, k, mask, causal).expand_as(logits)
        metrics = {
            "nmse": nmse(out, exact),
            "nmse_uniform": nmse(uniform_attention(q, k, v, mask, causal), exact),
            "nmse_first_order": nmse(first_order_attention(q, k, v, kernel, mask, causal), exact),
            "logit_min": logits[keep].min(),
            "logit_max": logits[keep].max(),
        }
        own = getattr(core, "own_kernel", None)
        if own is not None:
            own_exact = kernelized_attention(q, k, v, own, mask, causal)
            metrics["nmse_own"] = nmse(out, own_exact)
            metrics["nmse_uniform_own"] = nmse(uniform_attention(q, k, v, mask, causal), own_exact)
        if "denominator_engaged" in stats:
            metrics["denominator_engaged"] = stats["denominator_engaged"]
        return {key: float(value) for key, value in metrics.items()}
