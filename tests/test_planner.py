"""The planner's decisions on plain numbers: FLUX.1-dev-shaped sizes under the budgets of the benchmark."""

from __future__ import annotations

import pytest

from diffusers_residency import BudgetTooSmallError, ComponentSizes, plan_residency
from diffusers_residency.planner import PREFETCH_BLOCKS, Policy, parse_bytes

GB = 10**9
MB = 10**6

# FLUX.1-dev in bf16: 19 double-stream blocks of 680 MB and 38 single-stream blocks of 283 MB, a
# 100 MB trunk; T5-XXL's 24 blocks of 390 MB over a 263 MB embedding; CLIP-L; the VAE.
FLUX = (
    ComponentSizes("text_encoder", 246 * MB, (16 * MB,) * 12),
    ComponentSizes("text_encoder_2", 263 * MB + 24 * 390 * MB, (390 * MB,) * 24),
    ComponentSizes("transformer", 100 * MB + 19 * 680 * MB + 38 * 283 * MB, (680 * MB,) * 19 + (283 * MB,) * 38, True),
    ComponentSizes("vae", 168 * MB, (20 * MB,) * 8),
)


def _peak_within(plan, budget: int, reserve: int) -> None:
    assert plan.peak_weight_bytes <= budget - reserve, str(plan)


def test_ample_budget_keeps_everything_resident() -> None:
    plan = plan_residency(FLUX, 80 * GB, 4 * GB)
    assert {p.policy for p in plan.components} == {Policy.RESIDENT}
    assert plan.peak_weight_bytes == sum(s.nbytes for s in FLUX)


def test_30gb_streams_the_once_per_call_encoder_and_keeps_the_transformer() -> None:
    # T5 and the transformer do not fit together; T5 runs once per call, the transformer per step.
    plan = plan_residency(FLUX, 30 * GB, 3 * GB)
    assert plan["transformer"].policy is Policy.RESIDENT, str(plan)
    assert plan["text_encoder_2"].policy is Policy.STREAMED, str(plan)
    assert plan["vae"].policy is Policy.RESIDENT and plan["text_encoder"].policy is Policy.RESIDENT
    _peak_within(plan, 30 * GB, 3 * GB)


@pytest.mark.parametrize("budget", [16 * GB, 8 * GB])
def test_tight_budgets_stream_the_transformer_behind_the_most_resident_blocks(budget: int) -> None:
    reserve = 2 * GB
    plan = plan_residency(FLUX, budget, reserve)
    transformer = plan["transformer"]
    assert transformer.policy is Policy.STREAMED and transformer.prefetch_blocks == PREFETCH_BLOCKS
    assert 0 < len(transformer.resident_blocks) < 57, str(plan)
    _peak_within(plan, budget, reserve)
    # One more resident block would not fit: the room went to resident blocks, not to spare.
    more = plan_residency(FLUX, budget + 680 * MB + 1, reserve)
    assert more["transformer"].resident_bytes(FLUX[2]) > transformer.resident_bytes(FLUX[2])
    # The once-per-call encoder streams rather than taking the transformer's room whole.
    assert plan["text_encoder_2"].policy is Policy.STREAMED


def test_keeping_every_large_block_resident_shrinks_the_window() -> None:
    # With a 1 GB reserve, all 19 double blocks fit beside a window of single-block slots, which
    # holds more resident bytes than more double blocks beside a window of double-block slots.
    plan = plan_residency(FLUX, 16 * GB, 1 * GB)
    transformer = plan["transformer"]
    assert set(range(19)) <= transformer.resident_blocks, str(plan)
    assert transformer.transient_bytes(FLUX[2]) == (1 + PREFETCH_BLOCKS) * 283 * MB
    _peak_within(plan, 16 * GB, 1 * GB)


@pytest.mark.parametrize(("budget", "reserve"), [(16 * GB, 3 * GB), (12 * GB, 2 * GB), (8 * GB, 1 * GB)])
def test_resident_blocks_of_one_size_are_spread_through_the_order(budget: int, reserve: int) -> None:
    # A resident run computes with the window already full; spread out, the runs stay short.
    transformer = plan_residency(FLUX, budget, reserve)["transformer"]
    for positions in (range(19), range(19, 57)):
        resident = [i in transformer.resident_blocks for i in positions]
        kept, streamed = sum(resident), len(resident) - sum(resident)
        if not kept or not streamed:
            continue
        runs = "".join("r" if r else "s" for r in resident).split("s")
        assert max(len(run) for run in runs) <= -(-kept // streamed), (positions, sorted(transformer.resident_blocks))
        assert resident[0], "the first block of a size, which cache hooks always run, is among the resident ones"


def test_budget_too_small_says_what_is_needed() -> None:
    with pytest.raises(BudgetTooSmallError, match="too small"):
        plan_residency(FLUX, 3 * GB, 2 * GB)


def test_fixed_policies_are_kept_and_checked() -> None:
    plan = plan_residency(FLUX, 80 * GB, 4 * GB, fixed={"vae": Policy.STAGED})
    assert plan["vae"].policy is Policy.STAGED and plan["transformer"].policy is Policy.RESIDENT
    streamed = plan_residency(FLUX, 80 * GB, 4 * GB, fixed={"transformer": Policy.STREAMED})
    assert len(streamed["transformer"].resident_blocks) == 57, "a forced stream still keeps all it can"
    small = (ComponentSizes("vae", 100, (50, 50)),)
    with pytest.raises(ValueError, match="cannot stream"):
        plan_residency(small, 10**6, 10, fixed={"vae": Policy.STREAMED})
    with pytest.raises(ValueError, match="unknown components"):
        plan_residency(small, 10**6, 10, fixed={"unet": Policy.STAGED})


@pytest.mark.parametrize(
    ("text", "expected"),
    [("24GB", 24 * GB), ("16 GiB", 16 * 2**30), ("8000MB", 8 * GB), ("1.5gb", 1_500_000_000), (4096, 4096)],
)
def test_budget_strings(text, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["lots", "24 parsecs", "-1GB", "0", 0, 2.5, True])
def test_bad_budget_strings_are_refused(bad) -> None:
    with pytest.raises((ValueError, TypeError), match="vram_budget"):
        parse_bytes(bad)
