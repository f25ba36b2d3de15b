"""The elastic pipeline strategy and its parts."""

from lightning_pipetx.strategy.elastic_pipeline import ElasticPipelineStrategy
from lightning_pipetx.strategy.topology import Layout

__all__ = ["ElasticPipelineStrategy", "Layout"]
