"""Real pipelines built offline, their resident outputs, and the assertions the tests share."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import pytest
import torch

from diffusers_residency import BudgetTooSmallError, StagingHook, _device, block_timing, conversions
from diffusers_residency.bench.builders import build_pipeline, call_kwargs, pipeline_output
from diffusers_residency.components import component_sizes, module_components
from diffusers_residency.pipeline import pipeline_state
from diffusers_residency.planner import plan_residency
from diffusers_residency.policy import Policy
from diffusers_residency.weights import stored_tensors


class PipelineCase:
    """A freshly built pipeline, how to call it, and what it produced fully resident."""

    # Every case still alive: a failed test's case lives on in its traceback.
    live: weakref.WeakSet[PipelineCase] = weakref.WeakSet()

    def __init__(self, kind: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        PipelineCase.live.add(self)
        self.kind = kind
        self.pipe = build_pipeline(kind, "tiny", dtype=dtype, device=device)
        self.reference = self.run()

    def run(self) -> torch.Tensor:
        return pipeline_output(self.pipe, call_kwargs(self.kind, "tiny"))

    def state(self) -> dict[str, dict[str, torch.Tensor]]:
        """A detached copy of every component's weights (the plain tensors that hold a quantized
        weight's bytes, for one), to compare bit for bit later."""
        return {
            name: {
                key: tuple(stored.detach().clone() for stored in stored_tensors(value))
                for key, value in module.state_dict(keep_vars=True).items()
            }
            for name, module in self.pipe.components.items()
            if isinstance(module, torch.nn.Module)
        }


def sdxl_in_float16() -> PipelineCase:
    """A float16 SDXL, whose calls cast the VAE to float32 to decode and back. Its reference call
    cast it under inference mode, which left the VAE's parameters inference tensors, without
    version counters: a round trip outside it gives them back as ``from_pretrained`` makes them."""
    case = PipelineCase("sdxl", dtype=torch.float16)
    case.pipe.vae.to(torch.float32)
    case.pipe.vae.to(torch.float16)
    return case


def vae_through_bfloat16(pipe, step: int, timestep, callback_kwargs: dict) -> dict:
    """A step callback casting the VAE to float32, bfloat16, float32 and float16 again at the first
    step: a round trip through a dtype narrower than float16's values (bfloat16 rounds)."""
    if step == 0:
        for dtype in (torch.float32, torch.bfloat16, torch.float32, torch.float16):
            pipe.vae.to(dtype=dtype)
    return callback_kwargs


def staging_hooks(pipe) -> dict[str, StagingHook]:
    return {
        name: module._hf_hook
        for name, module in pipe.components.items()
        if isinstance(getattr(module, "_hf_hook", None), StagingHook)
    }


def assert_weights_equal(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for name in before:
        assert before[name].keys() == after[name].keys(), name
        for key, value in before[name].items():
            assert len(value) == len(after[name][key]), f"{name}.{key} changed"
            assert all(torch.equal(a, b) for a, b in zip(value, after[name][key])), f"{name}.{key} changed"


def assert_no_meta_or_foreign_device(pipe, device: str = "cpu") -> None:
    for name, module in pipe.components.items():
        if isinstance(module, torch.nn.Module):
            for key, tensor in list(module.named_parameters()) + list(module.named_buffers()):
                assert tensor.device.type == device, f"{name}.{key} on {tensor.device}"


def record_comparisons(monkeypatch, what: Callable[[torch.Tensor], object]) -> list:
    """Spy on the comparisons of kept masters (``conversions.same_bits``): ``what(fresh)`` for each,
    in order."""
    recorded = []
    same_bits = conversions.same_bits

    def recording(kept: torch.Tensor, fresh: torch.Tensor) -> bool:
        recorded.append(what(fresh))
        return same_bits(kept, fresh)

    monkeypatch.setattr(conversions, "same_bits", recording)
    return recorded


def dtypes_compared(monkeypatch) -> list[torch.dtype]:
    """The dtype of each comparison of kept masters (see record_comparisons)."""
    return record_comparisons(monkeypatch, lambda fresh: fresh.dtype)


def threads_comparing(monkeypatch) -> list[threading.Thread]:
    """The thread each comparison of kept masters ran on (see record_comparisons)."""
    return record_comparisons(monkeypatch, lambda fresh: threading.current_thread())


def count_device_allocations(monkeypatch) -> list[int]:
    """Spy on the one point where stagers allocate device storage: the sizes allocated, in order."""
    sizes: list[int] = []
    allocate = _device.allocate_device_storage

    def counted(nbytes: int, device: torch.device, *, alignment: int) -> torch.Tensor:
        sizes.append(nbytes)
        return allocate(nbytes, device, alignment=alignment)

    monkeypatch.setattr(_device, "allocate_device_storage", counted)
    return sizes


# Where a process has no accelerator: a CPU build of torch, or a CUDA build on a machine with no GPU.
WITHOUT_AN_ACCELERATOR = ("cpu build", "cuda build without a gpu")


def build_without_an_accelerator(monkeypatch, build: str) -> None:
    """Stand in for ``build`` (one of WITHOUT_AN_ACCELERATOR) on this CPU machine. A CUDA build with no
    GPU differs from a CPU build at one point: current_accelerator() names cuda unless asked whether it
    is available."""
    if build == "cuda build without a gpu":

        def current_accelerator(check_available: bool = False) -> torch.device | None:
            return None if check_available else torch.device("cuda")

        monkeypatch.setattr(torch.accelerator, "current_accelerator", current_accelerator)


RESERVE = 1000  # bytes: the tiny pipeline's weights are under a megabyte


def record_block_runs(monkeypatch) -> list[tuple[torch.nn.Module, int]]:
    """Each run outside a call of a block or a module of a trunk (``block_timing``'s timing and
    warm-up) that did not raise, as the module and how many times it ran."""
    made: list[tuple[torch.nn.Module, int]] = []
    run = block_timing._run

    def recorded(module, specs, device, runs: int) -> float:
        seconds = run(module, specs, device, runs)
        made.append((module, runs))  # a run that raised is none
        return seconds

    monkeypatch.setattr(block_timing, "_run", recorded)
    return made


def warmed_encoders(pipe) -> list[torch.nn.Module]:
    """What the warm-up runs of the encoders the default call's dry run ran before its denoiser (see
    ``block_timing.warm_encoders``), in order: one hooked whole itself, one streamed the block of
    each layout and the trunk's modules that the dry run recorded."""
    state = pipeline_state(pipe)
    forward = state.dry_runs.forward
    # Told apart from what warm_encoders reads: the tests' pipelines (FLUX, SDXL) have two text
    # encoders, each run before the denoiser, CLIP first.
    assert list(forward.default_encoder_inputs) == ["text_encoder", "text_encoder_2"], forward.default_encoder_inputs
    runs: list[torch.nn.Module] = []
    for name in forward.default_encoder_inputs:
        stream, module = state.group.stream_of(name), getattr(pipe, name)
        if stream is None:
            runs += [module] if state.group.units_of(name) else []
        elif name in forward.default_encoder_blocks:
            recorded = forward.default_encoder_blocks[name]
            runs += [stream.blocks[position].module for position, _ in recorded.first.values()]
            runs += [module.get_submodule(path) for path, _ in recorded.trunk.values()]
    return runs


def assert_warmed_once_per_layout(made: list[tuple[torch.nn.Module, int]], pipe) -> None:
    """One untimed run of one block of each of the denoiser's layouts, then of each module of its
    trunk that the default call's dry run ran, once per layout and inputs, then of each whole
    encoder, as a pipeline is enabled from a profile (see ``block_timing.warm_kernels`` and
    ``warm_encoders``)."""
    state = pipeline_state(pipe)
    inputs = state.dry_runs.forward.default_blocks
    blocks = [unit.module for unit in state.group.stream_of(state.dry_runs.denoiser).blocks]
    denoiser = getattr(pipe, state.dry_runs.denoiser)
    trunk = [denoiser.get_submodule(path) for path, _ in inputs.trunk.values()]
    before = warmed_encoders(pipe)
    expected = len(inputs.first) + len(trunk) + len(before)
    assert [runs for _, runs in made] == [1] * expected, f"one untimed run of each: {made}"
    ran = [module for module, _ in made]
    ran_blocks, ran_trunk = ran[: len(inputs.first)], ran[len(inputs.first) : len(inputs.first) + len(trunk)]
    assert inputs.first and len({id(module) for module in ran_blocks}) == len(inputs.first), made
    assert all(any(module is block for block in blocks) for module in ran_blocks), "blocks of the stream"
    assert len(ran_trunk) == len(trunk) > 1 and all(a is b for a, b in zip(ran_trunk, trunk)), made
    assert all(a is b for a, b in zip(ran[len(inputs.first) + len(trunk) :], before)), made


def streaming_budget(flux: PipelineCase, reserve: int = RESERVE, fixed: dict[str, str] | None = None) -> int:
    """The largest budget under which the transformer streams with some blocks resident."""
    sizes = component_sizes(flux.pipe, module_components(flux.pipe))
    fixed = {name: Policy(policy) for name, policy in (fixed or {}).items()}
    total = sum(s.nbytes for s in sizes)
    blocks = len(next(s for s in sizes if s.name == "transformer").block_bytes)
    for budget in range(total + reserve, reserve, -1024):
        try:
            plan = plan_residency(sizes, budget, reserve, fixed=fixed)
        except BudgetTooSmallError:
            break
        transformer = plan["transformer"]
        if transformer.policy is Policy.STREAMED and 0 < len(transformer.resident_blocks) < blocks:
            return budget
    pytest.fail("no budget streams the transformer behind a resident prefix")


def enable_with_transformer(case: PipelineCase, policy: str) -> None:
    """Enable on the CPU with the transformer ``resident`` or ``staged`` (no budget), or ``streamed``
    under the budget that streams it behind a resident prefix of its blocks."""
    if policy == "streamed":
        case.pipe.enable_pinned_offload("cpu", vram_budget=streaming_budget(case), activation_reserve=RESERVE)
        plan = case.pipe.residency_plan()
        assert plan["transformer"].policy is Policy.STREAMED and plan["transformer"].resident_blocks, str(plan)
    else:
        case.pipe.enable_pinned_offload("cpu", components={"transformer": policy}, vram_budget=None)
