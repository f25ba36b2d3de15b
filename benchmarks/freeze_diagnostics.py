"""Which part of freezing costs accuracy: Lightning's DDP with one part of it, the rest trained.

``finetune.py``'s diagnostic configurations (not run unless asked for), each plain Lightning DDP
whose optimizer skips some weights, their gradients dropped before every optimizer step (AdamW
then changes neither the weights nor their moments, as for frozen ones; the compute is DDP's):

* ``ddp_frozen_pre``: the embeddings (``pre``) from epoch 1 on, every block trained;
* ``ddp_frozen_blocks``: blocks ``[0, F)`` with ``F`` the epoch's entry of ``--frozen-schedule``
  (by default the full system's decisions on this fine-tune), the embeddings trained.

Unlike the full system, the skipped blocks keep dropout (they stay in train mode).
"""

from __future__ import annotations

DIAGNOSTICS = ("ddp_frozen_pre", "ddp_frozen_blocks")


def gradient_drop(config: str, schedule: list[int]):
    """The callback of diagnostic ``config``: drops the gradients of what it keeps from training."""
    from lightning.pytorch.callbacks import Callback

    from lightning_pipetx import find_blocks

    class GradientDrop(Callback):
        def on_fit_start(self, trainer, pl_module):
            self.split = find_blocks(pl_module)
            if len(schedule) < trainer.max_epochs:
                raise ValueError(f"--frozen-schedule names {len(schedule)} epochs; the run has {trainer.max_epochs}")

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            epoch = trainer.current_epoch
            if config == "ddp_frozen_pre":
                params = list(self.split.pre_parameters()) if epoch > 0 else []
            else:
                params = [p for index in range(schedule[epoch]) for p in self.split.block_parameters(index)]
            for param in params:
                param.grad = None

    return GradientDrop()
