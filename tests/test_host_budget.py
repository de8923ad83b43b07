"""A host budget: masters beyond it served from the pipeline's checkpoint files (see host_budget)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from diffusers_residency import machine_memory, pinning, ring
from diffusers_residency.bench.builders import call_kwargs, pipeline_output
from diffusers_residency.checkpoints import checkpoint_views
from diffusers_residency.host_budget import HostBudgetTooSmallError, place_on_host, resolve_host_budget
from diffusers_residency.machine_memory import cgroup_memory_limit
from diffusers_residency.pipeline import pipeline_state
from diffusers_residency.plans import ComponentPlan, ComponentSizes, ResidencyPlan
from diffusers_residency.policy import Policy

from .helpers import (
    PipelineCase,
    assert_no_meta_or_foreign_device,
    assert_weights_equal,
    sdxl_in_float16,
    staging_hooks,
)

GiB = 2**30

# The tiny FLUX pipeline: text_encoder 207 kB, text_encoder_2 914 kB, transformer 671 kB, vae 195 kB.
# Each setup: the enable arguments, a host budget, and which components (or blocks) it serves from files.
SETUPS = {
    # Resident text encoders and VAE: read from their files once; the resident denoiser never.
    "resident": (dict(vram_budget=None, components=dict.fromkeys(["text_encoder", "text_encoder_2", "transformer", "vae"], "resident")), "1.7MB", {"text_encoder", "text_encoder_2", "vae"}),
    # Every component staged: the largest ones until the rest fits, the denoiser included.
    "staged": (dict(vram_budget=None), "1.5MB", {"text_encoder_2", "transformer"}),
    # Streamed: the once-per-call components first, then the denoiser's streamed blocks.
    "streamed": (dict(vram_budget="2GB", components={"transformer": "streamed"}), "0.75MB", {"text_encoder", "text_encoder_2", "vae", "transformer"}),
}  # fmt: skip


def served(pipe) -> dict[str, int]:
    """Bytes of each component's masters that are views of its files."""
    return {c.name: c.mapped_bytes for c in pipe.residency_report().components if c.mapped_bytes}


@pytest.mark.parametrize("setup", SETUPS)
def test_masters_served_from_files_load_exactly(flux: PipelineCase, setup: str) -> None:
    kwargs, budget, expected = SETUPS[setup]
    before = flux.state()
    flux.pipe.enable_pinned_offload(device="cpu", host_budget=budget, **kwargs)
    plan = flux.pipe.residency_plan()
    assert set(served(flux.pipe)) == expected, str(plan)
    assert plan.host.ram_bytes <= plan.host.budget
    report = flux.pipe.residency_report()
    ram = sum(c.pinned_bytes + c.pageable_bytes for c in report.components)
    assert ram <= plan.host.budget - plan.host.ring_bytes, str(report)
    # What stays in RAM of a served component (CLIP's non-persistent position_ids) is the plan's too.
    assert ram + plan.host.ring_bytes <= plan.host.ram_bytes, f"{plan.host}\n{report}"
    if setup == "resident":
        assert "transformer" not in served(flux.pipe), "a resident denoiser stays in RAM"
        assert "transformer: in RAM: a denoiser kept on the device" in str(plan)
    if setup == "streamed":
        transformer = plan.host.blocks["transformer"]
        assert transformer and not transformer & plan["transformer"].resident_blocks
    assert "host budget" in str(plan) and "served from checkpoint files" in str(plan)
    for _ in range(2):
        assert torch.equal(flux.run(), flux.reference)
    report = flux.pipe.residency_report()
    assert all(report[name].read_gbps is not None for name in expected if report[name].loads), str(report)
    flux.pipe.disable_pinned_offload()
    assert_no_meta_or_foreign_device(flux.pipe)
    assert_weights_equal(before, flux.state())
    assert torch.equal(flux.run(), flux.reference)
    # Left as views of their files, one storage each: served from them again by a new enable.
    flux.pipe.enable_pinned_offload(device="cpu", host_budget=budget, **kwargs)
    assert set(served(flux.pipe)) == expected
    assert torch.equal(flux.run(), flux.reference)


def test_what_no_file_holds_of_a_served_block_is_counted_in_ram(flux: PipelineCase) -> None:
    # A buffer no checkpoint holds, in every block of the denoiser: the blocks served from files
    # keep it in RAM, and the plan's RAM figure counts it.
    blocks = [*flux.pipe.transformer.transformer_blocks, *flux.pipe.transformer.single_transformer_blocks]
    for block in blocks:
        block.register_buffer("cached_table", torch.zeros(4 << 10), persistent=False)
    reference = flux.run()
    kwargs, _, _ = SETUPS["streamed"]
    flux.pipe.enable_pinned_offload(device="cpu", host_budget="0.9MB", **kwargs)
    plan = flux.pipe.residency_plan()
    assert plan.host.blocks["transformer"], str(plan)
    report = flux.pipe.residency_report()
    ram = sum(c.pinned_bytes + c.pageable_bytes for c in report.components)
    assert ram + plan.host.ring_bytes <= plan.host.ram_bytes <= plan.host.budget, f"{plan.host}\n{report}"
    assert torch.equal(flux.run(), reference)


def _nudge_transformer(pipe) -> None:
    with torch.no_grad():
        for parameter in pipe.transformer.parameters():
            parameter.view(-1)[0].add_(1.0)


def test_a_pipeline_enabled_under_inference_mode_loads_a_served_weight_written_in_place(flux: PipelineCase) -> None:
    # Its written pages are the process's own now: a reader thread copies them into a slot of the
    # ring, outside the inference mode the ring was made in.
    kwargs, budget, expected = SETUPS["staged"]
    with torch.inference_mode():
        flux.pipe.enable_pinned_offload(device="cpu", host_budget=budget, **kwargs)
    assert "transformer" in served(flux.pipe)
    assert torch.equal(flux.run(), flux.reference)
    changed = PipelineCase("flux")
    _nudge_transformer(changed.pipe)
    _nudge_transformer(flux.pipe)
    for _ in range(2):
        assert torch.equal(flux.run(), changed.run())


def test_a_sharded_checkpoint_is_served_from_its_shards_beside_an_older_single_file(
    flux: PipelineCase, tmp_path: Path
) -> None:
    from diffusers import FluxPipeline

    flux.pipe.save_pretrained(tmp_path)
    with torch.no_grad():
        for parameter in flux.pipe.transformer.parameters():
            parameter.mul_(0.5)
    flux.pipe.save_pretrained(tmp_path, max_shard_size="150KB")  # the single file of before stays
    assert (tmp_path / "transformer" / "diffusion_pytorch_model.safetensors").exists()
    pipe = FluxPipeline.from_pretrained(tmp_path)
    reference = pipeline_output(pipe, call_kwargs("flux"))
    kwargs, budget, _ = SETUPS["staged"]
    pipe.enable_pinned_offload(device="cpu", host_budget=budget, **kwargs)
    assert "transformer" in served(pipe)
    assert torch.equal(pipeline_output(pipe, call_kwargs("flux")), reference)


@pytest.mark.parametrize("dtype", [torch.float16, torch.uint32])
def test_weights_of_odd_sizes_or_dtypes_are_served_from_an_offload_folder(
    flux: PipelineCase, tmp_path: Path, dtype: torch.dtype
) -> None:
    # Three float16 values before float32 weights would leave those at offsets no float32 view
    # starts at, had the file not put the widest first.
    flux.pipe.transformer.proj_out.register_buffer("odd", torch.arange(3).to(dtype))
    reference = flux.run()
    kwargs, budget, _ = SETUPS["staged"]
    flux.pipe.enable_pinned_offload(device="cpu", host_budget=budget, offload_folder=tmp_path, **kwargs)
    assert served(flux.pipe)["transformer"] == flux.pipe.residency_report()["transformer"].weight_bytes
    assert torch.equal(flux.run(), reference)


def test_a_weight_of_a_dtype_no_file_holds_is_refused_a_budget_that_would_serve_it(
    flux: PipelineCase, tmp_path: Path
) -> None:
    flux.pipe.transformer.proj_out.register_buffer("phase", torch.zeros(2, dtype=torch.complex64))
    kwargs, budget, _ = SETUPS["staged"]
    with pytest.raises(ValueError, match="or of a dtype no safetensors file holds"):
        flux.pipe.enable_pinned_offload(device="cpu", host_budget=budget, offload_folder=tmp_path, **kwargs)
    assert not staging_hooks(flux.pipe)


def test_a_served_weight_written_after_enable_is_counted_in_ram_and_told(
    flux: PipelineCase, caplog: pytest.LogCaptureFixture
) -> None:
    kwargs, budget, _ = SETUPS["staged"]
    flux.pipe.enable_pinned_offload(device="cpu", host_budget=budget, **kwargs)
    assert torch.equal(flux.run(), flux.reference)
    before = flux.pipe.residency_report()["transformer"]
    assert before.mapped_bytes == before.weight_bytes and before.pageable_bytes == 0
    changed = PipelineCase("flux")
    for pipe in (changed.pipe, flux.pipe):  # into the offloaded masters, files' pages for the transformer
        state = pipe.transformer.state_dict()
        pipe.transformer.load_state_dict({k: v * 1.5 if v.is_floating_point() else v for k, v in state.items()})
    assert "put 671.23 kB of them in RAM beyond what the budget planned for" in caplog.text
    after = flux.pipe.residency_report()["transformer"]
    assert after.mapped_bytes == 0 and after.pageable_bytes == before.weight_bytes, str(flux.pipe.residency_report())
    assert torch.equal(flux.run(), changed.run())


def test_auto_with_room_changes_nothing(flux: PipelineCase) -> None:
    flux.pipe.enable_pinned_offload(device="cpu", host_budget="auto")
    plan = flux.pipe.residency_plan()
    assert not plan.host.serves_files and "served from checkpoint files" in str(plan)
    assert served(flux.pipe) == {}
    assert pipeline_state(flux.pipe).group.file_backing == {}
    assert torch.equal(flux.run(), flux.reference)


@pytest.mark.parametrize(
    ("value", "error"),
    [(-1, ValueError), ("lots", ValueError), (1.5, ValueError), (True, TypeError), ("1kB", HostBudgetTooSmallError)],
)
def test_bad_host_budget_is_refused_before_anything_changes(flux: PipelineCase, value, error) -> None:
    with pytest.raises(error):
        flux.pipe.enable_pinned_offload(device="cpu", host_budget=value)
    assert pipeline_state(flux.pipe) is None
    assert torch.equal(flux.run(), flux.reference)


def test_auto_reads_the_cgroup_limit_then_physical_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine_memory, "physical_memory_bytes", lambda: 64 * GiB)
    monkeypatch.setattr(machine_memory, "cgroup_memory_limit", lambda: 8 * GiB)
    assert resolve_host_budget("auto") == 6 * GiB  # less 2 GiB, more than a tenth
    assert resolve_host_budget(0.25) == 2 * GiB  # a fraction of what the container allows
    assert pinning.resolve_pin_budget(None) == 6 * GiB  # 75 % of it
    monkeypatch.setattr(machine_memory, "cgroup_memory_limit", lambda: None)
    assert resolve_host_budget("auto") == 64 * GiB - int(6.4 * GiB)  # less a tenth
    assert resolve_host_budget(0.25) == 16 * GiB
    assert resolve_host_budget("16GB") == 16 * 10**9 and resolve_host_budget(None) is None


def _cgroup_tree(tmp_path: Path, mounts: list[str], cgroups: list[str], limits: dict[str, str]) -> Path:
    """A /proc/self of ``cgroup`` and ``mountinfo`` lines, the mounts under ``tmp_path`` (``{root}``
    in a line), and limit files written there."""
    proc = tmp_path / "proc"
    proc.mkdir(parents=True)
    escaped = str(tmp_path).replace(" ", "\\040")  # as mountinfo writes a space
    (proc / "mountinfo").write_text("\n".join(line.format(root=escaped) for line in mounts) + "\n")
    (proc / "cgroup").write_text("\n".join(cgroups) + "\n")
    for relative, value in limits.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(value + "\n")
    return proc


def test_cgroup_limits_set_above_the_process_are_read(tmp_path: Path) -> None:
    # cgroup v2 under Kubernetes: the pod's cgroup has the limit, the container's own says "max".
    proc = _cgroup_tree(
        tmp_path / "v2 mounted",
        ["30 23 0:26 / {root}/cg rw,nosuid - cgroup2 cgroup2 rw"],
        ["0::/kubepods/pod1/container"],
        {"cg/kubepods/pod1/memory.max": str(8 * GiB), "cg/kubepods/pod1/container/memory.max": "max"},
    )
    assert cgroup_memory_limit(proc) == 8 * GiB
    # A hybrid host: v2 mounted at unified/ without the memory controller, v1's memory controller
    # mounted with a Docker container's cgroup as its root; a tighter limit on the leaf wins.
    proc = _cgroup_tree(
        tmp_path / "v1",
        [
            "31 23 0:28 / {root}/unified rw - cgroup2 cgroup2 rw",
            "35 23 0:32 /docker/abc {root}/memory rw,relatime - cgroup cgroup rw,memory",
            "36 23 0:33 /docker/abc {root}/cpu rw,relatime - cgroup cgroup rw,cpu",
        ],
        ["4:memory:/docker/abc/inner", "1:cpu:/docker/abc", "0::/"],
        {
            "memory/memory.limit_in_bytes": str(6 * GiB),
            "memory/inner/memory.limit_in_bytes": str(5 * GiB),
            "cpu/memory.limit_in_bytes": str(1 * GiB),  # not the memory controller's: ignored
            "unified/memory.max": str(1 * GiB),  # the process's v2 cgroup is the mount's top
        },
    )
    assert cgroup_memory_limit(proc) == min(5 * GiB, 1 * GiB)
    # v1's "no limit" figure, and v2's "max", are none; so is a system without the files.
    proc = _cgroup_tree(
        tmp_path / "none",
        ["35 23 0:32 / {root}/memory rw - cgroup cgroup rw,memory"],
        ["4:memory:/a"],
        {"memory/a/memory.limit_in_bytes": "9223372036854771712"},
    )
    assert cgroup_memory_limit(proc) is None
    assert cgroup_memory_limit(tmp_path / "missing") is None


def _plan(*components: tuple[ComponentSizes, ComponentPlan]) -> ResidencyPlan:
    return ResidencyPlan(None, 0, tuple(p for _, p in components), tuple(s for s, _ in components))


def test_placement_serves_the_least_loaded_first_and_never_the_denoisers_resident_blocks() -> None:
    GB = 10**9
    denoiser = ComponentSizes("transformer", 10 * GB + GB // 2, (GB,) * 10, per_step=True)
    encoder = ComponentSizes("text_encoder", 3 * GB, ())
    kept = ComponentSizes("image_encoder", 2 * GB, ())
    plan = _plan(
        (kept, ComponentPlan("image_encoder", Policy.RESIDENT)),
        (encoder, ComponentPlan("text_encoder", Policy.STAGED)),
        (denoiser, ComponentPlan("transformer", Policy.STREAMED, resident_blocks=frozenset({0, 5}), staged_blocks=frozenset({3}))),
    )  # fmt: skip
    total = 15 * GB + GB // 2
    assert not place_on_host(plan, total).serves_files
    # A ring of 1 GiB at most for loads read once or once a call, of two loads and a slot each
    # (1 GiB a load at most) where blocks stream at every step, so that the next one is read while
    # this one is copied, a load of two runs in its file (a chunk more) included.
    slot = 32 << 20
    once = ring.ring_bytes(ring.ring_shape([(2 * GB, False), (3 * GB, False)]))
    again = ring.ring_bytes(ring.ring_shape([(2 * GB, False), (3 * GB, False), (GB, True)]))
    assert once == 1 << 30 and again == 2 * (-(-GB // slot) + 1) * slot
    assert ring.ring_bytes(ring.ring_shape([(3 * GB, True)])) == 2 * ((1 << 30) + slot)
    # Slots sized by the streamed blocks: a ring of two small blocks is not two of the largest load,
    # whose slots are still at least a 64th of it; empty loads need no slot.
    assert ring.ring_shape([(3 << 20, True), (1 << 20, True)]) == (3 << 20, 4)
    assert ring.ring_shape([(1 << 20, True), (100 << 20, False)]) == ((100 << 20) // 64, 64)
    assert ring.ring_shape([(0, True), (10 * GB, False)]) == ring.ring_shape([(10 * GB, False)]) == (slot, 32)
    # Kept on the device first, then loaded once per call, then the staged block, then streamed
    # blocks, the later first.
    steps = [
        (2, {"image_encoder"}, set(), once),
        (5, {"image_encoder", "text_encoder"}, set(), once),
        (6, {"image_encoder", "text_encoder"}, {3}, once),
        # The first streamed block saves less than the ring's second load costs: two of them.
        (8, {"image_encoder", "text_encoder"}, {3, 9, 8}, again),
    ]
    for served_gb, components, positions, ring_bytes in steps:
        placement = place_on_host(plan, total - served_gb * GB + ring_bytes)
        assert placement.components == components and placement.blocks.get("transformer", frozenset()) == positions
        assert placement.file_bytes == served_gb * GB and placement.ram_bytes == total - served_gb * GB + ring_bytes
        assert placement.ring_bytes == ring_bytes
    placement = place_on_host(plan, 5 * GB)
    assert not placement.blocks["transformer"] & {0, 5}, "resident blocks stay in RAM"
    with pytest.raises(HostBudgetTooSmallError, match="lower vram_budget"):
        place_on_host(plan, 3 * GB)  # the trunk and two resident blocks are 2.5 GB, and the ring


def test_a_component_its_calls_cast_stays_in_ram_with_its_cast_masters() -> None:
    """SDXL's VAE is cast to float32 and back in every call: the cast converts its masters on the
    host and keeps the results, memory of their own whether the first ones are a file's or not."""
    GB = 10**9
    vae = ComponentSizes("vae", GB, ())
    encoder = ComponentSizes("text_encoder", 2 * GB, ())
    plan = _plan((encoder, ComponentPlan("text_encoder", Policy.STAGED)), (vae, ComponentPlan("vae", Policy.STAGED)))
    upcast = {"vae": (torch.float32, torch.float16)}
    assert place_on_host(plan, 11 * GB // 2, {}).components == set(), "without the cast, it all fits"
    # With it, 6 GB: the VAE's float32 masters are 2, and the copy of its own its casts compare with 1.
    placement = place_on_host(plan, 11 * GB // 2, upcast)
    assert placement.components == {"text_encoder"} and placement.ram_bytes == 4 * GB + placement.ring_bytes
    assert "float32, float16" in placement.reasons["vae"]
    with pytest.raises(HostBudgetTooSmallError, match="components its calls cast"):
        place_on_host(plan, 9 * GB // 2, upcast)


def test_sdxl_under_a_host_budget_keeps_its_vae_and_its_float32_masters_within_it(tmp_path: Path) -> None:
    sdxl = sdxl_in_float16()
    sizes = {name: sum(t.nbytes for t in module.state_dict().values()) for name, module in sdxl.pipe.components.items()
             if isinstance(module, torch.nn.Module)}  # fmt: skip
    # Room for every float16 master and half the VAE's float32 ones: something else is served instead.
    budget = sum(sizes.values()) + sizes["vae"]
    sdxl.pipe.enable_pinned_offload("cpu", host_budget=budget, vram_budget=None, offload_folder=tmp_path)
    placement = sdxl.pipe.residency_plan().host
    assert placement.serves_files and "vae" not in placement.components and "float32" in placement.reasons["vae"]
    for _ in range(2):
        assert torch.equal(sdxl.run(), sdxl.reference)
    report = {c.name: c for c in sdxl.pipe.residency_report().components}
    # Its float16 masters, its float32 ones, and the copy of the float16 ones its casts compare with.
    assert report["vae"].pinned_bytes + report["vae"].pageable_bytes == 4 * sizes["vae"]
    in_ram = sum(c.pinned_bytes + c.pageable_bytes for c in report.values())
    assert in_ram + placement.ring_bytes <= budget


def _not_from_files(flux: PipelineCase, tmp_path: Path) -> None:
    flux.pipe.register_to_config(_name_or_path=str(tmp_path / "nowhere"))


def test_a_pipeline_not_loaded_from_files_is_refused_or_written_once(flux: PipelineCase, tmp_path: Path) -> None:
    _not_from_files(flux, tmp_path)
    before = flux.state()
    with pytest.raises(ValueError, match="offload_folder"):
        flux.pipe.enable_pinned_offload(device="cpu", host_budget="1.5MB", vram_budget=None)
    assert pipeline_state(flux.pipe) is None
    assert_weights_equal(before, flux.state())
    folder = tmp_path / "cache"
    flux.pipe.enable_pinned_offload(device="cpu", host_budget="1.5MB", vram_budget=None, offload_folder=folder)
    written = {path: path.stat().st_mtime_ns for path in folder.glob("*/*.safetensors")}
    assert {path.parent.name for path in written} == {"text_encoder_2", "transformer"}
    assert set(served(flux.pipe)) == {"text_encoder_2", "transformer"}
    assert torch.equal(flux.run(), flux.reference)
    flux.pipe.disable_pinned_offload()
    flux.pipe.enable_pinned_offload(device="cpu", host_budget="1.5MB", vram_budget=None, offload_folder=folder)
    assert {path: path.stat().st_mtime_ns for path in folder.glob("*/*.safetensors")} == written, "written once"
    assert torch.equal(flux.run(), flux.reference)
    assert not list(folder.glob("*/*.partial"))


def test_a_pipeline_with_no_folder_at_all_is_told_so(flux: PipelineCase) -> None:
    flux.pipe.register_to_config(_name_or_path="")  # as built in code
    with pytest.raises(ValueError, match="have no files: the pipeline was not loaded from a folder. Pass offload_folder="):
        flux.pipe.enable_pinned_offload(device="cpu", host_budget="1.5MB", vram_budget=None)
    assert pipeline_state(flux.pipe) is None


def test_a_weight_changed_since_loading_is_never_served_from_its_old_file(flux: PipelineCase, tmp_path: Path) -> None:
    weight = max(flux.pipe.transformer.parameters(), key=torch.Tensor.numel)
    with torch.no_grad():
        weight.mul_(-1.0)
    expected = flux.run()
    with pytest.raises(ValueError, match="changed since loading"):
        flux.pipe.enable_pinned_offload(device="cpu", host_budget="1.5MB", vram_budget=None)
    flux.pipe.enable_pinned_offload(device="cpu", host_budget="1.5MB", vram_budget=None, offload_folder=tmp_path)
    assert torch.equal(flux.run(), expected)


def test_a_file_changed_under_a_served_master_is_refused(flux: PipelineCase) -> None:
    flux.pipe.enable_pinned_offload(device="cpu", host_budget="1.5MB", vram_budget=None)
    assert torch.equal(flux.run(), flux.reference)
    (written,) = (Path(flux.pipe.name_or_path) / "transformer").glob("*.safetensors")
    stamp = os.stat(written)
    os.utime(written, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 10**9))  # as a save into the folder would
    with pytest.raises(RuntimeError, match="changed since the pipeline's weights were mapped from it"):
        flux.run()
    # A cast reads the masters where they are, on the host: refused the same way, before it reads
    # them (a file cut short would end the process there).
    with pytest.raises(RuntimeError, match="changed since the pipeline's weights were mapped from it"):
        flux.pipe.transformer.to(torch.float64)
    assert {weight.dtype for weight in flux.pipe.transformer.parameters()} == {torch.float32}
    assert_no_meta_or_foreign_device(flux.pipe)
    os.utime(written, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert torch.equal(flux.run(), flux.reference)


def test_a_cast_of_a_streamed_component_with_a_block_file_changed_converts_nothing(
    flux: PipelineCase, tmp_path: Path
) -> None:
    # Its trunk's masters are in RAM, blocks of it served from a file: every unit's file is checked
    # before any converts, or the component would be left half cast.
    _not_from_files(flux, tmp_path)
    flux.pipe.enable_pinned_offload(
        device="cpu", host_budget="0.75MB", vram_budget="2GB", components={"transformer": "streamed"},
        offload_folder=tmp_path,
    )  # fmt: skip
    assert flux.pipe.residency_plan().host.blocks.get("transformer"), "blocks served from files"
    assert torch.equal(flux.run(), flux.reference)
    (written,) = (tmp_path / "transformer").glob("*.safetensors")
    stamp = os.stat(written)
    os.utime(written, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 10**9))
    with pytest.raises(RuntimeError, match="changed since the pipeline's weights were mapped from it"):
        flux.pipe.transformer.to(torch.float64)
    assert {weight.dtype for weight in flux.pipe.transformer.parameters()} == {torch.float32}
    os.utime(written, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert torch.equal(flux.run(), flux.reference)


def test_a_cast_by_hand_of_a_served_component_warns_once_that_it_takes_ram(
    flux: PipelineCase, caplog: pytest.LogCaptureFixture
) -> None:
    flux.pipe.enable_pinned_offload(device="cpu", host_budget="1.5MB", vram_budget=None)
    assert "transformer" in flux.pipe.residency_plan().host.components
    flux.pipe.to(torch.float32)  # every weight float32 already: nothing converts
    assert "host_budget serves" not in caplog.text
    flux.pipe.transformer.to(torch.float64)
    flux.pipe.transformer.to(torch.float32)
    said = [r.getMessage() for r in caplog.records if "host_budget serves" in r.getMessage()]
    assert len(said) == 1 and "'transformer'" in said[0], said
    assert torch.equal(flux.run(), flux.reference)


def test_a_lora_fused_after_enable_is_served_from_ram(flux: PipelineCase, monkeypatch: pytest.MonkeyPatch) -> None:
    from .test_changing_weights import lora_state_dict

    lora = lora_state_dict(flux)
    resident = PipelineCase("flux")
    resident.pipe.load_lora_weights(lora, adapter_name="style")
    resident.pipe.fuse_lora()
    expected = resident.run()
    flux.pipe.enable_pinned_offload(device="cpu", host_budget=SETUPS["streamed"][1], **SETUPS["streamed"][0])
    assert flux.pipe.residency_plan().host.blocks["transformer"]
    reads: list[tuple[int, int]] = []
    real = ring.read_into

    def recorded(file, offset, targets):
        if Path(file.path).parent.name == "transformer":
            reads.append((offset, offset + sum(len(t) for t in targets)))
        return real(file, offset, targets)

    monkeypatch.setattr(ring, "read_into", recorded)
    flux.run()
    assert reads, "the blocks served from files load from them"
    # The file's bytes of every weight the LoRA is fused into: no load may read them from the file.
    views = checkpoint_views(Path(flux.pipe.name_or_path) / "transformer", flux.pipe.transformer)
    fused = [
        views[id(weight)]
        for name, weight in flux.pipe.transformer.named_parameters()
        if name.rsplit(".", 2)[-2] in ("to_q", "to_k", "to_v") and name.endswith("weight")
    ]
    assert any(low < view.offset + view.view.numel() and view.offset < high for view in fused for low, high in reads)
    flux.pipe.load_lora_weights(lora, adapter_name="style")
    flux.pipe.fuse_lora()
    reads.clear()
    assert torch.equal(flux.run(), expected)
    assert served(flux.pipe)["transformer"], "the rest of the blocks is still served from the file"
    for view in fused:
        start, end = view.offset, view.offset + view.view.numel()
        assert not any(low < end and start < high for low, high in reads), "a fused weight was read from its file"


def test_a_load_from_files_that_fails_leaves_the_masters_and_the_next_call_is_exact(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    kwargs, budget, _ = SETUPS["streamed"]
    flux.pipe.enable_pinned_offload(device="cpu", host_budget=budget, **kwargs)
    assert torch.equal(flux.run(), flux.reference)
    real = ring.Ring.copy

    def failing(self, sources, targets):
        raise OSError("injected: the disk went away")

    monkeypatch.setattr(ring.Ring, "copy", failing)
    with pytest.raises(OSError, match="injected"):
        flux.run()
    assert_no_meta_or_foreign_device(flux.pipe)
    monkeypatch.setattr(ring.Ring, "copy", real)
    assert torch.equal(flux.run(), flux.reference)
    flux.pipe.disable_pinned_offload()
    assert torch.equal(flux.run(), flux.reference)


def test_weights_sharing_one_storage_are_refused_a_budget_that_would_serve_them(flux: PipelineCase) -> None:
    # As a loader that converts dtypes may leave them: every weight a view into one flat storage.
    text_encoder_2 = flux.pipe.text_encoder_2
    weights = list(text_encoder_2.parameters())
    flat = torch.cat([w.detach().reshape(-1) for w in weights])
    offset = 0
    for weight in weights:
        weight.data = flat[offset : offset + weight.numel()].view_as(weight)
        offset += weight.numel()
    before = flux.state()
    with pytest.raises(ValueError, match="share"):
        flux.pipe.enable_pinned_offload(device="cpu", host_budget="1.7MB", **SETUPS["resident"][0])
    assert pipeline_state(flux.pipe) is None
    assert_weights_equal(before, flux.state())
    assert torch.equal(flux.run(), flux.reference)
