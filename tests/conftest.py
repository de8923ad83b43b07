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


@pytest.fixture(autouse=True)
def _profile_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    # Residency profiles saved by one test (or by a run on this machine) must not plan another's calls.
    monkeypatch.setenv("DIFFUSERS_RESIDENCY_CACHE", str(tmp_path_factory.mktemp("residency-cache")))


@pytest.fixture
def flux() -> PipelineCase:
    return PipelineCase("flux")
