"""A block a stage does not compute (an earlier stage's, or one AutoCache serves) returns an
output no one may read but the next block: a model that reads it elsewhere is refused, not
trained on the wrong tensor; so is one that hands the next block the whole output tuple."""

import pytest
import tiny_models as tm
import torch
from distributed import run_workers
from torch.utils.data import DataLoader

from lightning_pipetx.strategy.model_checks import UnsupportedRecipeError
from lightning_pipetx.strategy.unread_output import UnreadOutput, unread

MESSAGE = "the model read block 0's output other than as block 1's input, on a stage that does not compute it"


def test_an_unread_output_reads_as_its_hidden_states_metadata_and_refuses_any_other_use():
    hidden = torch.randn(4, 3, requires_grad=True)
    output = unread((hidden, None), 0, 2)
    guard = output[0]
    assert isinstance(guard, UnreadOutput) and output[1] is None
    assert guard.shape == hidden.shape and guard.dtype == hidden.dtype and guard.size(0) == 4 and guard.dim() == 2
    assert not guard.requires_grad
    for read in (lambda: guard + 1, lambda: guard.sum(), lambda: torch.stack([guard]), lambda: guard[0]):
        with pytest.raises(UnsupportedRecipeError, match=MESSAGE + r" \(it runs from block 2 on"):
            read()


def test_a_cached_prefix_whose_block_outputs_the_model_reads_elsewhere_is_refused(tmp_path):
    # Its head sums every block's output: a served prefix gave it the cached state for each frozen block.
    loader = DataLoader(tm.RandomVectorDataset(size=32), batch_size=8)
    with pytest.raises(UnsupportedRecipeError, match=MESSAGE + r".*pipeline_length=1, cache=False"):
        tm.cached_trainer(tmp_path, "auto").fit(tm.SummedBlocksRegressor(seed=0, dropout=0.0), loader)
    trainer = tm.cached_trainer(tmp_path, False)
    trainer.fit(tm.SummedBlocksRegressor(seed=0, dropout=0.0), loader)
    assert trainer.callback_metrics["pipetx/frozen_blocks"] == 3


def test_a_pipeline_stage_that_would_read_an_earlier_stages_block_output_is_refused(tmp_path):
    # The last stage got the first stage's last output for blocks 0 and 1 alike, and sent no gradient back for them.
    output = run_workers("unread_output_worker.py", 2, str(tmp_path), expect_failure=True, timeout=180)
    assert MESSAGE + " (it runs from block 2 on" in output


TUPLE_INPUT = "takes a tuple as its first input (the model hands a block's whole output to the next block"


def test_a_model_handing_each_block_the_previous_output_tuple_is_refused_naming_the_tuple(tmp_path, caplog):
    # A cached state, like a stage boundary, hands the next block the hidden state as a tensor.
    loader = DataLoader(tm.RandomVectorDataset(size=32), batch_size=8)
    trainer = tm.cached_trainer(tmp_path, "auto")
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        trainer.fit(tm.TupleStreamRegressor(seed=0, dropout=0.0), loader)
    assert any(TUPLE_INPUT in r.message and "switched off" in r.message for r in caplog.records), caplog.text
    assert trainer.callback_metrics["pipetx/frozen_blocks"] == 3
    with pytest.raises(ValueError, match=r"takes a tuple as its first input.*Pass cache=False"):
        tm.cached_trainer(tmp_path, True).fit(tm.TupleStreamRegressor(seed=0, dropout=0.0), loader)
    output = run_workers("unread_output_worker.py", 2, str(tmp_path), "tuple_stream", expect_failure=True, timeout=180)
    assert "UnsupportedRecipeError: block 2 " + TUPLE_INPUT in output
    assert "(h, mask = block(h, mask)), or pass ElasticPipelineStrategy(pipeline_length=1)" in output
