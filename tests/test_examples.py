"""The LightningCLI example, run as a user would: in a subprocess, from another directory.

The commands are started together (module fixture) and each test waits for its own, so the
interpreter start-ups (torch, lightning, timm: several seconds each) overlap.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("timm")
pytest.importorskip("jsonargparse")
yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "image_classification.py"
DEMO_CONFIG = REPO / "examples" / "configs" / "demo.yaml"
TIMEOUT_S = 300

# A 2-block ViT of width 32 on 64 synthetic images: one fast_dev_run step takes well under a second.
SMALL = [
    "--trainer.fast_dev_run=true",
    "--trainer.accelerator=cpu",
    "--trainer.devices=1",
    "--trainer.enable_progress_bar=false",
    "--model.depth=2",
    "--model.embed_dim=32",
    "--model.num_heads=2",
    "--data.data=synthetic",
    "--data.num_samples=64",
    "--data.batch_size=8",
]


class Command:
    """One run of the example, started at once; ``result()`` waits for it."""

    def __init__(self, args: list[str], cwd: Path) -> None:
        env = dict(os.environ)
        env["OMP_NUM_THREADS"] = "1"
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
        env.setdefault("HF_HUB_OFFLINE", "1")
        self.args = args
        self.process = subprocess.Popen(
            [sys.executable, str(EXAMPLE), *args],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._result: tuple[int, str, str] | None = None

    def result(self) -> tuple[int, str, str]:
        if self._result is None:
            try:
                out, err = self.process.communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                out, err = self.process.communicate()
                pytest.fail(f"example {self.args} ran over {TIMEOUT_S} s:\n{out[-3000:]}\n{err[-3000:]}")
            self._result = (self.process.returncode, out, err)
        return self._result

    def succeeded(self) -> tuple[str, str]:
        code, out, err = self.result()
        assert code == 0, f"example {self.args} exited with {code}:\n{out[-3000:]}\n{err[-5000:]}"
        return out, err


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("example_cwd")
    report_dir = cwd / "report"
    commands = {
        "help": Command(["fit", "--help"], cwd),
        "print_config": Command(["fit", "--config", str(DEMO_CONFIG), "--print_config"], cwd),
        "freeze": Command(
            [
                "fit",
                *SMALL,
                f"--trainer.default_root_dir={cwd / 'freeze'}",
                "--trainer.callbacks+=lightning_pipetx.FreezeCallback",
                "--trainer.callbacks+=lightning_pipetx.EpochReport",
                f"--trainer.callbacks.output_dir={report_dir}",
            ],
            cwd,
        ),
        "elastic": Command(
            [
                "fit",
                *SMALL,
                f"--trainer.default_root_dir={cwd / 'elastic'}",
                # `--trainer.strategy=lightning_pipetx.ElasticPipelineStrategy` does not work: the
                # Trainer's `strategy: str | Strategy` takes any string as a registered name.
                "--trainer.strategy.class_path=lightning_pipetx.ElasticPipelineStrategy",
                "--trainer.callbacks+=lightning_pipetx.FreezeCallback",
            ],
            cwd,
        ),
    }
    yield commands, cwd, report_dir
    for command in commands.values():
        if command.process.poll() is None:
            command.process.kill()
            command.process.communicate()


def test_help_lists_trainer_model_and_data_options(runs):
    commands, _, _ = runs
    out, _ = commands["help"].succeeded()
    for option in (
        "--trainer.max_epochs",
        "--trainer.callbacks",
        "--trainer.strategy",
        "--model.depth",
        "--model.embed_dim",
        "--data.data",
        "--data.batch_size",
        "--data.num_samples",
    ):
        assert option in out, f"{option} missing from `fit --help`"


def test_demo_config_parses(runs):
    commands, cwd, _ = runs
    out, _ = commands["print_config"].succeeded()
    config = yaml.safe_load(out)
    callbacks = config["trainer"]["callbacks"]
    assert [c["class_path"] for c in callbacks] == [
        "lightning_pipetx.FreezeCallback",
        "lightning_pipetx.callbacks.report.EpochReport",
    ]
    assert callbacks[0]["init_args"]["alpha"] == pytest.approx(1 / 3)
    assert callbacks[1]["init_args"]["output_dir"] == "results/demo_vit"
    assert config["trainer"]["max_epochs"] == 6
    assert config["model"]["depth"] == 6
    assert config["data"]["data"] == "digits"
    assert config["data"]["train_repeats"] == 4
    assert not (cwd / "results").exists()  # --print_config exits before anything runs


def test_fast_dev_run_with_freeze_callback(runs):
    commands, _, report_dir = runs
    out, err = commands["freeze"].succeeded()
    # The callback found the 2 ViT blocks and took its decision after the single epoch.
    assert "pipetx: epoch 0: frozen blocks 0 -> 1 of 2" in out + err
    timeline = json.loads((report_dir / "timeline.json").read_text())
    assert timeline["monitor"] == "val_acc"
    [epoch] = timeline["epochs"]
    assert epoch["epoch"] == 0
    assert epoch["frozen_blocks"] == 0
    assert epoch["samples_per_sec"] > 0
    assert epoch["val_acc"] is not None and 0.0 <= epoch["val_acc"] <= 1.0
    assert (report_dir / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fast_dev_run_with_elastic_pipeline_strategy_on_one_device(runs):
    commands, _, _ = runs
    out, err = commands["elastic"].succeeded()
    text = out + err
    # The strategy planned a single-device layout (1 stage x 1 replica) ...
    assert "pipetx: layout 1x1" in text
    # ... and kept it when the FreezeCallback froze the first block: one device has no other layout.
    assert "pipetx: epoch 0: frozen blocks 0 -> 1 of 2" in text
    assert "pipetx: frozen 0->1 blocks" not in text
    # jsonargparse passes every DistributedDataParallel argument at its default: none is set, none named
    assert "does not wrap the model in DistributedDataParallel" not in text
