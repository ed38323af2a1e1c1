"""Shared set-up of the statistical suite."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Toy-sized tensors: one intra-op thread avoids OpenMP overhead (10-100x on a busy 2-core box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
