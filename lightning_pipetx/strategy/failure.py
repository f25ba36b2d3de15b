"""What a rank does with the user's model when a run stops on an exception.

The exception ends the run on the rank that raised it; its peers may be alive, waiting on it,
or dead, and the training process groups may be out of step. So the rank first closes its gloo
connections in the training groups, the world's included (:func:`wake_peers`): a peer waiting
on it inside gloo (a transfer, a collective) returns from its wait with an error (``lost global
rank N``, or the KeyboardInterrupt a Ctrl-C left pending there) and stops too, at once rather
than at the process-group timeout. Then the ranks agree, over a gloo group of their own
(created at setup) and within a short window, that every rank is tearing down in the same
layout, with no transition under way. Then every block is restored on every rank through that
group, and the checkpoints and barriers that follow (Lightning's ``OnExceptionCheckpoint``, a
save after the run) go over it too, until the next run's set-up; so do the strategy's barrier,
broadcast and boolean reductions (Lightning's callbacks call them as the run stops). Otherwise
(a dead peer, one busy outside gloo past the window, a transition under way) the rank's model
stays incomplete, and an error is logged saying which blocks it lacks and to load the last
checkpoint instead. NCCL offers no way to wake a waiting peer: there, it waits until the timeout."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import zlib
from collections.abc import Generator
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from lightning_pipetx.strategy.engine import PipelineEngine

log = logging.getLogger("lightning_pipetx")

AGREEMENT_SECONDS = 30.0
_WAKE_TAG = 0x7A3E  # a tag nothing sends: the receive posted to close a connection never completes


class CheckpointAfterFailureError(RuntimeError):
    """A checkpoint asked for as the run stops on an exception that not every rank stopped with, or
    that was raised while blocks moved between ranks for a new layout."""


class FailureAgreement:
    """A gloo group over the world, for agreeing after an exception."""

    def __init__(self, world_size: int, timeout: timedelta) -> None:
        self.world_size = world_size
        self.group = dist.new_group(backend="gloo", timeout=timeout) if world_size > 1 else None
        self.window = timedelta(seconds=min(AGREEMENT_SECONDS, timeout.total_seconds() / 3))
        self.broken = False  # an agreement timed out: the group is out of step for good
        self.agreed = False  # every rank stopped alike: a checkpoint may gather over the group

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
        except RuntimeError as error:  # a peer is busy elsewhere, or gone
            log.warning("pipetx: the ranks did not all report within %s that they stopped: %s", self.window, error)
            self.broken = True
            return False
        self.agreed = all(int(value) == state for value in gathered)
        return self.agreed

    def close(self) -> None:
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None


def log_incomplete_model(rank: int, lacking: list[int], path: str, moving: bool) -> None:
    """Say that this rank's model lacks the ``lacking`` blocks after a failed run."""
    cause = "while blocks were moving between ranks for a new layout" if moving else "that not every rank stopped with"
    log.error(
        "pipetx: the run stopped on an error %s, so global rank %d could not get the blocks it does not run back: "
        "its copy of the model lacks blocks %s of %r (their weights are NaN or partly received here), and the "
        "weights it shares with other stages may lag behind. Do not use this model object; load the last "
        "checkpoint instead (Model.load_from_checkpoint(path), or ckpt_path= to resume).",
        cause,
        rank,
        lacking,
        path,
    )


def wake_peers(groups: list[dist.ProcessGroup]) -> None:
    """Close this rank's gloo connections in ``groups``, so that a peer waiting on this rank in
    a transfer or collective of them raises now rather than at the timeout: a receive from each
    peer that nothing answers, waited on for a millisecond (gloo closes a connection whose
    operation times out). Groups without gloo are left alone."""
    rank = dist.get_rank()
    for group in groups:
        if "gloo" not in str(dist.get_backend(group)):
            continue
        for peer in dist.get_process_group_ranks(group):
            if peer == rank:
                continue
            with contextlib.suppress(RuntimeError):  # the expected timeout, or a peer already gone
                dist.irecv(torch.zeros(1), src=peer, group=group, tag=_WAKE_TAG).wait(timedelta(milliseconds=1))


@contextlib.contextmanager
def keyboard_interrupts_held() -> Generator[None, None, None]:
    """Hold a Ctrl-C (SIGINT) that arrives inside the block and raise it as the block ends.

    Applying a freeze decision moves blocks between ranks: interrupted half-way, no rank can tell
    which blocks arrived, and the model in memory is lost. A terminal's Ctrl-C reaches every rank,
    so every rank holds it, finishes the move, and stops in the new layout, where the ranks agree
    and restore the whole model. Only in the main thread, where SIGINT has a Python handler
    (Python's own raises KeyboardInterrupt); a second Ctrl-C inside the block is held too.
    """
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous) or threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        previous(signal.SIGINT, held[0])


def stop_after_failure(
    engine: PipelineEngine,
    agreement: FailureAgreement | None,
    moving: bool,
    rank: int,
    path: str,
    optimizers: list,
    also_waited_in: list[dist.ProcessGroup],
) -> bool:
    """Close ``engine`` after an exception: wake the peers waiting on this rank, then the whole
    model back on every rank where every rank stopped alike (the same layout, no transition under
    way; returns True), else log what this rank lacks. ``also_waited_in``: groups besides the
    engine's that a peer may wait in."""
    if engine.layout.world_size > 1:
        wake_peers(engine.training_groups() + also_waited_in)
    engine.close(restore_weights=False, destroy_groups=False)  # the training groups may be out of step
    state = _stopped_state(engine, moving)
    if state >= 0 and agreement is not None and agreement.every_rank_failed(state):
        engine.restore_after_failure(agreement.group, optimizers)
        return True
    if not holds_whole_model(engine, moving):
        lacking = [i for i in range(engine.split.num_blocks) if moving or i not in engine.block_range]
        log_incomplete_model(rank, lacking, path, moving)
    return False


def holds_whole_model(engine: PipelineEngine, moving: bool) -> bool:
    """Whether every rank holds every block whole without restoring them: no pipeline, and no
    transition under way. (A block restored or moved half-way reads as held: its storage is
    allocated before its data arrives.)"""
    return not moving and engine.layout.pipeline_length == 1


def checkpoint_refused(moving: bool) -> CheckpointAfterFailureError:
    """The error of a checkpoint asked for as the run stops on an exception where the ranks did not agree."""
    if moving:
        return CheckpointAfterFailureError(
            "pipetx: trainer.save_checkpoint as the run stops on an exception raised while blocks were moving "
            "between ranks for a new layout: no rank can tell which of them arrived, so the blocks cannot be "
            "gathered and no checkpoint is written. Resume from the last checkpoint ModelCheckpoint saved."
        )
    return CheckpointAfterFailureError(
        "pipetx: trainer.save_checkpoint as the run stops on an exception, but not every rank stopped with it "
        "within the agreement's window (a rank died, or was busy outside the process groups), so the blocks they "
        "hold cannot be gathered and no checkpoint is written. Resume from the last checkpoint ModelCheckpoint saved."
    )


def _stopped_state(engine: PipelineEngine, moving: bool) -> int:
    """What the ranks compare to agree that they stopped alike: the plan, or -1 during a transition."""
    plan = f"{engine.plan.layout} {engine.plan.bounds}"
    return -1 if moving else zlib.crc32(plan.encode())


def _raised_in_communication(exception: BaseException) -> bool:
    """Whether the innermost frame of the traceback is in torch.distributed or this package."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return _raised_in(exception, os.path.dirname(os.path.abspath(dist.__file__)), package)


def _raised_in_backward(exception: BaseException) -> bool:
    """Whether the innermost frame of the traceback is torch.autograd's (a backward's error)."""
    return _raised_in(exception, os.path.dirname(os.path.abspath(torch.autograd.__file__)))


def _raised_in(exception: BaseException, *directories: str) -> bool:
    tb = exception.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(directories)


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
    if not isinstance(exception, Exception) or _raised_in_communication(exception) or _raised_in_backward(exception):
        return
    note = (
        f"pipetx: this rank runs stage {stage} of a {num_stages}-stage pipeline. In training_step, the code after "
        f"the model call runs on the last stage of each pipeline only (here the forward stops after this stage's "
        f"blocks), so lists or values that training_step collects there stay empty on this rank. If this error "
        f"comes from reading them (in on_train_epoch_end, say), log the values with self.log(..., on_epoch=True) "
        f"instead, or collect them in validation_step, which runs to its end on every stage."
    )
    _add_note(exception, note)
