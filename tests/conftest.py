"""Test set-up: one CPU thread per process (the machines have 2 cores), quieter libraries."""

import logging
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

# ``import tiny_models`` works from every test file, and from subprocesses given this path.
TESTS_DIR = Path(__file__).resolve().parent
for path in (TESTS_DIR, TESTS_DIR / "workers"):  # workers import their shared cases by module name
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from distributed import RENDEZVOUS_VARIABLES  # noqa: E402

for name in ("lightning.pytorch.utilities.rank_zero", "lightning.pytorch.accelerators.cuda"):
    logging.getLogger(name).setLevel(logging.WARNING)


def pytest_configure(config):
    for line in (
        "ignore::lightning.fabric.utilities.warnings.PossibleUserWarning",
        "ignore:.*does not have many workers.*",
        "ignore:.*LeafSpec.*",
        "ignore:.*Checkpoint directory .* exists and is not empty.*",
        "ignore:.*The dirpath has changed from.*",
    ):
        config.addinivalue_line("filterwarnings", line)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:  # transformers is optional
        pass


@pytest.fixture(autouse=True)
def _forget_rendezvous():
    """Lightning writes MASTER_PORT and friends into this process's environment when a test
    trains in-process (the port stays bound by its process group); subprocesses started by
    later tests must not inherit them."""
    yield
    for name in RENDEZVOUS_VARIABLES:
        os.environ.pop(name, None)
