"""Two nodes simulated on this machine (one torchrun launcher per node): ranks and nodes,
node-local AutoCache folders, a transition from a 2-stage pipeline to 2 replicas, cache hits
on both nodes after it, and checkpoints."""

import json

import pytest
import torch
from distributed import run_nodes


@pytest.mark.parametrize("sampler", ["stable", "distributed"])
def test_two_nodes_keep_their_cache_hits_with_stable_shards(tmp_path, sampler):
    run_nodes("multinode_worker.py", 2, 1, str(tmp_path), sampler)
    reports = [json.loads((tmp_path / f"node{n}_rank{n}.json").read_text()) for n in range(2)]
    assert [(r["global_rank"], r["node_rank"], r["local_rank"], r["world_size"]) for r in reports] == [
        (0, 0, 0, 2),
        (1, 1, 0, 2),
    ]
    epochs = reports[0]["epochs"]
    assert [e["layout"] for e in epochs] == [[2, 1], [2, 1], [1, 2], [1, 2]]  # 2 blocks frozen after epoch 1
    folders = epochs[-1]["folders"]
    assert len(folders) == 2 and {f.rsplit("-", 1)[1] for f in folders} == {"node0", "node1"}
    assert epochs[2]["hit_rate"] == 0.0  # the new replica's node fills its cache ...
    if sampler == "stable":
        assert epochs[3]["hit_rate"] > 0.9  # ... and both nodes read their own samples back
    else:
        assert epochs[3]["hit_rate"] < 0.9  # Lightning's sampler deals half the samples to the other node
    checkpoints = sorted((tmp_path / "checkpoints").glob("*.ckpt"))
    assert len(checkpoints) == 4
    last = torch.load(checkpoints[-1], weights_only=False)
    assert all(torch.isfinite(v).all() for v in last["state_dict"].values() if v.is_floating_point())
    assert last["epoch"] == 3
