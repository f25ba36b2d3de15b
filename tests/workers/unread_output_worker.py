"""A model whose head sums every block's output, on a 2-stage pipeline: the last stage does not
compute blocks 0 and 1, so the run stops with an error naming the fix. With ``tuple_stream``, a
model handing each block the previous block's whole output tuple, refused at the stage boundary.

Usage: torchrun --nproc_per_node=2 unread_output_worker.py OUT_DIR [summed|tuple_stream]
"""

import sys

from tiny_models import RandomVectorDataset, SummedBlocksRegressor, TupleStreamRegressor, make_trainer
from torch.utils.data import DataLoader
from worker_exit import run_worker

from lightning_pipetx import ElasticPipelineStrategy


def main() -> None:
    strategy = ElasticPipelineStrategy(pipeline_length=2, profile_steps=0, cache=False)
    trainer = make_trainer([], devices=2, strategy=strategy, max_epochs=1, default_root_dir=sys.argv[1])
    model = TupleStreamRegressor if sys.argv[2:] == ["tuple_stream"] else SummedBlocksRegressor
    trainer.fit(model(seed=0, dropout=0.0), DataLoader(RandomVectorDataset(size=16), batch_size=8))


if __name__ == "__main__":
    run_worker(main)
