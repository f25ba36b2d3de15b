"""Gradient sync in a 1xN layout against torch's DistributedDataParallel, to the bit.

The same tiny ViT is trained twice in the same 2 gloo processes, on the same batches, its
gradients reduced once by GradientSync and once by DDP (benchmarks/grad_sync_peer.py times
the two this way): both average the same per-rank gradients, so every weight must be equal
to the bit, with one bucket or many (reductions started during the backward), and across an
accumulation window.
"""

import json

import pytest
from distributed import run_workers


@pytest.mark.parametrize(
    ("bucket_bytes", "accumulate"),
    [(25 * 2**20, 1), (16 * 2**10, 1), (16 * 2**10, 3)],
    ids=["one-bucket", "many-buckets", "many-buckets-accumulate-3"],
)
def test_gradient_sync_trains_as_ddp_to_the_bit(tmp_path, bucket_bytes, accumulate):
    run_workers("ddp_peer_worker.py", 2, str(tmp_path), str(bucket_bytes), str(accumulate))
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["unequal"] == []
        if bucket_bytes < 2**20:
            assert result["buckets"] > 3 and result["launched"] > 0  # reduced during the backward
