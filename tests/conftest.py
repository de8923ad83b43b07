"""Fixtures, and the skip of GPU tests where there is no CUDA device."""

from __future__ import annotations

import os

import pytest
import torch

from .helpers import PipelineCase

# Two cores on CI: more threads than cores only adds contention.
torch.set_num_threads(min(2, os.cpu_count() or 1))


def has_cuda() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def flux() -> PipelineCase:
    return PipelineCase("flux")
