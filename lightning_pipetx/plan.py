"""Dry-run of AutoPipe: print the layouts a model goes through as its blocks freeze.

Builds the model's architecture on the ``meta`` device (no weights are allocated or
downloaded), finds its block list, costs each block by its parameter count, and replays the
closed-form freeze schedule ``F(T) = ceil(L * (1 - (1 - alpha) ** T))`` (capped at
``L - min_active_blocks``) through the same planner the strategy uses::

    python -m lightning_pipetx.plan --model bert-base --devices 8
    python -m lightning_pipetx.plan --model vit_base_patch16_224 --devices 16 --json

The gradient-norm term of the freeze rule can only slow freezing down, so the schedule is
the fastest progression FreezeCallback allows; measured block times (``profile_steps``)
can change the plan of a real run.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_pipetx.blocks import find_blocks
from lightning_pipetx.callbacks.freeze_rule import schedule_frozen
from lightning_pipetx.strategy.autopipe import Plan, block_costs, choose_plan, make_plan
from lightning_pipetx.strategy.dataloading import global_batch_fits
from lightning_pipetx.strategy.topology import divisors

PRESETS = {
    "bert-base": ("BertConfig", {}),
    "bert-large": ("BertConfig", dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)),
    "vit-b16": ("ViTConfig", {}),
    "gpt2": ("GPT2Config", {}),
}
_MAX_DECISIONS = 100_000


def build_model(name: str) -> nn.Module:
    """A preset (transformers config) or a timm model, with weights on the ``meta`` device."""
    with torch.device("meta"):
        if name in PRESETS:
            import transformers

            config_name, overrides = PRESETS[name]
            return transformers.AutoModel.from_config(getattr(transformers, config_name)(**overrides))
        try:
            import timm
        except ImportError:
            timm = None
        if timm is None or not timm.is_model(name):
            where = "a timm model name" if timm is not None else "a timm model name (pip install timm)"
            raise ValueError(f"unknown model {name!r}: use one of {', '.join(PRESETS)} or {where}")
        return timm.create_model(name, pretrained=False)


def freeze_steps(num_blocks: int, alpha: float, min_active_blocks: int) -> list[tuple[int, int]]:
    """``(decision, frozen)`` for each decision that freezes more blocks, up to the cap."""
    cap, frozen, steps = max(0, num_blocks - min_active_blocks), 0, []
    for decision in range(1, _MAX_DECISIONS):
        if frozen >= cap:
            break
        target = min(schedule_frozen(decision, num_blocks, alpha), cap)
        if target > frozen:
            frozen = target
            steps.append((decision, frozen))
    return steps


def plan_dict(plan: Plan, start: Plan) -> dict[str, Any]:
    """A plan as plain data, with its throughput relative to the starting plan."""
    return {
        "layout": str(plan.layout),
        "pipeline_length": plan.layout.pipeline_length,
        "replicas": plan.layout.replicas,
        "num_microbatches": plan.num_microbatches,
        "bounds": [list(b) for b in plan.bounds],
        "blocks_per_stage": [e - s for s, e in plan.bounds],
        "stage_costs": list(plan.stage_times),
        "predicted_throughput": plan.predicted_throughput,
        "relative_throughput": plan.predicted_throughput / start.predicted_throughput,
    }


def change(before: Plan, after: Plan) -> str:
    """What moving from ``before`` to ``after`` takes."""
    if before.layout != after.layout:
        return "transition"
    return "repartition" if before.bounds != after.bounds else "none"


def dry_run(
    model: str,
    devices: int,
    pipeline_length: int | None = None,
    alpha: float = 1 / 3,
    min_active_blocks: int = 1,
    microbatches: int | None = None,
    batch_size: int | None = None,
) -> dict[str, Any]:
    """The initial plan and the plan after each freeze step, as plain data."""
    split = find_blocks(build_model(model))
    costs, num_blocks = block_costs(split), split.num_blocks
    if pipeline_length is None:
        pipeline_length = max(k for k in divisors(devices) if k <= num_blocks)
    accept = None
    if batch_size is not None:  # keep_global_batch: the global batch must split over the replicas
        batch0 = (batch_size, devices // pipeline_length)
        accept = lambda layout: global_batch_fits(batch0, layout.replicas)  # noqa: E731
    start = make_plan(costs, 0, devices, pipeline_length, microbatches)
    steps, previous = [], start
    for decision, frozen in freeze_steps(num_blocks, alpha, min_active_blocks):
        plan = choose_plan(costs, frozen, devices, pipeline_length, microbatches, accept)
        steps.append({"decision": decision, "frozen": frozen, "change": change(previous, plan), **plan_dict(plan, start)})
        previous = plan
    return {
        "model": model,
        "model_class": type(split.root).__name__,
        "blocks_path": split.path,
        "num_blocks": num_blocks,
        "block_costs": costs,
        "devices": devices,
        "alpha": alpha,
        "min_active_blocks": min_active_blocks,
        "initial": plan_dict(start, start),
        "steps": steps,
        "transitions": sum(step["change"] == "transition" for step in steps),
    }


def _stages(plan: dict[str, Any]) -> str:
    ranges = " | ".join(f"{s}-{e - 1}" if e - s > 1 else f"{s}" for s, e in plan["bounds"])
    costs = ", ".join(f"{c / 1e6:.1f}" for c in plan["stage_costs"])
    return f"blocks [{ranges}] ({plan['blocks_per_stage']}), stage costs [{costs}] M"


def format_report(result: dict[str, Any]) -> str:
    """The dry run as readable text."""
    initial = result["initial"]
    lines = [
        f"model {result['model']} ({result['model_class']}): {result['num_blocks']} blocks at {result['blocks_path']!r}, "
        f"{sum(result['block_costs']) / 1e6:.1f} M parameters in blocks",
        f"{result['devices']} devices, alpha={result['alpha']:.3g}, min_active_blocks={result['min_active_blocks']}; "
        f"costs are parameter counts (a frozen block counts a third), layout = pipeline_length x replicas",
        f"start     frozen  0: layout {initial['layout']}, {initial['num_microbatches']} micro-batches, {_stages(initial)}",
    ]
    for step in result["steps"]:
        note = {"transition": "transition", "repartition": "re-partition, same layout", "none": "no change"}
        lines.append(
            f"decision {step['decision']} frozen {step['frozen']:2d}: layout {step['layout']}, "
            f"{step['num_microbatches']} micro-batches, {_stages(step)}, "
            f"throughput x{step['relative_throughput']:.2f} [{note[step['change']]}]"
        )
    count = result["transitions"]
    lines.append(f"{count} layout transition{'s' if count != 1 else ''}" if count else "no layout transition")
    return "\n".join(lines)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m lightning_pipetx.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help=f"one of {', '.join(PRESETS)}, or a timm model name")
    parser.add_argument("--devices", type=_positive, required=True, help="world size N")
    parser.add_argument(
        "--pipeline-length", type=_positive, help="initial stages K0 (default: largest divisor of N <= blocks)"
    )
    parser.add_argument("--alpha", type=float, default=1 / 3, help="freeze progression bound, in (0, 1]")
    parser.add_argument("--min-active-blocks", type=int, default=1, help="blocks that never freeze")
    parser.add_argument("--microbatches", type=_positive, help="micro-batches (default: 1 for K=1, else 2K)")
    parser.add_argument("--batch-size", type=_positive, help="per-replica batch at the start; rules out uneven splits")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    args = parser.parse_args(argv)
    if not 0 < args.alpha <= 1:
        parser.error(f"--alpha must be in (0, 1], got {args.alpha}")
    if args.pipeline_length is not None and args.devices % args.pipeline_length:
        parser.error(f"--pipeline-length {args.pipeline_length} does not divide --devices {args.devices}")
    if args.min_active_blocks < 0:
        parser.error("--min-active-blocks must be >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = dry_run(
            args.model,
            args.devices,
            args.pipeline_length,
            args.alpha,
            args.min_active_blocks,
            args.microbatches,
            args.batch_size,
        )
    except ValueError as error:  # unknown model, no block list, too many stages
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else format_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
