"""Callbacks: progressive freezing."""

from lightning_pipetx.callbacks.freeze import FreezeCallback
from lightning_pipetx.callbacks.freeze_rule import FreezeDecision

__all__ = ["FreezeCallback", "FreezeDecision"]
