"""Shared set-up of the statistical suite: every module runs on one torch thread (tests/conftest.py)."""

import pytest


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    yield
