"""lightning-pipetx: progressive layer freezing and elastic pipelining for PyTorch Lightning."""

import logging

from lightning_pipetx.blocks import BlockListNotFoundError, BlockSplit, find_blocks
from lightning_pipetx.callbacks import EpochReport, FreezeCallback
from lightning_pipetx.strategy import ElasticPipelineStrategy, Layout
from lightning_pipetx.strategy.failure import CheckpointAfterFailureError
from lightning_pipetx.strategy.grad_sync import UnexpectedGradientError
from lightning_pipetx.strategy.lightning_compat import UnsupportedLightningError, WeightAveragingError
from lightning_pipetx.strategy.loss_scaling import OverflowAgreementError
from lightning_pipetx.strategy.microbatch import BatchSplitError
from lightning_pipetx.strategy.model_checks import (
    ManualOptimizationError,
    UnsupportedOutputsError,
    UnsupportedRecipeError,
)
from lightning_pipetx.strategy.p2p import BoundaryError, PeerError
from lightning_pipetx.strategy.param_store import ReleasedWeightsError
from lightning_pipetx.strategy.stage_runner import BatchMismatchError

# isort: split
# AutoCache's modules import the strategy's: after it.
from lightning_pipetx.autocache import FrozenWeightsChangedError, TrainablePrefixError
from lightning_pipetx.autocache.tiers import SharedFileMismatchError

__version__ = "0.1.0"

# Same set-up as Lightning's own logger: our INFO lines show unless the application
# configured logging itself.
_logger = logging.getLogger(__name__)
_logger.setLevel(logging.INFO)
if not logging.getLogger().hasHandlers():
    _logger.addHandler(logging.StreamHandler())
    _logger.propagate = False

__all__ = [
    "BatchMismatchError",
    "BatchSplitError",
    "BlockListNotFoundError",
    "BlockSplit",
    "BoundaryError",
    "CheckpointAfterFailureError",
    "ElasticPipelineStrategy",
    "EpochReport",
    "FreezeCallback",
    "FrozenWeightsChangedError",
    "Layout",
    "ManualOptimizationError",
    "OverflowAgreementError",
    "PeerError",
    "ReleasedWeightsError",
    "SharedFileMismatchError",
    "TrainablePrefixError",
    "UnexpectedGradientError",
    "UnsupportedLightningError",
    "UnsupportedOutputsError",
    "UnsupportedRecipeError",
    "WeightAveragingError",
    "find_blocks",
]
