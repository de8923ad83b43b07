"""Weights that change after enable_pinned_offload: LoRA adapters, fused projections, replaced
parameters. Each change is made on the host masters and staged like the weights it joins."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from diffusers_residency import ModuleStager, _device
from diffusers_residency.pipeline import pipeline_state

from .helpers import RESERVE, PipelineCase, assert_weights_equal, enable_with_transformer, streaming_budget

peft = pytest.importorskip("peft")


def lora_state_dict(case: PipelineCase) -> dict[str, torch.Tensor]:
    """A LoRA for the transformer's attention projections, made here with non-zero weights."""
    donor = PipelineCase(case.kind).pipe.transformer
    torch.manual_seed(1)
    donor.add_adapter(
        peft.LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v"], init_lora_weights=False)
    )
    return {f"transformer.{k}": v for k, v in peft.utils.get_peft_model_state_dict(donor).items()}


def assert_every_weight_staged(pipe, name: str) -> None:
    """Every tensor of the component has a master, and a load moves every one of them."""
    group = pipe.__dict__["_pinned_residency"].group
    unit = next(u for u in group.units if u.name == name)
    group.activate(unit)
    loaded = {id(t): t.data_ptr() for t in unit.module.parameters()}
    unit.stager.offload()
    assert unit.stager.masters_current()
    assert all(t.data_ptr() != loaded[id(t)] for t in unit.module.parameters()), "a weight was not staged"


def test_lora_loaded_fused_and_unloaded_after_enable(flux: PipelineCase) -> None:
    lora = lora_state_dict(flux)
    resident = PipelineCase("flux")
    resident.pipe.load_lora_weights(lora, adapter_name="style")
    expected = resident.run()
    assert not torch.equal(expected, flux.reference), "the LoRA must change the output for this test to mean anything"

    flux.pipe.enable_pinned_offload(device="cpu")
    flux.run()
    flux.pipe.load_lora_weights(lora, adapter_name="style")
    assert torch.equal(flux.run(), expected)
    assert_every_weight_staged(flux.pipe, "transformer")

    resident.pipe.fuse_lora()
    flux.pipe.fuse_lora()
    assert torch.equal(flux.run(), resident.run())
    resident.pipe.unfuse_lora()
    flux.pipe.unfuse_lora()
    resident.pipe.unload_lora_weights()
    flux.pipe.unload_lora_weights()
    assert torch.equal(flux.run(), resident.run())


def test_fused_qkv_projections_after_enable(flux: PipelineCase) -> None:
    resident = PipelineCase("flux")
    resident.pipe.transformer.fuse_qkv_projections()
    flux.pipe.enable_pinned_offload(device="cpu")
    flux.run()
    flux.pipe.transformer.fuse_qkv_projections()
    assert torch.equal(flux.run(), resident.run())
    assert_every_weight_staged(flux.pipe, "transformer")


def test_a_submodule_cast_is_staged_not_undone(flux: PipelineCase) -> None:
    flux.pipe.enable_pinned_offload(device="cpu")
    flux.run()
    flux.pipe.transformer.proj_out.to(torch.float64)
    group = flux.pipe.__dict__["_pinned_residency"].group
    unit = next(u for u in group.units if u.name == "transformer")
    group.activate(unit)
    assert flux.pipe.transformer.proj_out.weight.dtype == torch.float64
    unit.stager.offload()
    assert flux.pipe.transformer.proj_out.weight.dtype == torch.float64
    flux.pipe.transformer.proj_out.to(torch.float32)
    assert torch.equal(flux.run(), flux.reference)


def second_lora(case: PipelineCase) -> dict[str, torch.Tensor]:
    """Another LoRA of the same shape and rank, with different weights."""
    torch.manual_seed(2)
    return {key: torch.randn_like(value) * 0.05 for key, value in lora_state_dict(case).items()}


def test_adapters_switched_weighted_and_deleted_after_enable(flux: PipelineCase) -> None:
    loras = {"style": lora_state_dict(flux), "detail": second_lora(flux)}
    resident = PipelineCase("flux")
    flux.pipe.enable_pinned_offload(device="cpu")
    flux.run()
    for case in (resident, flux):
        for name, lora in loras.items():
            case.pipe.load_lora_weights(lora, adapter_name=name)

    steps = [
        lambda pipe: pipe.set_adapters(["style", "detail"], adapter_weights=[0.7, 0.4]),
        lambda pipe: pipe.set_adapters("detail"),
        lambda pipe: pipe.disable_lora(),
        lambda pipe: pipe.enable_lora(),
        lambda pipe: pipe.delete_adapters("detail"),
    ]
    outputs = set()
    for step in steps:
        step(resident.pipe)
        step(flux.pipe)
        expected = resident.run()
        assert torch.equal(flux.run(), expected)
        outputs.add(expected.sum().item())
    assert len(outputs) >= 3, "the steps must change the output for this test to mean anything"
    assert_every_weight_staged(flux.pipe, "transformer")


def test_adapter_hotswapped_between_calls(flux: PipelineCase) -> None:
    first, second = lora_state_dict(flux), second_lora(flux)
    resident = PipelineCase("flux")
    flux.pipe.enable_pinned_offload(device="cpu")
    for case in (resident, flux):
        case.pipe.load_lora_weights(first, adapter_name="style")
        case.run()
        case.pipe.load_lora_weights(second, adapter_name="style", hotswap=True)
    expected = resident.run()
    assert torch.equal(flux.run(), expected)
    with_second = PipelineCase("flux")
    with_second.pipe.load_lora_weights(second, adapter_name="style")
    assert torch.equal(expected, with_second.run()), "hotswapping must give the second adapter's output"


FP8 = torch.float8_e4m3fn


def storage_bytes(module: torch.nn.Module) -> int:
    return sum(t.untyped_storage().nbytes() for t in {id(t): t for t in module.parameters()}.values())


@pytest.mark.parametrize("order", ["casting-then-offload", "offload-then-casting"])
def test_layerwise_casting_keeps_fp8_storage_on_host_and_device(flux: PipelineCase, order: str) -> None:
    resident = PipelineCase("flux")
    resident.pipe.transformer.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.float32)
    expected = resident.run()
    assert not torch.equal(expected, flux.reference), (
        "fp8 storage must change the output for this test to mean anything"
    )

    transformer = flux.pipe.transformer
    if order == "casting-then-offload":
        transformer.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.float32)
        flux.pipe.enable_pinned_offload(device="cpu")
    else:
        flux.pipe.enable_pinned_offload(device="cpu")
        flux.run()
        transformer.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.float32)
    for _ in range(2):
        assert torch.equal(flux.run(), expected)
        report = flux.pipe.residency_report()
        assert report["transformer"].weight_bytes == storage_bytes(transformer), "masters hold the fp8 bytes"
        assert any(t.dtype == FP8 for t in transformer.parameters())
    assert_every_weight_staged(flux.pipe, "transformer")


def resident_transformer(case: PipelineCase) -> None:
    """Pinned offload with the transformer resident: on the device from its first call on."""
    case.pipe.enable_pinned_offload(device="cpu", components={"transformer": "resident"})
    case.run()
    group = case.pipe.__dict__["_pinned_residency"].group
    assert next(u for u in group.units if u.name == "transformer").stager.loaded


def cast_to_storage_dtype(transformer: torch.nn.Module) -> None:
    """Cast to FP8 the weights that layerwise casting would store in FP8 (as it casts those of a
    twin: it leaves some, norms among them, as they were), without enabling it."""
    twin = PipelineCase("flux").pipe.transformer
    twin.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.float32)
    with torch.no_grad():
        for name, cast in twin.named_parameters():
            if cast.dtype == FP8:
                transformer.get_parameter(name).data = transformer.get_parameter(name).data.to(FP8)


@pytest.mark.parametrize("order", ["casting-then-offload", "offload-then-casting", "casting-in-its-storage-dtype"])
def test_layerwise_casting_lets_the_loaded_copies_it_replaces_go(
    flux: PipelineCase, order: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Layerwise casting moves each cast weight to storage of its own at every forward and leaves
    the others (norms, embeddings) where the load put them. Loaded into one buffer, those would keep
    every replaced copy's memory too, for as long as the component stays on the device."""
    transformer = flux.pipe.transformer

    def assert_load_let_go(load) -> None:
        """After ``load()`` (a load of the transformer) and a call, the load holds no more than
        the weights the casting left in place."""
        loads: list[tuple[int, StorageWeakRef]] = []
        allocate = _device.allocate_device_storage

        def recorded(nbytes: int, device: torch.device, *, alignment: int) -> torch.Tensor:
            storage = allocate(nbytes, device, alignment=alignment)
            loads.append((nbytes, StorageWeakRef(storage.untyped_storage())))
            return storage

        with monkeypatch.context() as patch:
            patch.setattr(_device, "allocate_device_storage", recorded)
            load()
        flux.run()
        gc.collect()
        alive = sum(nbytes for nbytes, ref in loads if not ref.expired())
        tensors = {id(t): t for t in [*transformer.parameters(), *transformer.buffers()]}.values()
        left_in_place = sum(t.untyped_storage().nbytes() for t in tensors if t.dtype != FP8)
        assert any(t.dtype == FP8 for t in tensors) and alive <= left_in_place, (
            f"{alive} bytes of the load still held, for {left_in_place} bytes of weights the casting left in place"
        )

    if order == "casting-then-offload":
        transformer.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.float32)
    if order == "casting-in-its-storage-dtype":
        # Weights of the storage dtype when their masters are taken: enabling the casting after
        # replaces none of them, only its forwards show it.
        cast_to_storage_dtype(transformer)
        flux.pipe.enable_pinned_offload(device="cpu", components={"transformer": "resident"})
        transformer.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.float32)
        flux.pipe.sleep(offload=["transformer"])  # not loaded yet: its wake is its first load
        assert_load_let_go(lambda: flux.pipe.wake_up(["transformer"]))  # and it is never offloaded after
    else:
        resident_transformer(flux)  # its first load, before casting in the other order
    if order == "offload-then-casting":
        transformer.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.float32)
        flux.pipe.sleep(offload=["transformer"])  # loaded again, now with casting on
        flux.pipe.wake_up()
    flux.pipe.sleep(offload=["transformer"])
    assert_load_let_go(lambda: flux.pipe.wake_up(["transformer"]))  # a load of the transformer alone


def test_layerwise_casting_enabled_on_weights_of_its_storage_dtype_reaches_streamed_blocks(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Enabled after the masters were taken, on weights already of its storage dtype, the casting
    replaces no weight: a streamed block's stager learns it at the offload after its first forward
    (weights moved to storage of their own), and its later loads allocate per storage, not one
    buffer that the weights left in place would keep whole."""
    resident = PipelineCase("flux")
    for case in (resident, flux):
        cast_to_storage_dtype(case.pipe.transformer)
    resident.pipe.transformer.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.float32)
    expected = resident.run()
    enable_with_transformer(flux, "streamed")
    flux.pipe.transformer.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.float32)
    assert torch.equal(flux.run(), expected)

    sizes: list[int] = []
    recording = []
    allocate = _device.allocate_device_storage

    def recorded(nbytes: int, device: torch.device, *, alignment: int) -> torch.Tensor:
        if recording:
            sizes.append(nbytes)
        return allocate(nbytes, device, alignment=alignment)

    transformer = flux.pipe.transformer
    transformer.register_forward_pre_hook(lambda module, args: recording.append(True))
    transformer.register_forward_hook(lambda module, args, output: recording.clear())
    monkeypatch.setattr(_device, "allocate_device_storage", recorded)
    assert torch.equal(flux.run(), expected)
    largest = max(t.untyped_storage().nbytes() for t in [*transformer.parameters(), *transformer.buffers()])
    assert sizes and max(sizes) <= largest, f"a load of {max(sizes)} bytes, where no weight takes more than {largest}"


def test_lora_fused_hotswapped_and_unfused_on_a_loaded_component_survive_its_offload(flux: PipelineCase) -> None:
    first, second = lora_state_dict(flux), second_lora(flux)
    resident = PipelineCase("flux")
    resident_transformer(flux)
    steps = [
        lambda pipe: pipe.load_lora_weights(first, adapter_name="style"),
        lambda pipe: pipe.fuse_lora(),
        lambda pipe: pipe.unfuse_lora(),
        lambda pipe: pipe.load_lora_weights(second, adapter_name="style", hotswap=True),
        lambda pipe: pipe.fuse_lora(),
    ]
    for step in steps:
        step(resident.pipe)
        step(flux.pipe)
        expected = resident.run()
        assert torch.equal(flux.run(), expected)
        flux.pipe.sleep(offload=["transformer"])  # the resident transformer leaves the device
        flux.pipe.wake_up()
        assert torch.equal(flux.run(), expected), "the change reached the masters"


def test_layerwise_casting_enabled_on_a_loaded_component_survives_its_offload(flux: PipelineCase) -> None:
    resident = PipelineCase("flux")
    resident.pipe.transformer.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.float32)
    expected = resident.run()
    resident_transformer(flux)
    flux.pipe.transformer.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.float32)
    assert torch.equal(flux.run(), expected)
    flux.pipe.sleep(offload=["transformer"])
    assert any(t.dtype == FP8 and t.device.type == "cpu" for t in flux.pipe.transformer.parameters())
    flux.pipe.wake_up()
    assert torch.equal(flux.run(), expected)


@pytest.mark.parametrize("policy", ["resident", "streamed"])
def test_a_weight_written_while_loaded_under_layerwise_casting_survives_its_offload(
    flux: PipelineCase, policy: str
) -> None:
    # Layerwise casting moved every weight to new storage at the call's forwards; the write after
    # it moved them is a write all the same.
    resident = PipelineCase("flux")
    for case in (resident, flux):
        case.pipe.transformer.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.float32)
    enable_with_transformer(flux, policy)
    flux.run()
    for case in (resident, flux):
        transformer = case.pipe.transformer
        halved = {key: (value.float() * 0.5).to(value.dtype) for key, value in transformer.state_dict().items()}
        transformer.load_state_dict(halved)
    expected = resident.run()
    flux.pipe.sleep(offload=["transformer"])
    flux.pipe.wake_up()
    assert torch.equal(flux.run(), expected)
    flux.pipe.disable_pinned_offload()
    assert_weights_equal(resident.state(), flux.state())


def test_layers_added_while_loaded_get_masters_as_their_component_sleeps(flux: PipelineCase) -> None:
    # fuse_qkv_projections makes its fused layers where the loaded weights are (on the device):
    # a sleep takes masters for them, as for the weights it had.
    resident = PipelineCase("flux")
    resident_transformer(flux)
    for case in (resident, flux):
        case.pipe.transformer.fuse_qkv_projections()
    expected = resident.run()
    flux.pipe.sleep(offload=["transformer"])
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in flux.pipe.transformer.state_dict().values()}
    assert flux.pipe.residency_report()["transformer"].weight_bytes == sum(s.nbytes() for s in storages.values())
    flux.pipe.wake_up()
    assert torch.equal(flux.run(), expected)
    flux.pipe.disable_pinned_offload()
    assert_weights_equal(resident.state(), flux.state())


def test_a_component_fused_directly_while_loaded_keeps_the_fusion(flux: PipelineCase) -> None:
    lora = lora_state_dict(flux)
    resident = PipelineCase("flux")
    resident_transformer(flux)
    for case in (resident, flux):
        case.pipe.load_lora_weights(lora, adapter_name="style")
        case.run()
        case.pipe.transformer.fuse_lora()  # the component's own method, not the pipeline's
    expected = resident.run()
    flux.pipe.sleep(offload=["transformer"])
    flux.pipe.wake_up()
    assert torch.equal(flux.run(), expected)
    flux.pipe.disable_pinned_offload()
    assert "fuse_lora" not in flux.pipe.transformer.__dict__ and "fuse_lora" not in flux.pipe.__dict__


def test_layerwise_casting_on_a_staged_component_keeps_its_masters_call_after_call(flux: PipelineCase) -> None:
    flux.pipe.transformer.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.float32)
    flux.pipe.enable_pinned_offload(device="cpu")
    flux.run()
    masters = {name: t.data_ptr() for name, t in flux.pipe.transformer.named_parameters()}
    with torch.inference_mode():  # as pipelines run: casts inside make inference tensors
        for _ in range(2):
            flux.run()
    # Cast up and back down at every forward: equal values in new storage, not new masters.
    assert {name: t.data_ptr() for name, t in flux.pipe.transformer.named_parameters()} == masters
    assert not any(t.is_inference() for t in flux.pipe.transformer.parameters())


def test_a_cast_while_loaded_under_inference_mode_leaves_ordinary_parameters(flux: PipelineCase) -> None:
    resident_transformer(flux)
    with torch.inference_mode():
        flux.pipe.transformer.proj_out.to(torch.float64)  # replaced while loaded, under inference mode
    flux.pipe.sleep(offload=["transformer"])
    assert flux.pipe.transformer.proj_out.weight.dtype == torch.float64
    assert not any(t.is_inference() for t in flux.pipe.transformer.parameters())
    flux.pipe.wake_up()


def _written_weights(pipe, subset: bool) -> dict[str, dict[str, torch.Tensor]]:
    """New values for the transformer's and the VAE's weights (``subset``: a few layers only)."""
    torch.manual_seed(2)
    chosen = {}
    for name in ("transformer", "vae"):
        state = getattr(pipe, name).state_dict()
        keys = [k for k in state if ("to_q" in k or "conv_out" in k)] if subset else list(state)
        chosen[name] = {k: state[k] * 1.01 + 0.01 * torch.randn_like(state[k]) for k in keys if state[k].is_floating_point()}
    return chosen


def _loading_new_weights(subset: bool) -> Callable[[Any], None]:
    """``load_state_dict`` of new values for the transformer's and the VAE's weights (see
    :func:`_written_weights`), the same for any pipeline with the same weights."""

    def load(pipe) -> None:
        for name, weights in _written_weights(pipe, subset).items():
            getattr(pipe, name).load_state_dict(weights, strict=False)

    return load


def _assert_kept_as_resident(policy: str, change: Callable[[Any], None], inference: bool = False) -> None:
    """``change`` made to a pipeline's weights after a call, with units of the transformer or the VAE
    still loaded, leaves the next calls and the weights after disable as the same change leaves a
    resident pipeline; ``inference``: both loaded and changed under ``torch.inference_mode()``."""
    with torch.inference_mode(inference):
        offloaded, resident = PipelineCase("flux"), PipelineCase("flux")
        change(resident.pipe)
    expected = resident.run()
    assert not torch.equal(expected, offloaded.reference), "the change must change the output"

    enable_with_transformer(offloaded, policy)
    offloaded.run()
    loaded = [u for u in pipeline_state(offloaded.pipe).group.units if u.stager.loaded]
    assert {u.component for u in loaded} & {"transformer", "vae"}, "a unit must be loaded"
    assert any(u.stager.loaded_versionless for u in loaded) == inference, "inference tensors loaded where made so"
    with torch.inference_mode(inference):
        change(offloaded.pipe)
    assert torch.equal(offloaded.run(), expected)
    assert torch.equal(offloaded.run(), expected)
    offloaded.pipe.disable_pinned_offload()
    assert_weights_equal(resident.state(), offloaded.state())
    assert torch.equal(offloaded.run(), expected)


@pytest.mark.parametrize("subset", [False, True], ids=["all", "subset"])
@pytest.mark.parametrize("policy", ["resident", "staged", "streamed"])
def test_load_state_dict_into_a_loaded_component_is_kept(policy: str, subset: bool) -> None:
    """``load_state_dict`` writes into whatever the weights are bound to, a device copy for a loaded
    unit (the VAE after a call, a resident transformer or its resident blocks): the offload copies
    what was written back into the masters, so the next call and the state after disable carry it."""
    _assert_kept_as_resident(policy, _loading_new_weights(subset))


def _lora_layers(pipe) -> list[torch.nn.Module]:
    return [m for m in pipe.transformer.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]


# Changes to an adapter's merging, each made with the transformer's units as a call leaves them
# (loaded where resident), after the set-up before it: peft writes them through ``weight.data``.
ADAPTER_MERGES = {
    # A disabled layer still merged unmerges in its next forward, on whatever its weights are bound to.
    "disable_lora after fuse_lora": (lambda pipe: pipe.fuse_lora(), lambda pipe: pipe.disable_lora()),
    # peft's own merge, on each layer, where no guarded method runs.
    "merge() on each layer": (lambda pipe: None, lambda pipe: [m.merge() for m in _lora_layers(pipe)]),
    # peft unmerges before it sets the new adapter active, and adds its layers' tensors.
    "add_adapter after fuse_lora": (
        lambda pipe: pipe.fuse_lora(),
        lambda pipe: (torch.manual_seed(2), pipe.transformer.add_adapter(
            peft.LoraConfig(r=2, target_modules=["to_q"], init_lora_weights=False), adapter_name="other"
        )),
    ),
    # A pipeline made from the enabled one has no guards of its own; its unfuse unmerges each layer.
    "unfuse_lora of a from_pipe pipeline": (
        lambda pipe: pipe.fuse_lora(),
        lambda pipe: type(pipe).from_pipe(pipe).unfuse_lora(),
    ),
}


@pytest.mark.parametrize("merge", ADAPTER_MERGES)
@pytest.mark.parametrize("policy", ["resident", "staged", "streamed"])
def test_an_adapter_merged_or_unmerged_while_loaded_is_kept(policy: str, merge: str) -> None:
    """peft merges and unmerges through ``.data``, moving no version counter, at times no guarded
    method sees: each layer's merged adapters tell the offload which loaded weights were written."""
    offloaded, resident = PipelineCase("flux"), PipelineCase("flux")
    lora = lora_state_dict(resident)
    enable_with_transformer(offloaded, policy)
    set_up, change = ADAPTER_MERGES[merge]
    for case in (resident, offloaded):
        case.pipe.load_lora_weights(lora, adapter_name="style")
        set_up(case.pipe)
        case.run()
        change(case.pipe)
    for _ in range(2):
        assert torch.equal(offloaded.run(), resident.run())
    assert [m.merged_adapters for m in _lora_layers(offloaded.pipe)] == [m.merged_adapters for m in _lora_layers(resident.pipe)]
    offloaded.pipe.disable_pinned_offload()
    assert_weights_equal(resident.state(), offloaded.state())
    assert torch.equal(offloaded.run(), resident.run())


@pytest.mark.parametrize("policy", ["resident", "staged"])
def test_load_state_dict_into_loaded_inference_weights_is_kept(policy: str) -> None:
    """Weights loaded under ``torch.inference_mode()`` are inference tensors, without the version
    counters that show an offload what was written while loaded: ``load_state_dict`` runs with the
    component offloaded, into its masters."""
    _assert_kept_as_resident(policy, _loading_new_weights(subset=False), inference=True)


def _given_storage_of_their_own(how: str) -> Callable[[Any], None]:
    """Give the VAE's decoder and the transformer's first block storage of their own with their
    layout: cast there and back through bfloat16 (which rounds), or assigned anew."""

    def give(pipe) -> None:
        for module in (pipe.vae.decoder, pipe.transformer.transformer_blocks[0]):
            if how == "cast":
                module.to(torch.bfloat16)
                module.to(torch.float32)
            else:
                for weight in module.parameters():
                    weight.data = weight.detach() * 1.5

    return give


@pytest.mark.parametrize("inference", [False, True], ids=["ordinary", "inference"])
@pytest.mark.parametrize("how", ["cast", "assigned"])
@pytest.mark.parametrize("policy", ["resident", "staged", "streamed"])
def test_weights_given_storage_of_their_own_while_loaded_are_kept(policy: str, how: str, inference: bool) -> None:
    """A tensor moved to storage of its own with its dtype, shape and stride, on a component without
    layerwise casting (whose moves leave the masters' values), holds the weights now: the offload
    copies it back into its master rather than binding the master again; an inference tensor
    through an inference view."""
    _assert_kept_as_resident(policy, _given_storage_of_their_own(how), inference)


def test_an_ordinary_offload_copies_nothing_back(flux: PipelineCase, monkeypatch: pytest.MonkeyPatch) -> None:
    copied_back: list[int] = []
    keep_writes = ModuleStager._keep_writes
    monkeypatch.setattr(
        ModuleStager, "_keep_writes", lambda self, written: copied_back.append(len(written)) or keep_writes(self, written)
    )
    flux.pipe.enable_pinned_offload("cpu", vram_budget=streaming_budget(flux), activation_reserve=RESERVE)
    for _ in range(2):
        assert torch.equal(flux.run(), flux.reference)
    assert copied_back == []
    # The same values, written all the same: into the masters of the VAE's units that are offloaded,
    # into the device copies of those still loaded after the call.
    flux.pipe.vae.load_state_dict(flux.pipe.vae.state_dict())
    assert torch.equal(flux.run(), flux.reference)
    loaded_after_a_call = copied_back[:]
    assert 0 < sum(loaded_after_a_call) < len(flux.pipe.vae.state_dict()), "only tensors written while loaded"
    assert torch.equal(flux.run(), flux.reference)
    assert copied_back == loaded_after_a_call, "copied back once"


def test_a_weight_relaid_in_place_while_loaded_keeps_its_new_layout() -> None:
    """``t_()`` on a loaded weight changes its stride where the load put it, and moves its counter:
    the offload keeps it as replaced (a copy into its master's old layout would fail), and the unit
    goes on loading and offloading."""
    offloaded, resident = PipelineCase("flux"), PipelineCase("flux")
    square = [
        name
        for name, module in resident.pipe.transformer.named_modules()
        if isinstance(module, torch.nn.Linear) and module.weight.shape[0] == module.weight.shape[1]
    ][:2]
    assert square, "the tiny transformer must have a square linear layer"

    def transpose(pipe) -> None:
        with torch.no_grad():
            for name in square:
                pipe.transformer.get_submodule(name).weight.t_()

    transpose(resident.pipe)
    expected = resident.run()
    assert not torch.equal(expected, offloaded.reference), "the transposed weights must change the output"
    offloaded.pipe.enable_pinned_offload("cpu", components={"transformer": "resident"}, vram_budget=None)
    offloaded.run()
    unit = next(u for u in pipeline_state(offloaded.pipe).group.units if u.name == "transformer")
    assert unit.stager.loaded
    transpose(offloaded.pipe)
    unit.stager.offload()
    assert not unit.stager.loaded
    assert torch.equal(offloaded.run(), expected)
    assert torch.equal(offloaded.run(), expected)
    offloaded.pipe.disable_pinned_offload()
    assert_weights_equal(resident.state(), offloaded.state())
    assert torch.equal(offloaded.run(), expected)
