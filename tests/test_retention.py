"""The retention budget's decisions, from allocator figures injected at the one telemetry read point
(a CPU has no caching-allocator figures to read)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from diffusers_residency import ResidencyGroup, RetentionBudget, _device, attach_staging_hook
from diffusers_residency._device import MemoryTelemetry
from diffusers_residency.retention import RELEASES_BEFORE_RETEST

GB = 10**9
DEVICE = torch.device("cuda", 0)


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> dict:
    state: dict = {"telemetry": None, "empty_cache_calls": 0}

    def read(device: torch.device) -> MemoryTelemetry | None:
        if state["telemetry"] == "broken":
            raise RuntimeError("allocator stats unavailable")
        return state["telemetry"]

    def empty_cache(device: torch.device) -> None:
        state["empty_cache_calls"] += 1

    monkeypatch.setattr(_device, "read_memory_telemetry", read)
    monkeypatch.setattr(_device, "empty_cache", empty_cache)
    return state


def telemetry(cached: int, free: int, total: int = 100 * GB, allocated: int = 10 * GB) -> MemoryTelemetry:
    return MemoryTelemetry(reserved=allocated + cached, allocated=allocated, free=free, total=total)


def test_retains_within_budget(figures: dict) -> None:
    budget = RetentionBudget(DEVICE)
    budget.grow(5 * GB)  # seed budget 10 GB
    figures["telemetry"] = telemetry(cached=9 * GB, free=50 * GB)
    decision = budget.at_boundary()
    assert not decision.released and decision.reason == "within-budget" and decision.budget == 10 * GB
    assert figures["empty_cache_calls"] == 0 and budget.retains == 1


def test_over_budget_releases_once_then_learns(figures: dict) -> None:
    budget = RetentionBudget(DEVICE)
    budget.grow(5 * GB)
    figures["telemetry"] = telemetry(cached=12 * GB, free=50 * GB)
    assert budget.at_boundary().reason == "cached-over-budget"
    assert figures["empty_cache_calls"] == 1
    # The observed 12 GB now sets the budget at 15 GB: the same workload is retained from now on.
    decision = budget.at_boundary()
    assert not decision.released and decision.budget == 15 * GB


def test_budget_is_capped_at_a_quarter_of_the_device(figures: dict) -> None:
    budget = RetentionBudget(DEVICE)
    budget.grow(40 * GB)  # seed 80 GB
    figures["telemetry"] = telemetry(cached=30 * GB, free=50 * GB)
    decision = budget.at_boundary()
    assert decision.released and decision.budget == 25 * GB


def test_low_free_memory_releases(figures: dict) -> None:
    budget = RetentionBudget(DEVICE)
    budget.grow(5 * GB)
    figures["telemetry"] = telemetry(cached=1 * GB, free=4 * GB)
    assert budget.at_boundary().reason == "low-free-memory"
    assert budget.releases == 1


def test_cache_in_the_room_a_vram_budget_keeps_for_activations_is_kept_until_it_is_needed_back(figures: dict) -> None:
    budget = RetentionBudget(DEVICE)
    budget.grow(5 * GB)  # a retention budget of 10 GB would keep 3 GB
    budget.reserved_limit = 12 * GB
    figures["telemetry"] = telemetry(cached=3 * GB, free=50 * GB, allocated=9 * GB)
    decision = budget.at_boundary("vae")
    assert not decision.released and decision.reason == "within-budget", "9 + 3 GB held: at the limit, not over it"
    assert budget.kept_over_limit is None
    # Over the limit: kept (the allocator reuses it for the activations where it fits), and said so.
    figures["telemetry"] = telemetry(cached=3 * GB, free=50 * GB, allocated=10 * GB)
    decision = budget.at_boundary("vae")
    assert not decision.released and decision.reason == "over-vram-budget-kept"
    assert budget.kept_over_limit == "vae" and figures["empty_cache_calls"] == 0
    # Once the component was seen to need it back, it is released before it starts.
    budget.release_over_limit_before.add("vae")
    assert budget.at_boundary("vae").reason == "over-vram-budget"
    assert budget.kept_over_limit is None and figures["empty_cache_calls"] == 1
    assert budget.at_boundary("unet").reason == "over-vram-budget-kept", "another component's boundary keeps it"
    assert budget.at_boundary().reason == "over-vram-budget", "a boundary into no named component releases"
    figures["telemetry"] = telemetry(cached=0, free=50 * GB, allocated=13 * GB)
    assert not budget.at_boundary("vae").released, "tensors alone over the limit: no cache to give back"
    # Released for another reason, it is not counted as kept.
    figures["telemetry"] = telemetry(cached=20 * GB, free=50 * GB, allocated=10 * GB)
    assert budget.at_boundary("unet").reason == "cached-over-budget" and budget.kept_over_limit is None


def test_a_release_learned_from_one_retry_is_tried_without_again_and_kept_for_later_processes_once_confirmed(
    figures: dict,
) -> None:
    # One retry is no proof: another process allocating on the device makes the allocator retry too,
    # and a release kept for good costs every later call (and process, through the profile).
    budget = RetentionBudget(DEVICE)
    budget.grow(5 * GB)
    budget.reserved_limit = 12 * GB
    figures["telemetry"] = telemetry(cached=3 * GB, free=50 * GB, allocated=10 * GB)  # over the limit
    budget.learn_release_before("vae")
    assert budget.confirmed_release_before() == frozenset(), "learned once: for this process only"
    reasons = [budget.at_boundary("vae").reason for _ in range(RELEASES_BEFORE_RETEST + 1)]
    assert reasons == ["over-vram-budget"] * RELEASES_BEFORE_RETEST + ["over-vram-budget-kept"], "then kept once, to see"
    assert budget.kept_over_limit == "vae"
    budget.learn_release_before("vae")  # a retry after keeping it again confirms the release
    assert budget.confirmed_release_before() == {"vae"}
    assert all(budget.at_boundary("vae").reason == "over-vram-budget" for _ in range(2 * RELEASES_BEFORE_RETEST + 2))


def test_a_release_kept_again_with_no_retry_after_it_is_learned_anew(figures: dict) -> None:
    budget = RetentionBudget(DEVICE)
    budget.grow(5 * GB)
    budget.reserved_limit = 12 * GB
    figures["telemetry"] = telemetry(cached=3 * GB, free=50 * GB, allocated=10 * GB)
    budget.learn_release_before("vae")
    for _ in range(RELEASES_BEFORE_RETEST + 1):
        budget.at_boundary("vae")
    assert budget.kept_over_limit == "vae", "kept again, to see"
    assert budget.at_boundary("text_encoder").reason == "over-vram-budget-kept", "no retry told before the next boundary"
    budget.learn_release_before("vae")  # much later: one retry is no proof again
    assert budget.confirmed_release_before() == frozenset()
    assert budget.at_boundary("vae").reason == "over-vram-budget"


def test_what_retries_taught_for_one_call_shape_comes_back_with_it(figures: dict) -> None:
    # Calls alternating two shapes: each shape's releases, and what is being confirmed, are its own.
    budget = RetentionBudget(DEVICE)
    budget.grow(5 * GB)
    budget.reserved_limit = 12 * GB
    figures["telemetry"] = telemetry(cached=3 * GB, free=50 * GB, allocated=10 * GB)
    budget.set_release_before(learned_for="1024")
    budget.learn_release_before("vae")
    assert budget.at_boundary("vae").reason == "over-vram-budget"
    budget.set_release_before(["unet"], learned_for="768")  # a profile's confirmed release for the other shape
    assert budget.release_over_limit_before == {"unet"} and budget.confirmed_release_before() == {"unet"}
    assert budget.at_boundary("vae").reason == "over-vram-budget-kept"
    budget.set_release_before(learned_for="1024")
    assert budget.at_boundary("vae").reason == "over-vram-budget", "the one release left before the retest"
    assert budget.at_boundary("vae").reason == "over-vram-budget-kept", "kept again, to see"
    budget.learn_release_before("vae")
    assert budget.confirmed_release_before() == {"vae"}, "confirmed across the other shape's calls"
    budget.forget_releases()
    assert budget.release_over_limit_before == set()
    budget.set_release_before(learned_for="1024")
    assert budget.release_over_limit_before == set(), "forgotten for every shape"


@pytest.mark.parametrize("telemetry", [None, "broken"], ids=["absent", "raising"])
def test_missing_telemetry_releases(figures: dict, telemetry) -> None:
    figures["telemetry"] = telemetry
    budget = RetentionBudget(DEVICE)
    decision = budget.at_boundary()
    assert decision.released and decision.reason.startswith("no-telemetry")
    assert figures["empty_cache_calls"] == 1


def test_grow_and_shrink_move_the_seed(figures: dict) -> None:
    budget = RetentionBudget(DEVICE)
    budget.grow(3 * GB)
    budget.grow(2 * GB)
    assert budget.budget_for(100 * GB) == 10 * GB
    budget.shrink(3 * GB)
    assert budget.budget_for(100 * GB) == 4 * GB
    budget.resize(2 * GB, 4 * GB)
    assert budget.budget_for(100 * GB) == 8 * GB


def test_a_switch_that_evicts_nothing_leaves_the_cache_kept_counted_for_the_boundary_before(figures: dict) -> None:
    # FLUX.1 at 30 GB: the cache kept as the transformer starts (the T5's dropped blocks) is still
    # held while the VAE runs, the switch to which evicts nothing (the transformer's blocks stay).
    group = ResidencyGroup("cpu")
    modules = {name: nn.Linear(4, 4) for name in ("t5", "transformer", "vae")}
    for name, module in modules.items():
        attach_staging_hook(module, group, name=name, policy="staged" if name == "t5" else "resident")
    group.weight_room = lambda component: 12 * GB
    group.retention.grow(5 * GB)  # a retention budget of 10 GB: the 3 GB are over the limit only
    figures["telemetry"] = telemetry(cached=3 * GB, free=50 * GB, allocated=10 * GB)
    x = torch.ones(1, 4)
    modules["t5"](x)
    group.evict_others("transformer")  # what a streamed component's switch does
    assert group.retention.kept_over_limit == "transformer" and figures["empty_cache_calls"] == 0
    group.evict_others("vae")  # nothing left to evict
    assert group.retention.kept_over_limit == "transformer", "still the cache kept at the transformer's boundary"
    modules["t5"](x)
    group.evict_others("transformer")
    group.retention.release_over_limit_before.add("transformer")
    modules["t5"](x)
    group.evict_others("transformer")
    assert group.retention.kept_over_limit is None and figures["empty_cache_calls"] == 1
