"""Shared test setup: Triton kernels run under the interpreter when there is no GPU."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before triton is imported anywhere.
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="module")
def one_thread():
    """Toy-sized tensors: one intra-op thread avoids OpenMP overhead (10-100x on a busy 2-core box).
    Use it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
