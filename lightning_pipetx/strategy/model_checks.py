"""Refuse what a model cannot compute exactly while a rank skips some of its blocks.

Under a pipeline (or when AutoCache skips the frozen prefix), a rank runs only some blocks:
what a model collects *across* blocks (hidden states or attentions of every layer, the
router logits of a mixture of experts, timm's ``forward_intermediates``) would silently miss
the blocks it skipped. The checks below watch for those requests on every call: Hugging Face
models through a forward pre-hook (flags in the call or in the config), timm models through
their ``forward_intermediates``. What the caller does about it (raise, or switch the cache off)
is decided by ``on_request(model_name, what)``. A module that optimizes manually is refused at
set-up: the strategy runs each training step's backwards itself.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipetx.strategy.installed import InstalledForward, InstalledHook

log = logging.getLogger("lightning_pipetx")

COLLECTED_OUTPUTS = ("output_hidden_states", "output_attentions", "output_router_logits")
# XLNet returns every block's input as memory for the next segment (mems) where ``use_mems`` is
# passed, else where its config's switch for the module's mode is on (in evaluation by default).
MEMORY_SWITCHES = {True: "use_mems_train", False: "use_mems_eval"}
# Speech classifiers (wav2vec2's, HuBERT's) read every layer's hidden state only under this switch,
# though their forward asks the inner model for them in every call (see _forces_hidden_states).
LAYER_SUM_SWITCH = "use_weighted_layer_sum"
# The config switch of a model that masks its input at random in training before the blocks and uses
# the mask after them too (ViT-MAE's ids_restore, in its decoder and loss), and the forward argument
# that gives the mask's noise instead. wav2vec2's time and feature masks are not checked: they change
# block 0's input only, which exists on the first stage alone.
RANDOM_MASK_SWITCH, RANDOM_MASK_NOISE = "mask_ratio", "noise"


class ManualOptimizationError(ValueError):
    """A LightningModule with ``automatic_optimization = False`` under the strategy."""


def refuse_manual_optimization(module: Any) -> None:
    """The strategy runs each training step's forwards and backwards itself: a module that
    calls ``manual_backward`` cannot run under it."""
    if not module.automatic_optimization:
        raise ManualOptimizationError(
            "ElasticPipelineStrategy runs each training step's forward and backward itself (micro-batches "
            "through the stages), so manual optimization (automatic_optimization = False, manual_backward) "
            "cannot run under it. Use automatic optimization, or Lightning's DDPStrategy for this module."
        )


class UnsupportedRecipeError(ValueError):
    """A Trainer or module option that the strategy would run differently from Lightning's DDP."""


def batch_norm_names(module: nn.Module, training_only: bool = False) -> list[str]:
    """Batch norms of ``module``; ``training_only``: those in training mode (each normalizes its
    batch by the batch's statistics)."""
    return [
        name
        for name, m in module.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and (m.training or not training_only)
    ]


def microbatches_for_training(num_microbatches: int | str, module: nn.Module) -> int | str:
    """``num_microbatches`` for fit: ``"auto"`` is 1 for a model with batch norms, which in
    training normalize each micro-batch by its own statistics (other gradients than one
    process's); more than 1, asked for, is kept with a warning (exact for batch norms in eval mode)."""
    norms = batch_norm_names(module)
    if not norms or num_microbatches == 1:
        return num_microbatches
    if num_microbatches == "auto":
        return 1
    log.warning(
        "pipetx: num_microbatches=%s with batch norms (%s, ...): in training a batch norm normalizes each "
        "micro-batch by its own statistics, so its gradients differ from one process's (exact for batch norms "
        "in eval mode). num_microbatches=1 (or 'auto') trains on whole batches.",
        num_microbatches,
        norms[0],
    )
    return num_microbatches


def refuse_unconverted_batch_norms(module: nn.Module, layer_sync: Any) -> None:
    """Refuse ``Trainer(sync_batchnorm=True)`` for a model with batch norms: the strategy does not
    convert them."""
    batch_norms = batch_norm_names(module)
    if layer_sync is not None and batch_norms:
        raise UnsupportedRecipeError(
            f"Trainer(sync_batchnorm=True): ElasticPipelineStrategy does not sync batch norms ({batch_norms[0]}, "
            f"...) over its replicas. Pass sync_batchnorm=False (each replica normalizes its own batch), or use "
            f"Lightning's DDPStrategy."
        )


class UnsupportedOutputsError(ValueError):
    """A model was asked for per-block outputs that a rank skipping blocks cannot give."""


def _is_hf_model(module: nn.Module) -> bool:
    config = getattr(module, "config", None)
    return config is not None and hasattr(config, "to_dict") and hasattr(module, "can_generate")


def refuse_shared_block_weights(root: nn.Module, path: str, blocks: nn.Module, pipeline_length: int) -> None:
    """Refuse, under a pipeline, a weight that a block of ``blocks`` (at ``path`` in ``root``)
    shares with another block or with the rest of the model (tied to a head): each rank releases
    the blocks it does not run, and such a weight with them."""
    if pipeline_length <= 1:
        return
    owner: dict[int, int] = {}
    for index, block in enumerate(blocks):
        for name, param in block.named_parameters():
            if owner.setdefault(id(param), index) != index:
                _refuse_shared(f"{path}.{index}.{name}", f"block {owner[id(param)]}", pipeline_length)
    in_blocks = {id(module) for block in blocks for module in block.modules()}
    for module_name, module in root.named_modules():  # each module once, under its first name
        if id(module) in in_blocks:
            continue
        for name, param in module.named_parameters(recurse=False):
            if id(param) in owner:
                _refuse_shared(f"{module_name}.{name}", f"block {owner[id(param)]} of {path!r}", pipeline_length)


def _refuse_shared(name: str, other: str, pipeline_length: int) -> None:
    raise UnsupportedRecipeError(
        f"the weight {name!r} is shared with {other}: under a {pipeline_length}-stage pipeline each rank releases the "
        f"blocks it does not run, and a weight they share with it. Untie the weights (or use one module per "
        f"block), or pass ElasticPipelineStrategy(pipeline_length=1)."
    )


def _models_holding(root: nn.Module, blocks: nn.Module) -> list[nn.Module]:
    """The Hugging Face models inside ``root`` whose modules include ``blocks`` (not a teacher's),
    one per config (a composite model nests its parts' configs)."""
    models, configs = [], set()
    for m in root.modules():
        if _is_hf_model(m) and id(m.config) not in configs and any(child is blocks for child in m.modules()):
            configs.add(id(m.config))
            models.append(m)
    return models


def block_dropping(root: nn.Module, blocks: nn.Module) -> list[tuple[str, str, float]]:
    """``(model class, config field, probability)`` of the Hugging Face model holding ``blocks``
    when it drops whole blocks at random in training (``layerdrop``, ``encoder_layerdrop``, ...:
    Wav2Vec2, HuBERT, BART)."""
    found = []
    for model in _models_holding(root, blocks):
        for key, value in model.config.to_dict().items():
            if key.endswith("layerdrop") and isinstance(value, (int, float)) and value > 0:
                found.append((type(model).__name__, key, float(value)))
    return found


def refuse_shared_layers(root: nn.Module, blocks: nn.Module, pipeline_length: int) -> None:
    """Refuse, under a pipeline, ALBERT whose layers share the weights of fewer layer groups: each
    block would run more than once per call."""
    for model in _models_holding(root, blocks):
        groups, layers = getattr(model.config, "num_hidden_groups", None), getattr(model.config, "num_hidden_layers", 0)
        if pipeline_length > 1 and groups is not None and groups < layers:
            raise UnsupportedRecipeError(
                f"{type(model).__name__} with num_hidden_groups={groups} for {layers} layers under a "
                f"{pipeline_length}-stage pipeline: its layers share weights, so a block runs more than once per "
                f"call. Pass ElasticPipelineStrategy(pipeline_length=1)."
            )


def refuse_random_input_mask(model: str, switch: str, pipeline_length: int) -> None:
    """Refuse a model that masks its input at random before the blocks, under a pipeline: each
    stage draws the mask from its own random numbers, and the stages after the first use it too
    (ViT-MAE's ``ids_restore`` in its decoder and loss)."""
    raise UnsupportedRecipeError(
        f"{model}.config.{switch} under a {pipeline_length}-stage pipeline: the model masks its input at random "
        f"in training, and each stage would draw its own mask from its own random numbers. Either pass "
        f"{RANDOM_MASK_NOISE}= from the batch (the same on every stage), set model.config.{RANDOM_MASK_SWITCH} = 0, "
        f"or pass ElasticPipelineStrategy(pipeline_length=1)."
    )


def refuse_block_dropping(settings: list[tuple[str, str, float]], pipeline_length: int) -> None:
    """Refuse a model that drops whole blocks at random under a pipeline: each stage would draw
    its own skips, and a stage whose last blocks are skipped never reaches its boundary."""
    if settings and pipeline_length > 1:
        model, key, value = settings[0]
        raise UnsupportedRecipeError(
            f"{model}.config.{key}={value:g} under a {pipeline_length}-stage pipeline: the model skips whole "
            f"blocks at random in training, and the stages cannot agree on which. Set model.config.{key} = 0.0, "
            f"or pass ElasticPipelineStrategy(pipeline_length=1)."
        )


def random_input_mask(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> str | None:
    """The config switch (``"mask_ratio=0.75"``) under which the Hugging Face model ``module``
    draws a random mask of its input in this call, or None."""
    value = getattr(module.config, RANDOM_MASK_SWITCH, 0)
    if not module.training or not isinstance(value, (int, float)) or value <= 0:
        return None
    try:  # the class's forward: the instance's may be wrapped (the output relay's, under a pipeline)
        arguments = inspect.signature(type(module).forward).bind_partial(module, *args, **kwargs).arguments
    except TypeError:
        arguments = kwargs
    return None if arguments.get(RANDOM_MASK_NOISE) is not None else f"{RANDOM_MASK_SWITCH}={value:g}"


def _memory_asked_for(module: nn.Module, kwargs: dict[str, Any]) -> str | None:
    """The switch that makes ``module`` return each block's input as memory (XLNet's mems), if on."""
    asked = kwargs.get("use_mems")
    if asked is not None:
        return "use_mems" if asked else None
    switch = MEMORY_SWITCHES[module.training]
    return switch if getattr(module.config, switch, False) else None


def _filtering_code() -> Any:
    """The code of transformers' ``filter_output_hidden_states`` wrapper (None until it is imported)."""
    wrap = getattr(sys.modules.get("transformers.backbone_utils"), "filter_output_hidden_states", None)
    return None if wrap is None else _wrapper_code(wrap)


@functools.cache
def _wrapper_code(wrap: Callable) -> Any:
    return wrap(lambda self: None).__code__


def _forces_hidden_states(module: nn.Module) -> bool:
    """Whether ``module``'s forward is wrapped by transformers' ``filter_output_hidden_states``
    (it asks its inner model for every layer's hidden state whatever its caller asked, and drops
    them unless asked) and reads them only under :data:`LAYER_SUM_SWITCH` (a speech classifier).
    A backbone wrapped so builds its feature maps from them: not this."""
    if not hasattr(module.config, LAYER_SUM_SWITCH):
        return False
    code = _filtering_code()
    if code is None:
        return False
    forward = type(module).forward
    while forward is not None:
        if getattr(forward, "__code__", None) is code:  # wraps() gives it the forward's names
            return True
        forward = getattr(forward, "__wrapped__", None)
    return False


class CollectedOutputChecks:
    """Installs the checks on every Hugging Face and timm model inside ``root`` that holds ``blocks``
    (every one when None; another model, a frozen teacher, runs whole on every rank): ``on_request``
    hears of outputs of every block asked for, ``on_random_mask`` of an input masked at random."""

    def __init__(
        self,
        root: nn.Module,
        on_request: Callable[[str, str], None],
        on_random_mask: Callable[[str, str], None] | None = None,
        blocks: nn.Module | None = None,
    ) -> None:
        self.root = root
        self.blocks = blocks
        self.on_request = on_request
        self.on_random_mask = on_random_mask
        self._handles: list[Any] = []
        self._wrapped: list[nn.Module] = []
        self._forcing = 0  # calls running whose forward asks its inner model for hidden states regardless
        self._forcing_models: set[int] = set()  # ids of the models whose forward does so

    def install(self) -> None:
        block_ids = None if self.blocks is None else {id(block) for block in self.blocks}

        def holds_blocks(module: nn.Module) -> bool:
            """Whether ``module`` runs one of the blocks (through the block list, or a list of its
            own over the same layers)."""
            return block_ids is None or any(id(inner) in block_ids for inner in module.modules())

        for module in self.root.modules():
            if _is_hf_model(module) and holds_blocks(module):
                check = InstalledHook(self._check_call)
                self._handles.append(module.register_forward_pre_hook(check, with_kwargs=True))
                if _forces_hidden_states(module):
                    self._forcing_models.add(id(module))
                    ends = InstalledHook(self._forcing_ends)
                    self._handles.append(module.register_forward_hook(ends, always_call=True))
            elif callable(getattr(type(module), "forward_intermediates", None)) and holds_blocks(module):
                original = module.forward_intermediates
                module.forward_intermediates = InstalledForward(original, self._intermediates, module, original)
                self._wrapped.append(module)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for module in self._wrapped:
            module.__dict__.pop("forward_intermediates", None)
        self._handles, self._wrapped = [], []
        self._forcing_models.clear()

    def _check_call(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        forced = self._forcing > 0  # the caller's own request was checked at its call
        for flag in COLLECTED_OUTPUTS:
            asked = kwargs.get(flag) and not (forced and flag == "output_hidden_states")
            if asked or getattr(module.config, flag, False):
                self.on_request(type(module).__name__, flag)
        if id(module) in self._forcing_models:
            if getattr(module.config, LAYER_SUM_SWITCH, False):
                self.on_request(type(module).__name__, LAYER_SUM_SWITCH)
            self._forcing += 1
        memory = _memory_asked_for(module, kwargs)
        if memory is not None:
            self.on_request(type(module).__name__, memory)
        if self.on_random_mask is not None:
            switch = random_input_mask(module, args, kwargs)
            if switch is not None:
                self.on_random_mask(type(module).__name__, switch)

    def _forcing_ends(self, *_: Any) -> None:
        self._forcing -= 1

    def _intermediates(self, module: nn.Module, original: Callable, *args: Any, **kwargs: Any) -> Any:
        self.on_request(type(module).__name__, "forward_intermediates")
        return original(*args, **kwargs)


def refuse_diverging_learning_rates(optimizers: list[torch.optim.Optimizer], device: torch.device) -> None:
    """Raise on every rank where the ranks' learning rates differ (a collective): the replicas,
    or the stages of one, would train apart. A ``ReduceLROnPlateau`` that monitors a value each
    rank computes on its own data (logged without ``sync_dist=True``) steps differently on each
    replica, as under DDP; here it starts when a transition adds replicas."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    # A group without a number (Adafactor's lr=None with relative_step) counts as 0 everywhere.
    rates = [_number(group.get("lr")) for optimizer in optimizers for group in optimizer.param_groups]
    if not rates:
        return
    local = torch.tensor(rates, dtype=torch.float64, device=device)
    bounds = torch.cat([local, -local])
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
    highest, lowest = bounds[: len(rates)].tolist(), (-bounds[len(rates) :]).tolist()
    for group, (low, high) in enumerate(zip(lowest, highest)):
        if low != high:
            raise UnsupportedRecipeError(
                f"the learning rate of parameter group {group} differs between ranks ({low:g} to {high:g}): the "
                f"ranks would train apart. A ReduceLROnPlateau (or any schedule) that reads a value each rank "
                f"computes on its own data, logged without sync_dist=True, steps differently on each replica. Log "
                f"the value it monitors with self.log(..., sync_dist=True)."
            )


def _number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0
