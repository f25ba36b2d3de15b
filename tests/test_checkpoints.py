"""Consolidated checkpoints written under the elastic strategy: they load on one device,
hold the optimizer state of a single-process run, and resume on the same or another number
of processes, as do checkpoints of a plain single-device run."""

import json

import pytest
import torch
from distributed import run_workers
from elastic_cases import build_module, reference_run
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback, LearningRateFinder, ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from tiny_models import RandomVectorDataset, TinySequentialRegressor, make_trainer
from torch.utils.data import DataLoader

from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback
from lightning_pipetx.strategy.checkpoint import atomic_save
from lightning_pipetx.strategy.model_checks import ManualOptimizationError, UnsupportedRecipeError


def _assert_same_weights(actual, expected):
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, atol=1e-5, rtol=1e-4, msg=key)


@pytest.fixture(scope="module")
def bert_run(tmp_path_factory):
    """4 processes, 4x1 -> 2x2 -> 1x4 as blocks freeze; a checkpoint after every epoch."""
    out = tmp_path_factory.mktemp("elastic_ckpt")
    run_workers("elastic_worker.py", 4, str(out), "bert")
    return out


@pytest.fixture(scope="module")
def reference():
    return reference_run("bert")


def test_checkpoint_loads_on_one_device_without_the_strategy(bert_run):
    checkpoint = bert_run / "epoch=2-step=12.ckpt"
    model = type(build_module("bert")).load_from_checkpoint(checkpoint, map_location="cpu")
    final = torch.load(bert_run / "final.pt", weights_only=True)["state"]
    _assert_same_weights(model.state_dict(), final)
    assert torch.load(checkpoint, weights_only=False)["pipetx"]["layout"] == "1x4"


def test_checkpoint_holds_the_optimizer_state_of_one_process(bert_run, reference):
    saved = torch.load(bert_run / "epoch=2-step=12.ckpt", weights_only=False)["optimizer_states"][0]
    expected = reference["optimizer"]
    assert saved["state"].keys() == expected["state"].keys()  # every trainable parameter, same numbering
    for index, state in expected["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(saved["state"][index][key], state[key], atol=1e-6, rtol=1e-4)


def test_trainer_save_checkpoint_after_fit_writes_what_one_process_would(bert_run, reference):
    saved = torch.load(bert_run / "after_fit.ckpt", weights_only=False)
    final = torch.load(bert_run / "final.pt", weights_only=True)["state"]
    _assert_same_weights(saved["state_dict"], final)
    for index, state in reference["optimizer"]["state"].items():
        torch.testing.assert_close(saved["optimizer_states"][0]["state"][index]["exp_avg"], state["exp_avg"])
    # After trainer.validate each rank holds its own blocks' optimizer state only: weights only.
    model = type(build_module("bert")).load_from_checkpoint(bert_run / "after_validate.ckpt", map_location="cpu")
    _assert_same_weights(model.state_dict(), final)
    refused = json.loads((bert_run / "report.json").read_text())["refused_after_validate"]
    assert "weights_only=True" in refused and not (bert_run / "refused.ckpt").exists()


@pytest.mark.parametrize("nprocs", [4, 2])
def test_resume_continues_like_the_uninterrupted_run(bert_run, nprocs, tmp_path):
    # The epoch-1 checkpoint was written before that epoch's freeze decision.
    run_workers("elastic_worker.py", nprocs, str(tmp_path), "bert", "resume", str(bert_run / "epoch=1-step=8.ckpt"))
    resumed = torch.load(tmp_path / "final.pt", weights_only=True)["state"]
    _assert_same_weights(resumed, torch.load(bert_run / "final.pt", weights_only=True)["state"])
    layouts = [tuple(e[1:3]) for e in json.loads((tmp_path / "report.json").read_text())["epochs"]]
    assert layouts == ([(1, 4)] if nprocs == 4 else [(1, 2)])  # re-planned for the world it resumed on


def test_a_single_device_checkpoint_resumes_under_the_strategy(reference, tmp_path):
    reference_run("bert", epochs=2, checkpoint_dir=str(tmp_path / "single"))
    run_workers(
        "elastic_worker.py", 2, str(tmp_path), "bert", "resume", str(tmp_path / "single" / "epoch=1-step=8.ckpt")
    )
    _assert_same_weights(torch.load(tmp_path / "final.pt", weights_only=True)["state"], reference["state"])


def test_an_asynchronous_checkpoint_io_writes_the_file_itself(tmp_path):
    path, io = tmp_path / "last.ckpt", AsyncCheckpointIO(TorchCheckpointIO())
    atomic_save(io, {"weights": torch.ones(3)}, path)  # queued: it writes after this returns
    io.teardown()  # waits for the write
    assert torch.equal(torch.load(path, weights_only=True)["weights"], torch.ones(3))
    assert list(tmp_path.iterdir()) == [path]


def test_a_failed_write_leaves_the_previous_checkpoint_whole(tmp_path):
    path = tmp_path / "last.ckpt"
    atomic_save(TorchCheckpointIO(), {"weights": torch.ones(3)}, path)
    with pytest.raises(Exception):  # noqa: B017 - whatever pickling raises
        atomic_save(TorchCheckpointIO(), {"weights": torch.zeros(3), "unpicklable": lambda: None}, path)
    assert torch.equal(torch.load(path, weights_only=True)["weights"], torch.ones(3))
    assert list(tmp_path.iterdir()) == [path]


def test_a_file_url_is_written_in_place_of_the_path_it_names(tmp_path):
    # As Lightning's TorchCheckpointIO accepts it (trainer.save_checkpoint("file://...")).
    atomic_save(TorchCheckpointIO(), {"weights": torch.ones(3)}, f"file://{tmp_path}/last.ckpt")
    assert torch.equal(torch.load(tmp_path / "last.ckpt", weights_only=True)["weights"], torch.ones(3))
    assert list(tmp_path.iterdir()) == [tmp_path / "last.ckpt"]


def test_a_checkpoint_io_of_the_users_writes_where_it_chooses(tmp_path):
    class SuffixedIO(TorchCheckpointIO):  # a store that names its files itself
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            super().save_checkpoint(checkpoint, f"{path}.v1", storage_options)

    atomic_save(SuffixedIO(), {"weights": torch.ones(3)}, tmp_path / "last.ckpt")
    assert list(tmp_path.iterdir()) == [tmp_path / "last.ckpt.v1"]


def test_storage_options_reach_the_users_checkpoint_io(tmp_path):
    # As under DDP: a store's IO reads them (a cloud bucket's options, a version tag); they were refused.
    class TaggingIO(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            super().save_checkpoint({**checkpoint, "tag": storage_options["tag"]}, path)

    strategy = ElasticPipelineStrategy(profile_steps=0, cache=False)
    trainer = make_trainer([], max_epochs=1, strategy=strategy, plugins=[TaggingIO()])
    trainer.fit(TinySequentialRegressor(seed=0), DataLoader(RandomVectorDataset(size=16), batch_size=4))
    trainer.save_checkpoint(tmp_path / "tagged.ckpt", storage_options={"tag": "v1"})
    assert torch.load(tmp_path / "tagged.ckpt", weights_only=False)["tag"] == "v1"


def test_a_checkpoint_of_another_pipeline_is_refused_in_the_middle_of_a_fit(tmp_path):
    # Loaded while the run goes on (as Lightning's learning-rate finder loads the one it saved), a
    # checkpoint written before blocks froze no longer matches what the ranks hold.
    class LoadsTheFirstCheckpoint(Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            path = tmp_path / "epoch0.ckpt"
            if trainer.current_epoch == 0:
                trainer.save_checkpoint(path)
            trainer.strategy.load_model_state_dict(torch.load(path, weights_only=False))

    strategy = ElasticPipelineStrategy(profile_steps=0, cache=False)
    freeze = FreezeCallback(alpha=0.5, signal="schedule")
    trainer = make_trainer([freeze, LoadsTheFirstCheckpoint()], max_epochs=2, strategy=strategy)
    with pytest.raises(UnsupportedRecipeError, match=r"must be of the running pipeline.*fit\(ckpt_path=...\)"):
        trainer.fit(TinySequentialRegressor(seed=0), DataLoader(RandomVectorDataset(size=16), batch_size=4))
    assert trainer.current_epoch == 1 and freeze.frozen_blocks == 2  # epoch 0 loaded it back


def test_a_learning_rate_finder_in_mid_fit_leaves_its_checkpoint_s_profile_behind(tmp_path):
    # The block costs a finder's checkpoint holds are not the next run's: it measures its own.
    class FindsAtEpoch1(LearningRateFinder):
        def on_fit_start(self, trainer, pl_module):
            pass

        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.current_epoch == 1:
                self.lr_find(trainer, pl_module)

    strategy = ElasticPipelineStrategy(profile_steps=2, cache=False)
    finder = FindsAtEpoch1(num_training_steps=4, early_stop_threshold=None)
    trainer = make_trainer([finder], max_epochs=2, strategy=strategy, default_root_dir=tmp_path)
    module, loader = TinySequentialRegressor(seed=0), DataLoader(RandomVectorDataset(size=16), batch_size=4)
    trainer.fit(module, loader)
    assert finder.optimal_lr is not None
    trainer.validate(module, loader)
    assert not trainer.strategy.autopipe.profiled


def test_a_resume_that_fails_before_set_up_leaves_its_checkpoint_s_profile_behind(tmp_path):
    class ProfiledAtFitStart(Callback):
        def on_fit_start(self, trainer, pl_module):
            self.profiled = trainer.strategy.autopipe.profiled

    saving = ModelCheckpoint(dirpath=tmp_path, filename="profiled")  # in the run: with the measured costs
    strategy = ElasticPipelineStrategy(profile_steps=2, cache=False)
    trainer = make_trainer([saving], max_epochs=1, strategy=strategy, enable_checkpointing=True)
    trainer.fit(TinySequentialRegressor(seed=0), DataLoader(RandomVectorDataset(size=16), batch_size=4))
    assert torch.load(tmp_path / "profiled.ckpt", weights_only=False)["pipetx"]["block_costs"] is not None

    class FailsToLoad(TinySequentialRegressor):
        def on_load_checkpoint(self, checkpoint):
            raise RuntimeError("not this checkpoint")

    seen = ProfiledAtFitStart()
    strategy = ElasticPipelineStrategy(profile_steps=2, cache=False)
    trainer = make_trainer([seen], max_epochs=1, strategy=strategy, default_root_dir=tmp_path)
    loader = DataLoader(RandomVectorDataset(size=16), batch_size=4)
    with pytest.raises(RuntimeError, match="not this checkpoint"):
        trainer.fit(FailsToLoad(seed=0), loader, ckpt_path=tmp_path / "profiled.ckpt")
    trainer.fit(TinySequentialRegressor(seed=0), loader)
    assert seen.profiled is False  # it measures its own


def test_a_second_name_of_the_blocks_holds_their_weights_in_a_checkpoint_written_during_fit(tmp_path):
    # Rank 0 runs the first stage only: the other stage's blocks must reach the file under both names.
    from alias_worker import SecondName

    run_workers("alias_worker.py", 2, str(tmp_path))
    state = torch.load(tmp_path / "step=2.ckpt", weights_only=False)["state_dict"]
    assert any(key.startswith("backbone.") for key in state)
    for key, value in state.items():
        assert torch.isfinite(value).all(), key
        if key.startswith("backbone."):
            torch.testing.assert_close(value, state["model.blocks." + key.removeprefix("backbone.")], msg=key)
    loaded = SecondName.load_from_checkpoint(tmp_path / "step=2.ckpt")
    assert all(torch.isfinite(p).all() for p in loaded.parameters())


class _FailsInConfigureOptimizers(TinySequentialRegressor):
    def configure_optimizers(self):
        raise ValueError("the user's configure_optimizers failed")


class _ManualOptimization(TinySequentialRegressor):
    def __init__(self, seed):
        super().__init__(seed=seed)
        self.automatic_optimization = False


@pytest.mark.parametrize(
    ("module_class", "error", "match"),
    [
        (_FailsInConfigureOptimizers, ValueError, "the user's configure_optimizers failed"),
        (_ManualOptimization, ManualOptimizationError, "manual optimization"),
    ],
)
def test_a_set_up_that_fails_keeps_its_error_and_on_exception_checkpoint_saves_the_model(
    module_class, error, match, tmp_path
):
    # Before the engine is built every rank holds the whole model: the save after the error writes it
    # (it used to fail instead with an error that replaced the set-up's own), and so does
    # trainer.save_checkpoint after fit raised (it used to refuse, calling the model incomplete).
    module = module_class(seed=0)
    saving = OnExceptionCheckpoint(tmp_path)
    trainer = make_trainer(
        [saving], strategy=ElasticPipelineStrategy(), enable_checkpointing=True, default_root_dir=tmp_path
    )
    with pytest.raises(error, match=match):
        trainer.fit(module, DataLoader(RandomVectorDataset(size=16), batch_size=4))
    trainer.save_checkpoint(tmp_path / "after_fit.ckpt", weights_only=True)
    with pytest.raises(RuntimeError, match="its set-up stopped on an error before training began"):
        str(trainer.strategy.layout)
    for file in ("on_exception.ckpt", "after_fit.ckpt"):
        saved = torch.load(tmp_path / file, weights_only=False)
        assert saved["state_dict"].keys() == module.state_dict().keys() and "pipetx" not in saved
        for key, value in module.state_dict().items():
            torch.testing.assert_close(saved["state_dict"][key], value)
