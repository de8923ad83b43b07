"""The planner's decisions on plain numbers: FLUX.1-dev-shaped sizes under the budgets of the benchmark."""

from __future__ import annotations

import pytest

from diffusers_residency import BudgetTooSmallError, ComponentSizes, plan_residency
from diffusers_residency.planner import default_reserve
from diffusers_residency.plans import PREFETCH_BLOCKS, ComponentPlan
from diffusers_residency.policy import Policy
from diffusers_residency.step_timing import StepTiming, simulated_step_seconds
from diffusers_residency.text import parse_bytes

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
    staged = sum(FLUX[2].block_bytes[i] for i in transformer.staged_blocks)
    assert transformer.transient_bytes(FLUX[2]) - staged == (1 + PREFETCH_BLOCKS) * 283 * MB
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


# SDXL-base in fp16: the UNet's 51 repeated blocks (attention and resnet blocks of three widths)
# over a trunk, and what each component needs above its weights at 1024x1024: the VAE decodes in
# float32 at full resolution.
SDXL = (
    ComponentSizes("text_encoder", 246 * MB, (14 * MB,) * 12),
    ComponentSizes("text_encoder_2", 1389 * MB, (40 * MB,) * 32),
    ComponentSizes("unet", 5135 * MB, (30 * MB,) * 11 + (90 * MB,) * 20 + (140 * MB,) * 20, True),
    ComponentSizes("vae", 167 * MB, (8 * MB,) * 16),
)
SDXL_ACTIVATIONS = {"text_encoder": 100 * MB, "text_encoder_2": 200 * MB, "unet": 1500 * MB, "vae": 5300 * MB}


def _moments(plan) -> dict[str, int]:
    """What the device holds while each component runs, by the plan."""
    by_name = {s.name: s for s in plan.sizes}
    return {
        p.name: plan.resident_weight_bytes + p.transient_bytes(by_name[p.name]) + plan.activation_bytes_of(p.name)
        for p in plan.components
    }


def test_measured_activations_let_the_denoiser_keep_its_blocks_while_it_runs() -> None:
    budget = 8 * GB
    plan = plan_residency(SDXL, budget, default_reserve(budget), activations=SDXL_ACTIVATIONS)
    unet, sizes = plan["unet"], SDXL[2]
    assert unet.policy is Policy.STREAMED, str(plan)
    # Nothing of the UNet moves at every step: what does not stay across calls (the VAE's decode
    # needs that room) stays while the UNet runs, loaded once per call.
    assert unet.resident_blocks | unet.staged_blocks == frozenset(range(len(sizes.block_bytes))), str(plan)
    assert unet.staged_blocks, str(plan)
    assert max(_moments(plan).values()) == plan.peak_bytes <= budget, (_moments(plan), str(plan))
    # The VAE's moment is what bounds the resident bytes: one more UNet block would not fit it.
    smallest_staged = min(sizes.block_bytes[i] for i in unet.staged_blocks)
    assert _moments(plan)["vae"] + smallest_staged > budget, (_moments(plan), str(plan))


def test_once_per_call_components_stream_only_where_their_whole_would_take_room_that_others_use() -> None:
    budget = 8 * GB
    plan = plan_residency(SDXL, budget, default_reserve(budget), activations=SDXL_ACTIVATIONS)
    # The VAE's decode is what binds: the text encoders' moments have room for them whole. Their
    # blocks move once per call either way; staged, in one load each, and the trunks they kept
    # resident while streaming go to the UNet.
    assert plan["text_encoder"].policy is plan["text_encoder_2"].policy is Policy.STAGED, str(plan)
    streaming = {"text_encoder": Policy.STREAMED, "text_encoder_2": Policy.STREAMED}
    streamed = plan_residency(SDXL, budget, default_reserve(budget), streaming, activations=SDXL_ACTIVATIONS)
    assert plan["unet"].resident_bytes(SDXL[2]) > streamed["unet"].resident_bytes(SDXL[2]), (str(plan), str(streamed))
    # Staged whole, the VAE would take room from the UNet's resident blocks at its own moment.
    assert plan["vae"].policy is Policy.STREAMED
    assert max(_moments(plan).values()) == plan.peak_bytes <= budget, (_moments(plan), str(plan))

    # FLUX.1-dev at 16 GB: T5 and the VAE whole do not fit beside the transformer's resident blocks
    # (the VAE's decode binds), and CLIP, given a resident block, moves fewer bytes streamed.
    flux = {"text_encoder": 409 * MB, "text_encoder_2": 623 * MB, "transformer": 1070 * MB, "vae": 3417 * MB}
    plan = plan_residency(FLUX, 16 * GB, default_reserve(16 * GB), activations=flux)
    assert {p.name for p in plan.components if p.policy is Policy.STREAMED} == set(flux), str(plan)
    vae = FLUX[3]
    assert _moments(plan)["vae"] + vae.nbytes - plan["vae"].transient_bytes(vae) > 16 * GB, str(plan)
    assert plan["text_encoder"].resident_blocks, str(plan)


def test_one_reserve_for_every_component_streams_the_denoiser_at_every_step() -> None:
    # The same budget with the VAE's need reserved for everyone: the UNet has to stream blocks at
    # every step, which per-component activations avoid.
    budget = 8 * GB
    plan = plan_residency(SDXL, budget, SDXL_ACTIVATIONS["vae"])
    unet = plan["unet"]
    assert len(unet.resident_blocks) + len(unet.staged_blocks) < len(SDXL[2].block_bytes), str(plan)
    assert plan.peak_bytes <= budget


def test_a_resident_component_runs_beside_what_the_one_before_it_left() -> None:
    # A resident VAE evicts nothing when it starts: the UNet's staged blocks and window are still
    # on the device while it decodes, and its moment of the call counts them.
    budget = 8 * GB
    plan = plan_residency(SDXL, budget, default_reserve(budget), {"vae": Policy.RESIDENT}, SDXL_ACTIVATIONS)
    unet_transient = plan.transient_bytes_of("unet")
    assert unet_transient > 0, str(plan)
    assert plan.resident_weight_bytes + unet_transient + SDXL_ACTIVATIONS["vae"] <= plan.peak_bytes <= budget, str(plan)


def test_the_measuring_plan_keeps_the_least_on_the_device() -> None:
    plan = plan_residency(FLUX, 16 * GB, 3 * GB, least=True)
    for component in plan.components:
        assert not component.resident_blocks and not component.staged_blocks, str(plan)
        assert component.policy in (Policy.STREAMED, Policy.STAGED), str(plan)
    assert not plan.keeps_everything
    assert plan_residency(FLUX, 80 * GB, 4 * GB).keeps_everything
    # A fixed resident component stays so.
    fixed = plan_residency(FLUX, 16 * GB, 3 * GB, fixed={"vae": Policy.RESIDENT}, least=True)
    assert fixed["vae"].policy is Policy.RESIDENT


def test_a_simulated_step_is_bound_by_the_bus_or_the_compute() -> None:
    blocks = FLUX[2].block_bytes
    timing = StepTiming(compute_per_byte=0.18 / sum(blocks), load_per_byte=1 / 55e9)
    assert simulated_step_seconds(blocks, frozenset(), PREFETCH_BLOCKS, timing) == pytest.approx(sum(blocks) / 55e9)
    assert simulated_step_seconds(blocks, frozenset(range(57)), PREFETCH_BLOCKS, timing) == pytest.approx(0.18)
    # A window as large as every streamed block holds them all: after the first pass none loads.
    few = frozenset(range(57 - PREFETCH_BLOCKS - 1))
    assert simulated_step_seconds(blocks, few, PREFETCH_BLOCKS, timing) == pytest.approx(0.18)
    # Every double-stream block resident: the bus idles through them, then cannot keep up.
    doubles = simulated_step_seconds(blocks, frozenset(range(19)), PREFETCH_BLOCKS, timing)
    assert doubles > sum(blocks[19:]) / 55e9 + 0.05


def test_a_timed_step_chooses_resident_blocks_that_keep_the_bus_busy() -> None:
    # Planned by bytes, a 16 GB budget with 1.3 GB for activations keeps every double-stream block
    # resident in one run (measured on the H200: 2.837 s/call, against 2.501 s/call for fewer
    # resident bytes spread out). Timed, the plan spreads them.
    blocks = FLUX[2].block_bytes
    timing = StepTiming(compute_per_byte=0.171 / sum(blocks), load_per_byte=1 / 54.5e9)
    by_bytes = plan_residency(FLUX, 16 * GB, 1300 * MB)
    timed = plan_residency(FLUX, 16 * GB, 1300 * MB, timings={"transformer": timing})
    assert by_bytes["transformer"].resident_blocks >= frozenset(range(19)), str(by_bytes)

    def step(plan) -> float:
        transformer = plan["transformer"]
        kept = transformer.resident_blocks | transformer.staged_blocks
        return simulated_step_seconds(blocks, kept, transformer.prefetch_blocks, timing)

    assert step(timed) < step(by_bytes) - 0.05, (str(timed), str(by_bytes))
    assert timed.peak_bytes <= 16 * GB and timed.timings == {"transformer": timing}
    assert "chosen from a timed step" in str(timed)


def test_a_step_timed_block_by_block_chooses_blocks_for_their_compute_not_their_bytes() -> None:
    # FLUX.1-dev's double-stream block holds 2.4x the weights of a single-stream one for about the
    # same compute. In proportion to bytes, a streamed double block's 12 ms load looks half hidden
    # behind 5 ms of its own compute; it has 3 ms. Planned with each block's share of the step,
    # more double blocks stay and the step is some 9 % shorter, near the bus bound of what streams.
    blocks = FLUX[2].block_bytes
    by_bytes = StepTiming(0.182 / sum(blocks), 1 / 54.8e9)
    by_block = StepTiming(0.182 / sum(blocks), 1 / 54.8e9, compute_shares=(1 / 57,) * 57)

    def planned(timing: StepTiming):
        plan = plan_residency(FLUX, 16 * GB, 3 * GB, None, FLUX_ACTIVATIONS, timings={"transformer": timing})
        assert plan.peak_bytes <= 16 * GB, str(plan)
        return plan["transformer"]

    def step(transformer, timing: StepTiming = by_block) -> float:
        kept = transformer.resident_blocks | transformer.staged_blocks
        return simulated_step_seconds(blocks, kept, transformer.prefetch_blocks, timing)

    for_bytes, for_blocks = planned(by_bytes), planned(by_block)
    assert step(for_bytes) > step(for_bytes, by_bytes) + 0.01, "loads that bytes would hide behind compute"
    doubles = [len(plan.resident_blocks & frozenset(range(19))) for plan in (for_bytes, for_blocks)]
    assert doubles[1] > doubles[0], (for_bytes, for_blocks)
    assert step(for_blocks) < step(for_bytes) * 0.93, (for_bytes, for_blocks)
    kept = for_blocks.resident_blocks | for_blocks.staged_blocks
    streamed = sum(nbytes for i, nbytes in enumerate(blocks) if i not in kept)
    assert step(for_blocks) < streamed / 54.8e9 * 1.05
    # Blocks' shares of another count (a file's figures for another model) are not read.
    other_count = StepTiming(0.182 / sum(blocks), 1 / 54.8e9, compute_shares=(1 / 19,) * 19)
    assert step(for_bytes, other_count) == step(for_bytes, by_bytes)


# What a first call of FLUX.1-dev at 1024x1024 measured above the weights (docs/benchmarks.md).
FLUX_ACTIVATIONS = {"text_encoder": 409 * MB, "text_encoder_2": 623 * MB, "transformer": 1454 * MB, "vae": 4064 * MB}


def _flux_timing(step_seconds: float) -> dict[str, StepTiming]:
    return {"transformer": StepTiming(step_seconds / sum(FLUX[2].block_bytes), load_per_byte=1 / 54.6e9)}


def _transformer_step(plan, timing: dict[str, StepTiming]) -> float:
    transformer = plan["transformer"]
    kept = transformer.resident_blocks | transformer.staged_blocks
    return simulated_step_seconds(FLUX[2].block_bytes, kept, transformer.prefetch_blocks, timing["transformer"])


@pytest.mark.parametrize("longer", [1.1, 1.2])
def test_a_step_timed_a_little_longer_keeps_the_resident_blocks_in_place(longer: float) -> None:
    # Planned afresh, the step timed 10 or 20 % longer moves 2.5 to 5 GB of resident blocks for a
    # step within 2 % of the one they had: loaded while the call waits, and back at the next timing.
    before = plan_residency(FLUX, 16 * GB, 3 * GB, None, FLUX_ACTIVATIONS, timings=_flux_timing(0.174))
    timing = _flux_timing(0.174 * longer)
    afresh = plan_residency(FLUX, 16 * GB, 3 * GB, None, FLUX_ACTIVATIONS, timings=timing)
    assert afresh["transformer"].resident_blocks != before["transformer"].resident_blocks, "no churn to keep from"
    again = plan_residency(FLUX, 16 * GB, 3 * GB, None, FLUX_ACTIVATIONS, timings=timing, incumbent=before.components)
    assert again["transformer"].resident_blocks == before["transformer"].resident_blocks, str(again)
    assert again["transformer"].prefetch_blocks == before["transformer"].prefetch_blocks
    assert _transformer_step(again, timing) <= _transformer_step(afresh, timing) * 1.02
    assert again.timings == timing and again.peak_bytes <= 16 * GB


def test_the_plan_in_place_gives_way_to_a_step_shorter_by_more_than_the_tie() -> None:
    # Every double-stream block resident in one run (planned by bytes) idles the bus for 50 ms and
    # more of each step: a timed plan does not keep it.
    by_bytes = plan_residency(FLUX, 16 * GB, 3 * GB, None, FLUX_ACTIVATIONS)
    timing = _flux_timing(0.174)
    timed = plan_residency(FLUX, 16 * GB, 3 * GB, None, FLUX_ACTIVATIONS, timings=timing, incumbent=by_bytes.components)
    assert timed["transformer"].resident_blocks != by_bytes["transformer"].resident_blocks
    assert _transformer_step(timed, timing) < _transformer_step(by_bytes, timing) / 1.02
    assert timed == plan_residency(FLUX, 16 * GB, 3 * GB, None, FLUX_ACTIVATIONS, timings=timing)


def test_the_plan_in_place_gives_way_where_it_no_longer_fits() -> None:
    timing = _flux_timing(0.174)
    before = plan_residency(FLUX, 16 * GB, 3 * GB, None, FLUX_ACTIVATIONS, timings=timing)
    larger = {**FLUX_ACTIVATIONS, "transformer": 2 * FLUX_ACTIVATIONS["transformer"]}
    after = plan_residency(FLUX, 16 * GB, 3 * GB, None, larger, timings=timing, incumbent=before.components)
    assert after == plan_residency(FLUX, 16 * GB, 3 * GB, None, larger, timings=timing)
    assert after["transformer"].resident_bytes(FLUX[2]) < before["transformer"].resident_bytes(FLUX[2])
    assert after.peak_bytes <= 16 * GB


def test_the_plan_in_place_gives_way_to_more_resident_bytes_where_the_steps_tie() -> None:
    # Every UNet block is kept through the steps, resident or staged, so the steps tie whatever the
    # split; staged ones load at every call. Planned for a VAE estimated 400 MB short of room, the
    # plan in place keeps 0.40 GB less resident than the plan for what the VAE measured.
    unet = SDXL[2]
    timing = {"unet": StepTiming(compute_per_byte=0.061 / sum(unet.block_bytes), load_per_byte=1 / 54e9)}
    estimated = {**SDXL_ACTIVATIONS, "vae": SDXL_ACTIVATIONS["vae"] + 400 * MB}
    before = plan_residency(SDXL, 8 * GB, 3 * GB, None, estimated, timings=timing)
    measured = plan_residency(SDXL, 8 * GB, 3 * GB, None, SDXL_ACTIVATIONS, timings=timing)
    more = measured["unet"].resident_bytes(unet) - before["unet"].resident_bytes(unet)
    assert more > max(unet.block_bytes), (str(before), str(measured))
    again = plan_residency(SDXL, 8 * GB, 3 * GB, None, SDXL_ACTIVATIONS, timings=timing, incumbent=before.components)
    assert again == measured


def test_the_plan_in_place_gives_way_where_the_others_keep_more_resident() -> None:
    # At 11.25 GB, hooked as a pipeline enabled for an estimate, the UNet's step is the same under
    # both plans; the plan for a VAE estimated 800 MB over what it measured keeps the first text
    # encoder staged and less of the UNet and VAE resident: some 400 MB more loaded at every call.
    budget, unet = 45 * GB // 4, SDXL[2]
    timing = {"unet": StepTiming(compute_per_byte=0.061 / sum(unet.block_bytes), load_per_byte=1 / 54e9)}
    estimated = {**SDXL_ACTIVATIONS, "vae": SDXL_ACTIVATIONS["vae"] + 800 * MB}
    enabled = plan_residency(SDXL, budget, 3 * GB, None, estimated)
    streaming = {p.name: Policy.STREAMED for p in enabled.components if p.policy is Policy.STREAMED}
    hooked = [s if s.name in streaming else ComponentSizes(s.name, s.nbytes, ()) for s in SDXL]
    before = plan_residency(hooked, budget, 3 * GB, streaming, estimated, timings=timing)
    measured = plan_residency(hooked, budget, 3 * GB, streaming, SDXL_ACTIVATIONS, timings=timing)
    assert measured.resident_weight_bytes > before.resident_weight_bytes + max(unet.block_bytes)
    again = plan_residency(
        hooked, budget, 3 * GB, streaming, SDXL_ACTIVATIONS, timings=timing, incumbent=before.components
    )
    assert again == measured


def test_the_plan_in_place_gives_way_where_the_timed_component_fits_whole() -> None:
    # Measured at a quarter of its estimate, the transformer fits resident at 29 GB: the plan in
    # place would keep streaming 7 of its blocks at every step.
    timing = _flux_timing(0.174)
    estimated = {**FLUX_ACTIVATIONS, "transformer": 6 * GB}
    before = plan_residency(FLUX, 29 * GB, 3 * GB, None, estimated, timings=timing)
    measured = plan_residency(FLUX, 29 * GB, 3 * GB, None, FLUX_ACTIVATIONS, timings=timing)
    assert before["transformer"].policy is Policy.STREAMED and measured["transformer"].policy is Policy.RESIDENT
    again = plan_residency(FLUX, 29 * GB, 3 * GB, None, FLUX_ACTIVATIONS, timings=timing, incumbent=before.components)
    assert again == measured


def test_the_plan_in_place_gives_way_where_no_timed_components_blocks_move() -> None:
    # SD3-shaped at 14 GB: the transformer is resident under both plans, and the plan for needs
    # estimated 400 MB high keeps one T5 block (390 MB) fewer resident, loaded at every call for
    # nothing a swap would cost.
    sd3 = (
        ComponentSizes("text_encoder", 246 * MB, (16 * MB,) * 12),
        ComponentSizes("text_encoder_2", 1389 * MB, (40 * MB,) * 32),
        ComponentSizes("text_encoder_3", 263 * MB + 24 * 390 * MB, (390 * MB,) * 24),
        ComponentSizes("transformer", 100 * MB + 24 * 170 * MB, (170 * MB,) * 24, True),
        ComponentSizes("vae", 168 * MB, (20 * MB,) * 8),
    )
    needs = {"text_encoder": 400 * MB, "text_encoder_2": 500 * MB, "text_encoder_3": 623 * MB,
             "transformer": 1000 * MB, "vae": 3400 * MB}  # fmt: skip
    timing = {"transformer": StepTiming(compute_per_byte=0.06 / sum(sd3[3].block_bytes), load_per_byte=1 / 54.6e9)}
    estimated = {name: need + 400 * MB for name, need in needs.items()}
    before = plan_residency(sd3, 14 * GB, 3 * GB, None, estimated, timings=timing)
    measured = plan_residency(sd3, 14 * GB, 3 * GB, None, needs, timings=timing)
    assert before["transformer"].policy is measured["transformer"].policy is Policy.RESIDENT
    assert len(measured["text_encoder_3"].resident_blocks) > len(before["text_encoder_3"].resident_blocks)
    assert plan_residency(sd3, 14 * GB, 3 * GB, None, needs, timings=timing, incumbent=before.components) == measured


def test_a_timing_of_no_component_is_ignored_with_a_plan_in_place() -> None:
    # A residency profile edited by hand may time a component the pipeline does not have.
    timing = _flux_timing(0.174)
    before = plan_residency(FLUX, 16 * GB, 3 * GB, None, FLUX_ACTIVATIONS, timings=timing)
    ghost = {**_flux_timing(0.174 * 1.1), "ghost": timing["transformer"]}
    again = plan_residency(FLUX, 16 * GB, 3 * GB, None, FLUX_ACTIVATIONS, timings=ghost, incumbent=before.components)
    assert again["transformer"].resident_blocks == before["transformer"].resident_blocks


@pytest.mark.parametrize("budget", [16 * GB, 8 * GB])
def test_a_bus_bound_step_loads_one_block_ahead_and_keeps_the_slot_it_frees(budget: int, monkeypatch) -> None:
    # FLUX.1-dev's double-stream block loads in 13 ms at 52.6 GB/s and computes in about 5 ms: the
    # bus sets the pace with one block in flight as with two, and the second one's 680 MB slot can
    # hold blocks that do not move at every step. Compute-bound (ten times slower), the window
    # stays deep.
    blocks = FLUX[2].block_bytes
    activations = {"text_encoder": 291 * MB, "text_encoder_2": 463 * MB, "transformer": 1114 * MB, "vae": 3417 * MB}
    bus_bound = StepTiming(compute_per_byte=0.182 / sum(blocks), load_per_byte=1 / 52.6e9)
    compute_bound = StepTiming(compute_per_byte=1.82 / sum(blocks), load_per_byte=1 / 52.6e9)

    def planned(timing: StepTiming):
        plan = plan_residency(FLUX, budget, 1 * GB, activations=activations, timings={"transformer": timing})
        assert plan.peak_bytes <= budget, str(plan)
        return plan["transformer"]

    def kept(transformer) -> frozenset[int]:
        return transformer.resident_blocks | transformer.staged_blocks

    def moved(transformer) -> int:
        return sum(nbytes for i, nbytes in enumerate(blocks) if i not in kept(transformer))

    assert planned(compute_bound).prefetch_blocks == PREFETCH_BLOCKS
    shallow = planned(bus_bound)
    monkeypatch.setattr("diffusers_residency.planner.PREFETCH_CHOICES", (PREFETCH_BLOCKS,))
    deep = planned(bus_bound)
    assert deep.prefetch_blocks == PREFETCH_BLOCKS and shallow.prefetch_blocks == 1, (deep, shallow)
    assert moved(shallow) <= moved(deep) - 680 * MB
    step = simulated_step_seconds(blocks, kept(shallow), 1, bus_bound)
    assert step < simulated_step_seconds(blocks, kept(deep), PREFETCH_BLOCKS, bus_bound) - 0.005


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


def _stage_blocks_one_by_one(plans, by_name, room):
    """The staged-block rule block by block, largest first (then in order), each trial checked
    whole: what the planner's count from a component's transient room must agree with."""
    from dataclasses import replace

    for name, plan in plans.items():
        sizes = by_name[name]
        if plan.policy is not Policy.STREAMED or not sizes.per_step:
            continue
        streamed = [i for i in range(len(sizes.block_bytes)) if i not in plan.resident_blocks]
        for index in sorted(streamed, key=lambda i: (-sizes.block_bytes[i], i)):
            trial = {**plans, name: replace(plans[name], staged_blocks=plans[name].staged_blocks | {index})}
            if room.fits(trial):
                plans = trial
    return plans


def test_staged_blocks_counted_from_the_room_are_those_block_by_block_would_keep(monkeypatch) -> None:
    activations = {"text_encoder": 89 * MB, "text_encoder_2": 303 * MB, "transformer": 954 * MB, "vae": 3100 * MB}
    timing = {"transformer": StepTiming(compute_per_byte=0.17 / 22.5e9, load_per_byte=1 / 52e9)}

    def plans() -> list:
        untimed = [plan_residency(FLUX, b * GB // 4, 3 * GB, activations=activations) for b in range(24, 130, 3)]
        return untimed + [plan_residency(FLUX, b * GB, 3 * GB, activations=activations, timings=timing) for b in (9, 14)]

    def plans_of_two_denoisers_and_a_timed_encoder() -> list:
        # Two per-step components (as Wan 2.2's two experts), each staging in the room the other
        # leaves; and a once-per-call component given a timing, whose blocks are never staged.
        experts = (
            ComponentSizes("transformer", 14 * GB, (350 * MB,) * 40, True),
            ComponentSizes("transformer_2", 14 * GB, (350 * MB,) * 38 + (120 * MB,) * 4, True),
            ComponentSizes("vae", 250 * MB, (10 * MB,) * 12),
        )
        needs = {"transformer": 2 * GB, "transformer_2": 2 * GB, "vae": 5 * GB}
        steps = {name: StepTiming(compute_per_byte=0.3 / (14 * GB), load_per_byte=1 / 52e9) for name in needs}
        two = [plan_residency(experts, b * GB, 1 * GB, activations=needs, timings=steps) for b in (10, 13, 16, 19)]
        encoder = ComponentSizes("text_encoder", 1200 * MB, (200 * MB, 300 * MB, 100 * MB, 300 * MB, 300 * MB))
        timed = {"text_encoder": StepTiming(compute_per_byte=1e-12, load_per_byte=1e-10)}
        return two + [plan_residency([encoder], 1000 * MB, 0, {"text_encoder": Policy.STREAMED}, timings=timed)]

    def plans_with_empty_blocks() -> list:
        # A repeated block with no weights of its own: it stages for free, wherever the rest fits.
        sizes = (ComponentSizes("transformer", 600 * MB, (100 * MB,) * 6 + (0, 0), True),)
        return [plan_residency(sizes, b * MB, 100 * MB) for b in (400, 450, 500, 650, 800)]

    def every_trial_staged_whole(plans, name, by_name, room, timing):
        # A search's trials staged as whole plans, block by block: the planner stages each from
        # its own plan and the transient room the others leave it (see _step_seconds_of).
        from dataclasses import replace

        sizes = by_name[name]

        def seconds(resident, depth, _resident_bytes):
            trial = replace(plans[name], resident_blocks=resident, prefetch_blocks=depth, staged_blocks=frozenset())
            staged = _stage_blocks_one_by_one({**plans, name: trial}, by_name, room)[name]
            return simulated_step_seconds(sizes.block_bytes, resident | staged.staged_blocks, depth, timing)

        return seconds

    counted = plans()
    empty = plans_with_empty_blocks()
    others = plans_of_two_denoisers_and_a_timed_encoder()
    monkeypatch.setattr("diffusers_residency.kept_blocks.stage_blocks", _stage_blocks_one_by_one)
    monkeypatch.setattr("diffusers_residency.kept_blocks._step_seconds_of", every_trial_staged_whole)
    assert counted == plans()
    assert empty == plans_with_empty_blocks()
    assert others == plans_of_two_denoisers_and_a_timed_encoder()
    assert any(plan["transformer"].staged_blocks for plan in counted), "some budget stages blocks"
    assert any(plan["transformer"].staged_blocks and plan["transformer_2"].staged_blocks for plan in others[:-1])


def test_a_search_checks_its_choices_fit_as_the_whole_plan_would() -> None:
    # The search over a streamed component's resident blocks works the others' part of the
    # device's peak out once (Room.fits_as, Room.transient_room_as): each choice must fit
    # exactly where the whole plan with it does, beside resident others (whose moments count the
    # largest transient bytes), staged and streamed ones, at every window depth, and leave its
    # staged blocks the room the whole plan would.
    from diffusers_residency import kept_blocks, planner

    by_name = {s.name: s for s in FLUX}
    needs = {"text_encoder": 89 * MB, "text_encoder_2": 303 * MB, "transformer": 954 * MB, "vae": 3100 * MB}
    transformer = by_name["transformer"]
    others = [
        {"text_encoder": Policy.RESIDENT, "text_encoder_2": Policy.STREAMED, "vae": Policy.RESIDENT},
        {"text_encoder": Policy.STAGED, "text_encoder_2": Policy.STREAMED, "vae": Policy.STAGED},
        {"text_encoder": Policy.RESIDENT, "text_encoder_2": Policy.RESIDENT, "vae": Policy.RESIDENT},
    ]
    outcomes, rooms = set(), set()
    for budget in (8 * GB, 12 * GB, 16 * GB, 30 * GB):
        room = kept_blocks.Room(by_name, budget, needs.__getitem__)
        for policies in others:
            plans = {name: planner._as_given(by_name[name], policy) for name, policy in policies.items()}
            plans["transformer"] = planner._streamed(transformer)
            for depth in (1, 2):
                fits = room.fits_as(plans, "transformer")
                transient_room = room.transient_room_as(plans, "transformer")
                for resident, resident_bytes, transient in kept_blocks.resident_block_choices(transformer, depth):
                    trial = {**plans, "transformer": ComponentPlan("transformer", Policy.STREAMED, resident, depth)}
                    assert fits(transformer.trunk_bytes + resident_bytes, transient) == room.fits(trial)
                    # And the room its staged blocks are chosen in, as the whole plan leaves it.
                    room_left = transient_room(transformer.trunk_bytes + resident_bytes)
                    assert room_left == room.transient_room(trial, "transformer")
                    outcomes.add(room.fits(trial))
                    rooms.add(room_left > 0)
    assert outcomes == rooms == {True, False}


def test_timings_a_few_percent_apart_choose_the_same_resident_blocks() -> None:
    # A step timed on the device moves by a few percent from call to call and process to process,
    # and near-equal choices' simulated steps move past each other with it: at 16 GB, compute
    # steps of 0.178, 0.183 and 0.188 s picked three sets of resident blocks, each as fast.
    blocks = FLUX[2].block_bytes
    activations = {"text_encoder": 291 * MB, "text_encoder_2": 463 * MB, "transformer": 1114 * MB, "vae": 3417 * MB}
    chosen = set()
    for compute in (0.178, 0.183, 0.188):
        timing = StepTiming(compute_per_byte=compute / sum(blocks), load_per_byte=1 / 53e9)
        plan = plan_residency(FLUX, 16 * GB, 1 * GB, activations=activations, timings={"transformer": timing})
        transformer = plan["transformer"]
        chosen.add((transformer.resident_blocks, transformer.prefetch_blocks))
    assert len(chosen) == 1, chosen


def test_a_timed_plan_stops_at_a_step_no_choice_can_beat_and_chooses_as_the_whole_search() -> None:
    # No step is shorter than its compute: a choice that keeps every block ends the search. At 30
    # GB the whole transformer fits, and each search of its resident blocks simulates one step
    # where it simulated every fitting choice (docs/benchmarks.md); the plans chosen are those of
    # the whole search.
    activations = {"text_encoder": 409 * MB, "text_encoder_2": 623 * MB, "transformer": 1070 * MB, "vae": 3417 * MB}
    # As a pipeline replans once measured: its hooks keep what streamed streaming.
    streamed = {s.name: Policy.STREAMED for s in FLUX}
    blocks = FLUX[2].block_bytes
    simulated = []

    def counted(*args):
        simulated.append(args)
        return simulated_step_seconds(*args)

    def slower(*args):
        # Every step twice as long (exactly, in binary): the same choices, and none near the
        # compute alone, so no search stops.
        simulated.append(args)
        return simulated_step_seconds(*args) * 2

    def plans() -> list:
        return [
            plan_residency(FLUX, budget * GB // 2, 3 * GB, streamed, activations, timings={"transformer": timing})
            for budget in range(14, 80, 5)
            for timing in (
                StepTiming(compute_per_byte=0.174 / sum(blocks), load_per_byte=1 / 54.6e9),
                # Nearly compute-bound: searches stop, some at their first choice, some later.
                StepTiming(compute_per_byte=0.3 / sum(blocks), load_per_byte=1 / 54.6e9),
                StepTiming(compute_per_byte=1.74 / sum(blocks), load_per_byte=1 / 54.6e9),
            )
        ]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("diffusers_residency.kept_blocks._simulated_step_seconds", counted)
        timing = StepTiming(compute_per_byte=0.174 / sum(blocks), load_per_byte=1 / 54.6e9)
        at_30gb = plan_residency(FLUX, 30 * GB, 3 * GB, streamed, activations, timings={"transformer": timing})
    assert len(at_30gb["transformer"].resident_blocks) == len(blocks), str(at_30gb)
    # One trial for each of the plan's three searches of the transformer's resident blocks, the
    # second search's trial the first's again (the others' plans unchanged): simulated once.
    assert len(simulated) == 2, f"{len(simulated)} steps simulated"
    simulated.clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("diffusers_residency.kept_blocks._simulated_step_seconds", counted)
        stopping, stopping_steps = plans(), len(simulated)
    simulated.clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("diffusers_residency.kept_blocks._simulated_step_seconds", slower)
        assert plans() == stopping
    assert stopping_steps < len(simulated) / 2, (stopping_steps, len(simulated))
