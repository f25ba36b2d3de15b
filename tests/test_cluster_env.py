"""A SLURM allocation resolves to the right ranks, replica, stage and node-local cache folder."""

import lightning.pytorch as pl
import pytest
from lightning.fabric.plugins.environments import SLURMEnvironment

from lightning_pipetx import ElasticPipelineStrategy, Layout
from lightning_pipetx.autocache import cache_directories

# 2 nodes x 2 tasks: this process is task 3, the second task on the second node.
SLURM = {
    "SLURM_NTASKS": "4",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NAME": "finetune",  # not "bash": an interactive shell is not treated as SLURM
    "SLURM_JOB_ID": "1234",
    "SLURM_NODELIST": "node[7-8]",
    "MASTER_PORT": "29555",
}


@pytest.fixture
def slurm(monkeypatch):
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)


def test_slurm_variables_give_the_ranks_the_layout_and_the_node(slurm, tmp_path):
    strategy = ElasticPipelineStrategy(pipeline_length=2)
    trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=strategy, logger=False)
    assert isinstance(strategy.cluster_environment, SLURMEnvironment)
    assert (trainer.world_size, trainer.global_rank, trainer.local_rank, trainer.node_rank) == (4, 3, 1, 1)
    assert strategy.cluster_environment.main_address == "node7" and strategy.cluster_environment.main_port == 29555
    layout = Layout.for_world(trainer.world_size, 2)
    assert str(layout) == "2x2"
    assert layout.coords(trainer.global_rank) == (1, 0)  # replica 1, first stage
    ram, spill = cache_directories("run", strategy.node_rank, str(tmp_path))
    assert spill.name == "pipetx-run-node1" and "pipetx-run-node1" in str(ram)  # AutoCache's files: per node


def test_an_interactive_slurm_shell_is_not_a_slurm_job(slurm, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_NAME", "bash")
    strategy = ElasticPipelineStrategy(pipeline_length=1)
    pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False)
    assert not isinstance(strategy.cluster_environment, SLURMEnvironment)
