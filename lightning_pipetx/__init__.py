"""lightning-pipetx: progressive layer freezing and elastic pipelining for PyTorch Lightning."""

import logging

from lightning_pipetx.blocks import BlockListNotFoundError, BlockSplit, find_blocks
from lightning_pipetx.callbacks import EpochReport, FreezeCallback
from lightning_pipetx.strategy import ElasticPipelineStrategy, Layout

__version__ = "0.1.0"

# Same set-up as Lightning's own logger: our INFO lines show unless the application
# configured logging itself.
_logger = logging.getLogger(__name__)
_logger.setLevel(logging.INFO)
if not logging.getLogger().hasHandlers():
    _logger.addHandler(logging.StreamHandler())
    _logger.propagate = False

__all__ = [
    "BlockListNotFoundError",
    "BlockSplit",
    "ElasticPipelineStrategy",
    "EpochReport",
    "FreezeCallback",
    "Layout",
    "find_blocks",
]
