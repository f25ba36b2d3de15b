"""The non-public parts of Lightning the strategy relies on are checked at setup (issue 12, item 9)."""

import lightning
import pytest
import tomllib
import torchmetrics
from distributed import REPO
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from tiny_models import make_trainer

from lightning_pipetx import ElasticPipelineStrategy
from lightning_pipetx.strategy.lightning_compat import (
    SUPPORTED,
    SUPPORTED_VERSIONS,
    UnsupportedLightningError,
    check_lightning_internals,
)


def test_the_installed_versions_have_everything_the_strategy_relies_on():
    check_lightning_internals(make_trainer([]))


def test_pyproject_bounds_the_versions_the_check_names():
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    requirements = {r.name: r for r in map(Requirement, dependencies)}
    for name, module in (("lightning", lightning), ("torchmetrics", torchmetrics)):
        assert requirements[name].specifier == SpecifierSet(SUPPORTED[name])
        assert requirements[name].specifier.contains(module.__version__)
        assert any(spec.operator == "<" for spec in requirements[name].specifier), f"{name} has no upper bound"


def test_a_missing_attribute_is_named_with_the_supported_versions():
    trainer = make_trainer([], strategy=ElasticPipelineStrategy())
    del trainer.fit_loop._combined_loader  # what a Lightning release without it would look like
    with pytest.raises(UnsupportedLightningError) as error:
        check_lightning_internals(trainer)
    message = str(error.value)
    assert "Trainer.fit_loop._combined_loader" in message and SUPPORTED_VERSIONS in message
    assert "val_loop._combined_loader" not in message  # only what is missing
