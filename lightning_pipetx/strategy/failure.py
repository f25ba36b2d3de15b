"""What a rank does with the user's model when a run stops on an exception.

The exception ends the run on the rank that raised it; its peers may be alive, waiting on it,
or dead, and the training process groups may be out of step. So the ranks first agree, over
a gloo group of their own (created at setup and used for nothing else) and within a short
window, that every rank is tearing down after an exception, in the same layout: an exception
raised on every rank, or a KeyboardInterrupt. Then every block is restored on every rank
through that group. Otherwise the rank's model stays incomplete, and an error is logged
saying which blocks it lacks and to load the last checkpoint instead.
"""

from __future__ import annotations

import logging
import os
import sys
import zlib
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from lightning_pipetx.strategy.engine import PipelineEngine
    from lightning_pipetx.strategy.param_store import ParamStore

log = logging.getLogger("lightning_pipetx")

AGREEMENT_SECONDS = 30.0


class CheckpointAfterFailureError(RuntimeError):
    """A checkpoint asked for as the run stops on an exception that not every rank raised."""


class FailureAgreement:
    """A gloo group over the world, for agreeing after an exception."""

    def __init__(self, world_size: int, timeout: timedelta) -> None:
        self.world_size = world_size
        self.group = dist.new_group(backend="gloo", timeout=timeout) if world_size > 1 else None
        self.window = timedelta(seconds=min(AGREEMENT_SECONDS, timeout.total_seconds() / 3))
        self.broken = False  # an agreement timed out: the group is out of step for good

    def every_rank_failed(self, state: int) -> bool:
        """True when every rank calls this within the window with the same ``state``."""
        if self.group is None:
            return True
        if self.broken:
            return False
        mine = torch.tensor([state], dtype=torch.int64)
        gathered = [torch.zeros_like(mine) for _ in range(self.world_size)]
        try:
            dist.all_gather(gathered, mine, group=self.group, async_op=True).wait(self.window)
        except RuntimeError:  # a peer is busy elsewhere, or gone
            self.broken = True
            return False
        return all(int(value) == state for value in gathered)

    def close(self) -> None:
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None


def log_incomplete_model(rank: int, released: list[int], path: str) -> None:
    """Say that this rank's model lacks ``released`` blocks after a failed run."""
    log.error(
        "pipetx: the run stopped on an error that not every rank took part in, so global rank %d could not get the "
        "blocks it does not run back: its copy of the model lacks blocks %s of %r (their weights are NaN here), and "
        "the weights it shares with other stages may lag behind. Do not use this model object; load the last "
        "checkpoint instead (Model.load_from_checkpoint(path), or ckpt_path= to resume).",
        rank,
        released,
        path,
    )


def restore_after_failure(
    engine: PipelineEngine,
    agreement: FailureAgreement | None,
    moving: bool,
    store: ParamStore,
    rank: int,
    path: str,
) -> bool:
    """Close ``engine`` after an exception: the whole model back on every rank where every rank
    stopped alike (the same layout, no transition under way; returns True), else log what this
    rank lacks."""
    engine.close(restore_weights=False, destroy_groups=False)  # the training groups may be out of step
    state = _stopped_state(engine, moving)
    if state >= 0 and agreement is not None and agreement.every_rank_failed(state):
        engine.restore_after_failure(agreement.group)
        agreement.close()
        return True
    if store.released_blocks():
        log_incomplete_model(rank, store.released_blocks(), path)
    return False


def agree_to_checkpoint_after_failure(engine: PipelineEngine, agreement: FailureAgreement | None, moving: bool) -> None:
    """Before the collectives of a checkpoint taken as the run stops on an exception (Lightning's
    ``OnExceptionCheckpoint``, which saves before the strategy hears of it): go on only where every
    rank stopped alike, else raise instead of waiting for peers that are still training."""
    state = _stopped_state(engine, moving)
    if state >= 0 and (agreement is None or agreement.every_rank_failed(state)):
        return
    raise CheckpointAfterFailureError(
        "pipetx: trainer.save_checkpoint as the run stops on an exception that not every rank raised: the other "
        "ranks still train and wait for this one, so the blocks they hold cannot be gathered and no checkpoint "
        "is written. Under a pipeline, the code after the model call in training_step runs (and raises) on the "
        "last stage only. Resume from the last checkpoint ModelCheckpoint saved."
    )


def _stopped_state(engine: PipelineEngine, moving: bool) -> int:
    """What the ranks compare to agree that they stopped alike: the plan, or -1 during a transition."""
    plan = f"{engine.plan.layout} {engine.plan.bounds}"
    return -1 if moving else zlib.crc32(plan.encode())


def _raised_in_communication(exception: BaseException) -> bool:
    """Whether the innermost frame of the traceback is in torch.distributed or this package."""
    tb = exception.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = os.path.abspath(tb.tb_frame.f_code.co_filename)
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return filename.startswith((os.path.dirname(os.path.abspath(dist.__file__)), package))


PLACEHOLDER_WRITE = "more than one element of the written-to tensor refers to a single memory location"


def explain_placeholder_write(exception: BaseException, num_stages: int) -> bool:
    """Attach the likely cause to torch's error at an in-place write to a weight this rank does
    not hold (a block of another stage: its placeholder is one element, expanded); whether it was one."""
    if num_stages <= 1 or not isinstance(exception, RuntimeError) or PLACEHOLDER_WRITE not in str(exception):
        return False
    _add_note(
        exception,
        f"pipetx: under a {num_stages}-stage pipeline each rank holds only its stage's blocks; the others' weights "
        f"are placeholders that read NaN and cannot be written. This error is likely code in a hook or a step that "
        f"writes every weight in place (an average copied into the model, a clamp_ of all weights): write only "
        f"the blocks this stage runs, or pass ElasticPipelineStrategy(pipeline_length=1).",
    )
    return True


def _add_note(exception: BaseException, note: str) -> None:
    if sys.version_info >= (3, 11):
        exception.add_note(note)
    else:
        log.error(note)


def explain_training_outputs(exception: BaseException, stage: int, num_stages: int) -> None:
    """Attach to an exception raised on a non-last stage during training the likely cause:
    code that reads what ``training_step`` collected after its model call."""
    if not isinstance(exception, Exception) or _raised_in_communication(exception):
        return
    note = (
        f"pipetx: this rank runs stage {stage} of a {num_stages}-stage pipeline. In training_step, the code after "
        f"the model call runs on the last stage of each pipeline only (here the forward stops after this stage's "
        f"blocks), so lists or values that training_step collects there stay empty on this rank. If this error "
        f"comes from reading them (in on_train_epoch_end, say), log the values with self.log(..., on_epoch=True) "
        f"instead, or collect them in validation_step, which runs to its end on every stage."
    )
    _add_note(exception, note)
