"""The arguments of :class:`~lightning_pipetx.ElasticPipelineStrategy`, checked when it is built
(each error names the argument and what it accepts)."""

from __future__ import annotations

import difflib
import inspect
import math
import numbers
from collections.abc import Iterable
from typing import Any

from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel

from lightning_pipetx.strategy.stage_runner import SCHEDULES

SAMPLERS = ("auto", "distributed", "stable")


def _error(name: str, value: Any, accepted: str) -> ValueError:
    return ValueError(f"ElasticPipelineStrategy({name}={value!r}): {accepted}.")


def _whole(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def bool_or_auto(value: Any) -> bool:
    """Whether ``value`` is True, False or ``"auto"`` (not 0 or 1, which equal False and True)."""
    return isinstance(value, bool) or (isinstance(value, str) and value == "auto")


def byte_count(value: Any) -> int | None:
    """``value`` as a number of bytes >= 0 (an integer, numpy's too, or a whole float such as
    ``16e9``); None where it is none (True and False are not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0:
        return None
    return int(value) if float(value).is_integer() else None


def check_arguments(
    pipeline_length: Any,
    num_microbatches: Any,
    schedule: Any,
    profile_steps: Any,
    sampler: Any,
    memory_budget: Any,
    bucket_cap_mb: Any,
    reuse_host_memory: Any,
    split_backward: Any,
    blocks: Any = None,
    elastic: Any = True,
    keep_global_batch: Any = True,
) -> None:
    """Raise a ``ValueError`` for the first argument the strategy cannot run with."""
    for name, value in (("pipeline_length", pipeline_length), ("num_microbatches", num_microbatches)):
        if value != "auto" and (not _whole(value) or value < 1):
            raise _error(name, value, "use 'auto' or a whole number >= 1")
    if schedule not in SCHEDULES:
        raise _error("schedule", schedule, f"choose one of {SCHEDULES}")
    if not _whole(profile_steps) or profile_steps < 0:
        raise _error("profile_steps", profile_steps, "use a whole number >= 0")
    if sampler not in SAMPLERS:
        raise _error("sampler", sampler, f"choose one of {SAMPLERS}")
    if memory_budget is not None and (byte_count(memory_budget) is None or memory_budget <= 0):
        raise _error("memory_budget", memory_budget, "use a number of bytes > 0")
    if (
        isinstance(bucket_cap_mb, bool)
        or not isinstance(bucket_cap_mb, numbers.Real)
        or not 0 < bucket_cap_mb < math.inf
    ):
        raise _error("bucket_cap_mb", bucket_cap_mb, "use a size in MB > 0")
    if not bool_or_auto(reuse_host_memory):
        raise _error("reuse_host_memory", reuse_host_memory, "use True, False or 'auto'")
    for name, value in (
        ("split_backward", split_backward),
        ("elastic", elastic),
        ("keep_global_batch", keep_global_batch),
    ):
        if not isinstance(value, bool):
            raise _error(name, value, "use True or False")
    if blocks is not None and not (isinstance(blocks, str) and blocks):
        raise _error("blocks", blocks, "use the block list's dotted path (a string), or None to find it")


_GRADIENT_REDUCTION = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")


def check_ddp_arguments(kwargs: dict[str, Any], own: Iterable[inspect.Parameter]) -> None:
    """Refuse DDPStrategy's arguments that change how gradients are reduced, and a name neither
    the strategy (``own``: its parameters), DDPStrategy nor ``DistributedDataParallel`` takes; warn that those
    meant for ``DistributedDataParallel`` have no effect, where they differ from its defaults (a
    LightningCLI config lists them all): the strategy reduces gradients itself."""
    given = [name for name in _GRADIENT_REDUCTION if kwargs.get(name) is not None]
    if given:
        raise ValueError(
            f"ElasticPipelineStrategy({given[0]}=...): the strategy reduces gradients itself, exactly as "
            "one process would, not through DistributedDataParallel: a communication hook or model "
            "averaging does not apply. Remove it, or train with DDPStrategy."
        )
    named = set(_keywords(inspect.signature(DDPStrategy.__init__).parameters.values()))
    ddp_defaults = {
        name: parameter.default
        for name, parameter in inspect.signature(DistributedDataParallel.__init__).parameters.items()
        if parameter.default is not inspect.Parameter.empty
    }
    unknown = sorted(name for name in kwargs if name not in named and name not in ddp_defaults)
    if unknown:
        close = difflib.get_close_matches(unknown[0], [*_keywords(own), *named, *ddp_defaults], n=1)
        raise TypeError(
            f"ElasticPipelineStrategy got an unexpected keyword argument {unknown[0]!r}"
            + (f": did you mean {close[0]!r}?" if close else ".")
        )
    ignored = sorted(name for name in kwargs if name not in named and not _is_default(kwargs[name], ddp_defaults[name]))
    if ignored:
        rank_zero_warn(
            "ElasticPipelineStrategy does not wrap the model in DistributedDataParallel: "
            f"{', '.join(ignored)} {'has' if len(ignored) == 1 else 'have'} no effect. A weight outside the "
            "block list that some steps leave unused is found at a layout's first step, or the run stops "
            "with an error naming it (see the README's Limitations)."
        )


def _keywords(parameters: Iterable[inspect.Parameter]) -> list[str]:
    """The names of ``parameters`` (of an ``__init__``) a caller may pass by keyword."""
    return [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"]


def _is_default(value: Any, default: Any) -> bool:
    return value is default or (
        type(value) is type(default) and isinstance(value, (bool, int, float, str)) and value == default
    )
