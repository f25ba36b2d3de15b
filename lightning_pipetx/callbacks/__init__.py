"""Callbacks: progressive freezing, and a per-epoch report of what the run did."""

from lightning_pipetx.callbacks.freeze import FreezeCallback
from lightning_pipetx.callbacks.freeze_rule import FreezeDecision
from lightning_pipetx.callbacks.report import EpochReport

__all__ = ["EpochReport", "FreezeCallback", "FreezeDecision"]
