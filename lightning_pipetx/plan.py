"""Dry-run of AutoPipe: print the layouts a model goes through as its blocks freeze.

Builds the model's architecture on the ``meta`` device (no weights are allocated or
downloaded), finds its block list, costs each block by its parameter count, picks the initial
pipeline length as ``pipeline_length="auto"`` does (the layout predicted fastest whose
stages' training state fits in half of ``--memory-gb``, each pipeline inside one of
``--num-nodes`` nodes; it says why), and replays the
closed-form freeze schedule ``F(T) = ceil(L * (1 - (1 - alpha) ** T))`` (capped at
``L - min_active_blocks``) through the same planner the strategy uses (``--cached``: the
frozen prefix costs nothing, as with AutoCache; otherwise a third of its blocks)::

    python -m lightning_pipetx.plan --model bert-base --devices 8
    python -m lightning_pipetx.plan --model vit_base_patch16_224 --devices 16 --json

The gradient-norm term of the freeze rule can only slow freezing down, so the schedule is
the fastest progression FreezeCallback allows; measured block times (``profile_steps``)
can change the plan of a real run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_pipetx.blocks import find_blocks
from lightning_pipetx.callbacks.freeze_rule import schedule_frozen
from lightning_pipetx.strategy.autopipe import (
    ACTIVATION_SHARE,
    FROZEN_TIME,
    ModelMemory,
    Plan,
    block_costs,
    buildable_lengths,
    choose_initial_plan,
    choose_plan,
    device_fit,
    explain_choice,
    frozen_in_place,
    kept_reason,
    make_plan,
    transition_limit,
)
from lightning_pipetx.strategy.dataloading import global_batch_fits

_BERT_LARGE = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)
PRESETS = {"bert-base": ("BertConfig", {}), "bert-large": ("BertConfig", _BERT_LARGE)}
PRESETS.update({"vit-b16": ("ViTConfig", {}), "gpt2": ("GPT2Config", {})})
_NOTES = {"transition": "transition", "repartition": "re-partition, same layout", "none": "same layout and stages"}
_NOTES["kept"] = "no layout left: frozen in place"


def build_model(name: str) -> nn.Module:
    """A preset (transformers config) or a timm model, with weights on the ``meta`` device."""
    unknown = f"unknown model {name!r}: use one of {', '.join(PRESETS)} or a timm model name"
    with torch.device("meta"):
        if name in PRESETS:
            import transformers

            config_name, overrides = PRESETS[name]
            return transformers.AutoModel.from_config(getattr(transformers, config_name)(**overrides))
        try:
            import timm
        except ImportError as error:
            raise ValueError(f"{unknown} (pip install timm)") from error
        if not timm.is_model(name):
            raise ValueError(unknown)
        return timm.create_model(name, pretrained=False)


def freeze_steps(num_blocks: int, alpha: float, min_active_blocks: int) -> list[tuple[int, int]]:
    """``(decision, frozen)`` for each decision of the schedule that freezes more blocks, up to the cap."""
    cap, steps, frozen, decision = num_blocks - min_active_blocks, [], 0, 0
    while frozen < cap:
        decision += 1
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
    return "transition" if before.layout != after.layout else "repartition" if before.bounds != after.bounds else "none"


def dry_run(
    model: str,
    devices: int,
    pipeline_length: int | None = None,
    alpha: float = 1 / 3,
    min_active_blocks: int = 1,
    microbatches: int | None = None,
    batch_size: int | None = None,
    cached: bool = False,
    memory_gb: float | None = None,
    num_nodes: int = 1,
) -> dict[str, Any]:
    """The initial plan and the plan after each freeze step, as plain data.

    ``pipeline_length=None`` chooses it as ``pipeline_length="auto"`` would, for devices of
    ``memory_gb`` (by default this machine's GPU, or 16 GiB): at most the devices of one of
    ``num_nodes`` nodes, and the number of blocks.
    """
    split = find_blocks(build_model(model))
    costs, num_blocks = block_costs(split), split.num_blocks
    budget = (memory_gb if memory_gb is not None else default_memory_gb()) * 2**30
    max_length = min(devices // num_nodes, num_blocks)
    memory = ModelMemory.of(split)
    chosen, candidates = choose_initial_plan(costs, memory, devices, max_length, budget, microbatches)
    choice = {
        "auto": pipeline_length is None,
        "memory_budget_gb": budget / 2**30,
        "activation_share": ACTIVATION_SHARE,
        "reason": explain_choice(chosen, candidates, budget) if pipeline_length is None else "given",
        "candidates": [
            {
                "layout": str(c.plan.layout),
                "peak_gb": c.peak_bytes / 2**30,
                "fits": c.fits,
                "relative_throughput": c.plan.predicted_throughput / chosen.predicted_throughput,
            }
            for c in candidates
        ],
    }
    if pipeline_length is None:
        pipeline_length = chosen.layout.pipeline_length
    accept = None
    if batch_size is not None:  # keep_global_batch: the global batch must split over the replicas
        batch0 = (batch_size, devices // pipeline_length)
        accept = lambda layout: global_batch_fits(batch0, layout.replicas)  # noqa: E731
    start, frozen_time = make_plan(costs, 0, devices, pipeline_length, microbatches), 0.0 if cached else FROZEN_TIME
    limit = transition_limit(memory, budget, start)
    steps, previous = [], start
    for decision, frozen in freeze_steps(num_blocks, alpha, min_active_blocks):
        fits = device_fit(memory, frozen, limit)
        plan = choose_plan(costs, frozen, devices, pipeline_length, microbatches, accept, frozen_time, fits=fits)
        row = {"decision": decision, "frozen": frozen}
        if plan is None:  # no layout is left: the blocks freeze in place, as the strategy does
            plan = frozen_in_place(previous, costs, frozen, frozen_time)
            by_memory = bool(buildable_lengths(num_blocks, frozen, devices, pipeline_length, accept))
            row.update(change="kept", reason=kept_reason(num_blocks, frozen, pipeline_length, by_memory))
        else:
            row["change"] = change(previous, plan)
        steps.append({**row, **plan_dict(plan, start)})
        previous = plan
    return {
        "model": model,
        "model_class": type(split.root).__name__,
        "blocks_path": split.path,
        "num_blocks": num_blocks,
        "block_costs": costs,
        "devices": devices,
        "num_nodes": num_nodes,
        "alpha": alpha,
        "min_active_blocks": min_active_blocks,
        "cached": cached,
        "initial": plan_dict(start, start),
        "initial_choice": choice,
        "steps": steps,
        "transitions": sum(step["change"] == "transition" for step in steps),
    }


def default_memory_gb() -> float:
    """This machine's GPU memory in GiB, or 16 without a GPU."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / 2**30
    return 16.0


def _stages(plan: dict[str, Any]) -> str:
    ranges = " | ".join(f"{s}-{e - 1}" if e - s > 1 else f"{s}" for s, e in plan["bounds"])
    costs = ", ".join(f"{c / 1e6:.1f}" for c in plan["stage_costs"])
    return f"blocks [{ranges}] ({plan['blocks_per_stage']}), stage costs [{costs}] M"


def _choice_line(result: dict[str, Any]) -> str:
    if result["initial_choice"]["auto"]:
        return f"pipeline_length auto: {result['initial_choice']['reason']}"
    return f"pipeline_length {result['initial']['pipeline_length']} (given)"


def format_report(result: dict[str, Any]) -> str:
    """The dry run as readable text."""
    initial = result["initial"]
    lines = [
        f"model {result['model']} ({result['model_class']}): {result['num_blocks']} blocks at {result['blocks_path']!r}, "
        f"{sum(result['block_costs']) / 1e6:.1f} M parameters in blocks",
        f"{result['devices']} devices, alpha={result['alpha']:.3g}, min_active_blocks={result['min_active_blocks']}; "
        f"costs are parameter counts (a frozen block counts {'nothing: cached' if result['cached'] else 'a third'}), "
        "layout = pipeline_length x replicas",
        _choice_line(result),
        f"start     frozen  0: layout {initial['layout']}, {initial['num_microbatches']} micro-batches, {_stages(initial)}",
    ]
    for step in result["steps"]:
        lines.append(
            f"decision {step['decision']} frozen {step['frozen']:2d}: layout {step['layout']}, "
            f"{step['num_microbatches']} micro-batches, {_stages(step)}, "
            f"throughput x{step['relative_throughput']:.2f} [{_NOTES[step['change']]}]"
        )
        if "reason" in step:
            lines.append(f"  {step['reason']}")
    count = result["transitions"]
    lines.append(f"{count} layout transition{'s' if count != 1 else ''}" if count else "no layout transition")
    return "\n".join(lines)


def _positive(text: str) -> int:
    if int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text}")
    return int(text)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m lightning_pipetx.plan", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--model", required=True, help=f"one of {', '.join(PRESETS)}, or a timm model name")
    add("--devices", type=_positive, required=True, help="world size N")
    add("--pipeline-length", type=_positive, help="initial stages K0 (default: chosen as pipeline_length='auto')")
    add("--memory-gb", type=float, help="memory per device for the automatic choice (default: this GPU's, or 16)")
    add(
        "--num-nodes",
        type=_positive,
        default=1,
        help="nodes the devices span (a pipeline the planner picks stays in one)",
    )
    add("--alpha", type=float, default=1 / 3, help="freeze progression bound, in [0.001, 1]")
    add("--min-active-blocks", type=_positive, default=1, help="blocks that never freeze")
    add("--microbatches", type=_positive, help="micro-batches (default: 1 for K=1, else 2K)")
    add("--batch-size", type=_positive, help="per-replica batch at the start; rules out uneven splits")
    add("--cached", action="store_true", help="cost the frozen prefix as cached by AutoCache (free)")
    add("--json", action="store_true", help="print machine-readable JSON")
    args = parser.parse_args(argv)
    if args.memory_gb is not None and not 0 < args.memory_gb < math.inf:
        parser.error(f"--memory-gb must be a number > 0, got {args.memory_gb}")
    if not 0.001 <= args.alpha <= 1:
        parser.error(f"--alpha must be in [0.001, 1], got {args.alpha}")
    if args.devices % args.num_nodes:
        parser.error(f"--num-nodes {args.num_nodes} does not divide --devices {args.devices}")
    if args.pipeline_length is not None and args.devices % args.pipeline_length:
        parser.error(f"--pipeline-length {args.pipeline_length} does not divide --devices {args.devices}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    options = vars(parse_args(argv))
    as_json = options.pop("json")
    try:
        result = dry_run(**options)
    except ValueError as error:  # unknown model, no block list, too many stages
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1) if as_json else format_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
