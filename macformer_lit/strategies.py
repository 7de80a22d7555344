"""Lightning's ``FSDPStrategy`` (torch FSDP1), on GPUs and on CPU with gloo.

``FSDP`` takes the arguments of ``lightning.pytorch.strategies.FSDPStrategy`` and adds no
option. On GPUs it is the stock strategy plus the fixes marked *any device*; on CPU it
also gets past the two places where Lightning and torch assume an accelerator. What each
override works around (Lightning 2.6.6, torch 2.13):

1. *CPU.* Lightning refuses FSDP without CUDA, but only for ``type(strategy) is
   FSDPStrategy`` (``trainer/connectors/accelerator_connector.py``,
   ``_check_strategy_and_fallback``), so a subclass passes. Its ``_setup_model`` hands
   FSDP ``device_id=root_device.index``, None on CPU, and FSDP then raises "FSDP needs a
   non-CPU accelerator device" (``torch/distributed/fsdp/_init_utils.py``,
   ``_init_device_handle``): on CPU we pass ``device_id=torch.device("cpu")``.
2. *CPU.* Full checkpoints are gathered with ``offload_to_cpu=True``
   (``fabric/strategies/fsdp.py``, ``_get_full_state_dict_context``), and FSDP takes the
   offload to make a copy, which ``.cpu()`` does not make of a tensor already there.
   The model's state dict then points at storage ``FlatParamHandle.to_cpu`` has freed
   (``torch/distributed/fsdp/_flat_param.py``; the clone in ``_full_post_state_dict_hook``
   segfaults), and every optimiser state shares the one gather buffer, so each Adam
   ``exp_avg`` is saved as a copy of ``exp_avg_sq`` (``_optim_utils.py``,
   ``_gather_all_orig_param_state``: the clone is skipped when offloading). On CPU we
   gather with ``offload_to_cpu=False``: there is nothing to offload.
3. *Any device.* Lightning's ``FSDPPrecision.clip_grad_by_norm`` raises, for want of "a
   reference to the root module" (``plugins/precision/fsdp.py``), and every shipped config
   clips at norm 1. The strategy has that reference: ``_FSDPPrecision`` clips through
   ``FullyShardedDataParallel.clip_grad_norm_``, whose norm covers every rank's shard.
4. *Any device.* The CLI tests the best checkpoint right after fitting, in the same
   process. Stock ``_setup_model`` then finds the nested FSDP units that auto-wrapping
   left inside the module and does not wrap the root again, so the parameters the root
   unit held (embeddings, output layer) stay this rank's flat shard and loading fails
   ("copying a param with shape [300, 16] ..., the shape in current model is [0]").
   We reuse the wrapper built for that same module.
5. *Any device.* Every FSDP forward all-gathers, so ranks must run the same number of
   evaluation batches. Our evaluation loaders give each rank its own share of a split,
   never repeating an example (exact metrics), in as many batches on every rank
   (``data.common.EvenEvalBatchSampler``), which works for any batch size from 2. With
   batches of one, or a DataModule of one's own, a rank could get a batch more and the
   others would wait forever: we check and raise instead.
6. *Any device.* Lightning reads a full checkpoint with its own unpickler and ignores
   ``weights_only`` (``FSDPStrategy.load_checkpoint``); we check the file with
   ``torch.load(weights_only=True)`` first, as the CLI asks by default.
7. *Any device.* ``configure_optimizers`` runs after wrapping, when every parameter is
   a 1-D view of this rank's shard, so the tasks' rule "no weight decay for vectors"
   (``tasks/optim.py``) would exempt every weight. We build the optimisers while the full
   parameters are gathered (``summon_full_params``; the optimiser keeps the same
   ``Parameter`` objects, sharded again right after): one gather of the whole model at
   setup.

Decoding runs the decoder one position at a time through ``DecoderBlock.step``, not
``forward``, and each rank stops when its own sentences end: leave decoder blocks in the
root unit (``configs/trainer/fsdp.yaml`` wraps encoder blocks only). Their parameters are
still sharded between steps, and gathered once per training or evaluation step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.fabric.strategies.fsdp import (
    _move_torchmetrics_to_device,
    _setup_activation_checkpointing,
)
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import FSDPPrecision, Precision
from lightning.pytorch.strategies import FSDPStrategy
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    FullyShardedDataParallel,
    OptimStateKeyType,
    StateDictType,
)
from torch.nn import Module
from torch.optim import Optimizer


class _FSDPPrecision(FSDPPrecision):
    """``FSDPPrecision`` that clips by norm through the root FSDP module (set by ``FSDP``)."""

    root: FullyShardedDataParallel | None = None

    def clip_grad_by_norm(self, optimizer, clip_val) -> None:
        if self.root is None:
            super().clip_grad_by_norm(optimizer, clip_val)
        else:
            self.root.clip_grad_norm_(clip_val)


class FSDP(FSDPStrategy):
    """``FSDPStrategy`` that also runs on CPU; see the module docstring for each override."""

    _wrapped: FullyShardedDataParallel | None = None

    # (3) Lightning's connector hands every FSDP strategy a plain FSDPPrecision.
    @FSDPStrategy.precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if type(plugin) is FSDPPrecision:
            # Not FSDPPrecision(precision, scaler): its __init__ checks the scaler against
            # a precision it has not set yet.
            scaler, plugin = plugin.scaler, _FSDPPrecision(plugin.precision)
            plugin.scaler = scaler
        FSDPStrategy.precision_plugin.fset(self, plugin)

    def _setup_model(self, model: Module) -> Module:
        units = any(isinstance(m, FullyShardedDataParallel) for m in model.modules())
        if self._wrapped is not None and self._wrapped.module is model:
            # (4) A later stage (test after fit) of the module wrapped before.
            wrapped = self._wrapped
        elif self.root_device.type != "cpu" or units:
            wrapped = super()._setup_model(model)
        else:
            # (1) Stock code, with a device FSDP accepts on CPU.
            wrapped = FullyShardedDataParallel(
                module=model,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=self.root_device,
                **self.kwargs,
            )
            _move_torchmetrics_to_device(wrapped, self.root_device)
            _setup_activation_checkpointing(wrapped, self._activation_checkpointing_kwargs)
        if isinstance(wrapped, FullyShardedDataParallel):
            self._wrapped = wrapped
            if isinstance(self.precision_plugin, _FSDPPrecision):
                self.precision_plugin.root = wrapped
        return wrapped

    def setup_optimizers(self, trainer) -> None:
        # (7) Without use_orig_params the optimiser must take the flat parameters instead.
        if not self.kwargs.get("use_orig_params"):
            return super().setup_optimizers(trainer)
        with FullyShardedDataParallel.summon_full_params(self.model, writeback=False):
            super().setup_optimizers(trainer)

    def _gathered_on_cpu(self):
        """(2) Full state dicts (model and optimisers) gathered with no offload, on rank 0."""
        return FullyShardedDataParallel.state_dict_type(
            self.model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
            FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True),
        )

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._state_dict_type != "full" or self.root_device.type != "cpu":
            return super().lightning_module_state_dict()
        with self._gathered_on_cpu():
            return self.model.state_dict()

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self._state_dict_type != "full" or self.root_device.type != "cpu":
            return super().optimizer_state(optimizer)
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        with self._gathered_on_cpu():
            state = FullyShardedDataParallel.optim_state_dict(self.model, optimizer)
        if self.global_rank == 0:
            # Keyed by parameter index like a plain optimiser's, as Lightning saves it.
            state = FullyShardedDataParallel.rekey_optim_state_dict(
                state, OptimStateKeyType.PARAM_ID, self.model
            )
        return state

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        if weights_only and Path(checkpoint_path).is_file():
            # (6) Raises on anything but tensors and plain containers; mmap reads no weights.
            torch.load(checkpoint_path, map_location="cpu", weights_only=True, mmap=True)
        return super().load_checkpoint(checkpoint_path, weights_only)

    def on_validation_start(self) -> None:
        trainer = self.lightning_module.trainer
        sanity = trainer.sanity_checking
        self._check_lockstep(
            "validation", trainer.num_sanity_val_batches if sanity else trainer.num_val_batches
        )

    def on_test_start(self) -> None:
        self._check_lockstep("test", self.lightning_module.trainer.num_test_batches)

    def on_predict_start(self) -> None:
        self._check_lockstep("predict", self.lightning_module.trainer.num_predict_batches)

    def _check_lockstep(self, stage: str, batches: list[int | float]) -> None:
        """(5) Raise on every rank if the ranks are about to run different numbers of batches."""
        if self.world_size == 1:
            return
        counts = self.all_gather(
            torch.tensor(batches, dtype=torch.float64, device=self.root_device)
        )
        counts = counts.view(self.world_size, -1)  # (ranks, dataloaders)
        if bool((counts != counts[0]).any()):
            per_rank = [
                [int(n) if n != float("inf") else n for n in row] for row in counts.tolist()
            ]
            raise ValueError(
                f"FSDP runs every {stage} batch on all ranks together, but the ranks have "
                f"{per_rank} batches (each rank scores its own share of the split, and the "
                "shares differ by one example). Use an evaluation batch size of 2 or more "
                "(--data.eval_batch_size), which our DataModules cut into as many batches "
                "on every rank, or make the DataModule's shares give as many batches."
            )
