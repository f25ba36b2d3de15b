"""Whether a captured state can be kept: one hidden state, no gradient, and one row per sample.

AutoCache keeps row ``i`` of the frozen prefix's hidden state as the state of the micro-batch's
sample ``i``, so dimension 0 must be the batch. Sequence-first blocks (``[length, batch, width]``:
``nn.TransformerEncoderLayer`` with ``batch_first=False``) break that. A state whose first dimension
is not the micro-batch's sample count is refused. One whose sample count is also the size of another
dimension (batch 16, length 16) proves nothing: until a micro-batch of another size (an epoch's last,
or the samples ``drop_last`` left out) shows dimension 0 to be the batch, such states are served only
once each sample's row entering the frozen blocks was compared unchanged between epochs (a sequence-first
row mixes the samples of its batch, and changes with them), and a change refuses the cache.
"""

from __future__ import annotations

LAYOUT_FIX = (
    "Use batch-first blocks (nn.TransformerEncoderLayer(batch_first=True)) and a batch size that differs from the "
    "other dimensions of the hidden state (the sequence length), or pass cache=False"
)

ROWS_PER_SAMPLE_FIX = (
    "For several rows per sample, pass cache=False (freezing still skips the frozen blocks' backward); "
    "for sequence-first blocks, use batch-first ones (nn.TransformerEncoderLayer(batch_first=True))"
)

EXTRA_OUTPUTS = (
    "the frozen blocks return more than their hidden state and the model reads the rest (T5 passes its position "
    "bias on to the next block): only the hidden state can be cached"
)
EXTRA_OUTPUTS_FIX = "Pass cache=False"
STILL_TRAINS = (
    "the frozen blocks' output requires a gradient: a weight they use from outside the frozen prefix "
    "(registered after the blocks, or one FreezeCallback found feeding no block in the first step: its "
    "post_weights) still trains, or a hook makes their input require one (Hugging Face's "
    "enable_input_require_grads, which gradient_checkpointing_enable calls), so a cached state would go stale "
    "or its gradient would be lost. Freeze that weight too; for Hugging Face's checkpointing pass "
    "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}) and then call "
    "model.disable_input_require_grads(); or pass cache=False"
)


class RowLayout:
    """What the hidden states seen so far show about their dimension 0."""

    def __init__(self) -> None:
        self.confirmed = False  # a micro-batch's sample count matched dimension 0 and no other
        self._ambiguous: tuple[int, tuple[int, ...]] | None = None  # a kept state's shape that could not tell
        self._ambiguous_elsewhere = False  # another rank kept such states (its cache may be read here)

    def check(self, samples: int, shape: tuple[int, ...]) -> bool:
        """Whether row ``i`` can be sample ``i`` (False: dimension 0 is not the micro-batch's samples)."""
        if not shape or shape[0] != samples:
            return False
        if samples not in shape[1:]:
            self.confirmed = True
        elif self._ambiguous is None:
            self._ambiguous = (samples, shape)
        return True

    @property
    def unproven(self) -> bool:
        """States were kept whose shape could not tell the batch dimension, and no micro-batch has shown it."""
        return (self._ambiguous is not None or self._ambiguous_elsewhere) and not self.confirmed

    def flags(self) -> list[float]:
        """What this rank has seen, for :meth:`agree`."""
        return [float(self.confirmed), float(self._ambiguous is not None)]

    def agree(self, flags: list[float]) -> None:
        """Take what every rank has seen (:meth:`flags` summed over the ranks): the layout is the
        model's, and a rank that becomes a first stage may read states another one kept."""
        confirmed, ambiguous = flags
        self.confirmed = self.confirmed or confirmed > 0
        self._ambiguous_elsewhere = ambiguous > 0

    @staticmethod
    def wrong(samples: int, shape: tuple[int, ...]) -> tuple[str, str]:
        """Why a state of ``shape`` cannot be kept for ``samples`` samples, and the fix."""
        causes = "sequence-first blocks, as nn.TransformerEncoderLayer(batch_first=False), put the length first"
        fix = LAYOUT_FIX
        if shape and shape[0] > samples and shape[0] % samples == 0:
            causes = (
                f"the model gives its blocks {shape[0] // samples} rows per sample, as a multiple-choice head "
                f"flattens [batch, choices, length] into batch x choices rows, while AutoCache keeps one row per "
                f"sample; or {causes}"
            )
            fix = ROWS_PER_SAMPLE_FIX
        reason = (
            f"the frozen blocks' hidden state has shape {shape} for a micro-batch of {samples} samples: its first "
            f"dimension is not the batch ({causes}), so its rows cannot be matched with the samples"
        )
        return reason, fix

    def suspect(self) -> str:
        """Why unproven states whose input changed between epochs are not served."""
        samples, shape = self._ambiguous or ("as many", "(samples, samples, ...)")
        return (
            f"the frozen blocks' hidden states have shape {shape} for {samples} samples, which cannot tell whether "
            f"the first dimension is the batch, and their rows changed between epochs for samples the loader yielded "
            f"unchanged: sequence-first blocks (nn.TransformerEncoderLayer(batch_first=False) puts the length "
            f"first), or a step that changes its batch before the model call (noise, masking). No state was served"
        )
