"""ModuleStager on its own: storages, aliases and layouts survive every transition."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

from diffusers_residency import ModuleStager, _device, staging
from diffusers_residency.conversions import same_bits
from diffusers_residency.files import MappedBytes
from diffusers_residency.placement import DeviceSlots
from diffusers_residency.weights import module_tensors

from .helpers import count_device_allocations

CPU = torch.device("cpu")


class SharedStorage(nn.Module):
    """Tensors that share one storage in every way a checkpoint can: a tied pair of Parameter
    objects, a slice with an offset, a transposed (non-contiguous) view, a reinterpreted dtype."""

    def __init__(self) -> None:
        super().__init__()
        base = torch.arange(48, dtype=torch.float32)
        self.first = nn.Parameter(base[:24].view(4, 6), requires_grad=False)
        self.second = nn.Parameter(base[24:].view(6, 4).t(), requires_grad=False)
        self.tied = self.first  # the same Parameter object under two names
        self.register_buffer("as_int", base[8:16].view(torch.int32))
        self.register_buffer("alone", torch.ones(3, dtype=torch.float64))
        self.register_buffer("empty", torch.empty(0))


def layouts(module: nn.Module) -> dict[str, tuple]:
    return {
        name: (t.dtype, tuple(t.shape), t.stride(), t.storage_offset())
        for name, t in list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers())
    }


def values(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in module.state_dict(keep_vars=True).items()}


def storage_of(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_one_master_per_storage_and_layouts_survive() -> None:
    module = SharedStorage()
    expected_layouts, expected_values = layouts(module), values(module)
    stager = ModuleStager(module, CPU, pin_memory=False)
    # base (192 bytes) + alone (24 bytes) + empty: aliases and views share one master.
    assert stager.weight_bytes == 48 * 4 + 3 * 8
    for transition in (stager.load, stager.offload, stager.load, stager.offload):
        transition()
        assert layouts(module) == expected_layouts
        assert all(torch.equal(v, values(module)[k]) for k, v in expected_values.items())
        assert storage_of(module.first) == storage_of(module.second) == storage_of(module.as_int)
        assert module.tied is module.first


def test_load_gives_new_storage_and_offload_returns_to_the_same_master() -> None:
    module = SharedStorage()
    stager = ModuleStager(module, CPU, pin_memory=False)
    master = storage_of(module.first)
    stager.load()
    assert stager.loaded and storage_of(module.first) != master
    stager.load()  # idempotent
    assert stager.loads == 1
    stager.offload()
    assert storage_of(module.first) == master


def test_writes_through_a_shared_storage_stay_shared() -> None:
    """Two names of one storage never get two copies: a write through one is seen through the other."""
    module = SharedStorage()
    stager = ModuleStager(module, CPU, pin_memory=False)
    stager.load()
    with torch.no_grad():
        module.first.view(-1)[8] = -1.0
    assert module.as_int[0].item() == torch.tensor(-1.0).view(torch.int32).item()


def test_parameters_stay_ordinary_tensors_when_loaded_under_inference_mode() -> None:
    module = SharedStorage()
    stager = ModuleStager(module, CPU, pin_memory=False)
    with torch.inference_mode():
        stager.load()
    assert not module.first.is_inference()
    stager.offload()
    assert not module.first.is_inference()


def test_meta_tensors_are_refused_before_anything_changes() -> None:
    module = SharedStorage()
    with torch.device("meta"):
        module.register_buffer("ghost", torch.empty(2))
    before = storage_of(module.first)
    with pytest.raises(ValueError, match="'ghost'"):
        ModuleStager(module, CPU, pin_memory=False)
    assert storage_of(module.first) == before


def test_a_load_asks_for_one_buffer_with_the_bytes_it_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A block that a cast makes wider than the limit for one buffer loads one allocation per storage."""
    module = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).eval()
    expected = [t.double() for t in module_tensors((module,))]
    stager = ModuleStager(module, CPU, pin_memory=False, one_buffer=lambda nbytes: nbytes <= 4 * 2 * (64 + 8))
    allocations = count_device_allocations(monkeypatch)
    stager.load()
    assert stager.one_buffer and len(allocations) == 1
    stager.offload()
    module.double()
    stager.load()  # queues the old masters' copy first, finds the modules changed, and loads again
    assert not stager.one_buffer
    assert allocations[-4:] == [8 * 8 * 8, 8 * 8, 8 * 8 * 8, 8 * 8], "one allocation per storage"
    assert all(torch.equal(t, e) for t, e in zip(module_tensors((module,)), expected))
    stager.offload()


def test_retake_masters_after_a_cast() -> None:
    module = SharedStorage()
    stager = ModuleStager(module, CPU, pin_memory=False)
    assert stager.masters_current()
    module.alone.data = module.alone.data.float()
    assert not stager.masters_current()
    stager.retake_masters()
    assert stager.masters_current() and stager.weight_bytes == 48 * 4 + 3 * 4
    stager.load()
    with pytest.raises(RuntimeError, match="offloaded"):
        stager.retake_masters()


def test_masters_are_current_only_while_the_modules_hold_exactly_their_tensors() -> None:
    module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).eval()
    module[1].weight = module[0].weight  # tied: one tensor reached twice
    stager = ModuleStager(module, CPU, pin_memory=False)
    assert stager.masters_current()
    module[0].register_buffer("added", torch.ones(2))
    assert not stager.masters_current(), "a tensor added"
    del module[0].added
    assert stager.masters_current()
    bias = module[1].bias
    module[1].bias = None
    assert not stager.masters_current(), "a tensor gone"
    module[1].bias = nn.Parameter(bias.detach().clone())
    assert not stager.masters_current(), "a tensor replaced by another object"
    module[1].bias = bias
    assert stager.masters_current()


def test_a_load_takes_weights_changed_since_the_last_one() -> None:
    """After its first load a stager queues the copies before checking the modules (see
    ModuleStager._load_once): a change found then is loaded again, not bound over."""
    module = nn.Linear(4, 4).eval()
    stager = ModuleStager(module, CPU, pin_memory=False)
    stager.load()
    stager.offload()
    module.weight.data = torch.full((4, 4), 2.0)  # the same Parameter, new data
    module.bias = nn.Parameter(torch.full((4,), 3.0), requires_grad=False)  # a new Parameter
    stager.load()
    assert torch.equal(module.weight, torch.full((4, 4), 2.0)) and torch.equal(module.bias, torch.full((4,), 3.0))
    assert stager.loaded_bytes == 3 * stager.weight_bytes, "the first load, the copy thrown away, and its redo"
    stager.offload()
    assert stager.masters_current()
    assert torch.equal(module.weight, torch.full((4, 4), 2.0)) and torch.equal(module.bias, torch.full((4,), 3.0))
    stager.load()
    assert stager.loaded_bytes == 4 * stager.weight_bytes, "nothing changed: one copy"


def test_a_load_out_of_memory_before_its_check_keeps_weights_changed_since_the_last_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failure after the copies start and before the modules are checked (here out of memory,
    injected where device storage is allocated) leaves a weight replaced while offloaded as it was
    replaced: the fallback rebinds every tensor to its master, which must be the new weight's by
    then. The load's retry then takes it."""
    module = nn.Linear(4, 4).eval()
    stager = ModuleStager(module, CPU, pin_memory=False)
    stager.load()
    stager.offload()
    module.weight.data = torch.full((4, 4), 2.0)
    allocate, failures = _device.allocate_device_storage, [1]

    def out_of_memory_once(nbytes: int, device: torch.device, **kwargs: object) -> torch.Tensor:
        if failures[0]:
            failures[0] -= 1
            raise torch.OutOfMemoryError("injected: out of device memory")
        return allocate(nbytes, device, **kwargs)

    monkeypatch.setattr(_device, "allocate_device_storage", out_of_memory_once)
    stager.load()
    assert not failures[0] and stager.loaded
    assert torch.equal(module.weight, torch.full((4, 4), 2.0))
    stager.offload()
    assert torch.equal(module.weight, torch.full((4, 4), 2.0))


@pytest.fixture
def single_process_group():
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch built without distributed")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_dtensor_is_staged_through_its_local_shard(single_process_group) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    module = nn.Linear(4, 3)
    expected = module.weight.detach().clone()
    module.weight = nn.Parameter(distribute_tensor(module.weight.detach(), mesh, [Shard(0)]))
    stager = ModuleStager(module, CPU, pin_memory=False)
    master = module.weight._local_tensor.untyped_storage().data_ptr()
    stager.load()
    assert isinstance(module.weight, DTensor)
    assert module.weight._local_tensor.untyped_storage().data_ptr() != master
    assert torch.equal(module.weight.full_tensor(), expected)
    stager.offload()
    assert module.weight._local_tensor.untyped_storage().data_ptr() == master
    assert torch.equal(module.weight.full_tensor(), expected)


def test_a_conversion_of_a_dtensor_takes_masters_for_its_new_shard(single_process_group) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    module = nn.Linear(4, 3, bias=False)
    expected = module.weight.detach().double()
    module.weight = nn.Parameter(distribute_tensor(module.weight.detach(), init_device_mesh("cpu", (1,)), [Shard(0)]))
    stager = ModuleStager(module, CPU, pin_memory=False)
    staged = stager.weight_bytes
    stager.convert(lambda convert: nn.Module._apply(module, convert), lambda tensor: tensor.to(torch.float64))
    assert stager.masters_current() and stager.weight_bytes == 2 * staged
    stager.load()
    stager.offload()
    assert torch.equal(module.weight.full_tensor(), expected)


def test_map_masters_takes_only_byte_identical_whole_storages() -> None:
    module = nn.Module()
    module.same = nn.Parameter(torch.arange(6, dtype=torch.float32), requires_grad=False)
    module.changed = nn.Parameter(torch.ones(4), requires_grad=False)
    module.shared = SharedStorage()  # storages holding several tensors never map
    stager = ModuleStager(module, CPU, pin_memory=False)
    file_bytes = {
        id(module.same): MappedBytes(module.same.detach().clone().view(torch.uint8)),
        id(module.changed): MappedBytes(torch.zeros(4).view(torch.uint8)),  # changed since it was saved
        id(module.shared.first): MappedBytes(module.shared.first.detach().clone().reshape(-1).view(torch.uint8)),
    }
    stager.load()
    with pytest.raises(RuntimeError, match="offloaded"):
        stager.map_masters(file_bytes)
    stager.offload()
    assert stager.map_masters(file_bytes) == 6 * 4
    assert stager.host_bytes()["mapped"] == 6 * 4
    assert module.same.data_ptr() == file_bytes[id(module.same)].view.data_ptr()
    assert torch.equal(module.changed, torch.ones(4))
    stager.unmap_masters()
    assert stager.host_bytes()["mapped"] == 0
    assert module.same.data_ptr() != file_bytes[id(module.same)].view.data_ptr()
    assert torch.equal(module.same, torch.arange(6, dtype=torch.float32))


def test_storage_a_replaced_parameter_still_uses_is_not_handed_to_the_next_block() -> None:
    torch.manual_seed(0)
    first, second = nn.Linear(8, 8), nn.Linear(8, 8)
    expected = first.weight.detach().clone()
    cpu = torch.device("cpu")
    a, b = ModuleStager(first, cpu, pin_memory=False), ModuleStager(second, cpu, pin_memory=False)
    assert a._layout() == b._layout(), "equal layouts: b would take a's storage"
    slots = DeviceSlots()
    a.load(slots=slots)
    first.weight = nn.Parameter(first.weight.detach())  # a new parameter over the loaded storage
    a.offload(slots=slots)
    b.load(slots=slots)
    assert torch.equal(first.weight, expected), "the next block's weights were copied under a live parameter"
    assert torch.equal(second(torch.ones(8)), nn.functional.linear(torch.ones(8), second.weight, second.bias))


def test_only_a_load_into_slots_holds_its_storage_beyond_the_bound_tensors() -> None:
    # Layerwise casting moves every weight to storage of its own at each forward: the loaded copy
    # must then be freed, not held by the stager until the offload.
    module = nn.Linear(8, 8)
    stager = ModuleStager(module, torch.device("cpu"), pin_memory=False)
    stager.load()
    assert stager._device_storages == []
    stager.offload()
    stager.load(slots=DeviceSlots())
    assert len(stager._device_storages) == 1, "the load's one buffer"
    stager.offload()
    assert stager._device_storages == []


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16, torch.float64])
def test_kept_masters_stand_for_a_conversion_only_with_the_same_bits_throughout(dtype: torch.dtype) -> None:
    # Compared as the widest words that tile the bytes: a difference must still show in the last
    # element of an odd count and at offsets no word is aligned to; bits, not values, are compared.
    storage = torch.randn(46, dtype=torch.float64).to(dtype)
    for offset, count in ((0, 37), (1, 37), (3, 8), (1, 1)):
        kept = storage[offset : offset + count]
        assert same_bits(kept, kept.clone())
        for position in {0, count - 1}:
            fresh = kept.clone()
            fresh[position] = fresh[position] * 2 + 1
            assert not same_bits(kept, fresh), (offset, count, position)
            zero, negative_zero = kept.clone(), kept.clone()
            zero[position], negative_zero[position] = 0.0, -0.0
            assert not same_bits(zero, negative_zero), (offset, count, position)
    nan = torch.full((5,), float("nan"), dtype=dtype)
    assert same_bits(nan, nan.clone()), "a NaN stands for the same NaN"
    assert not same_bits(storage[:4], storage[:8:2]), "another layout"
    assert not same_bits(storage[:4], storage[:4].to(torch.float64 if dtype != torch.float64 else torch.float32))


def test_module_tensors_come_in_parameters_then_buffers_order_with_shared_and_excluded_modules() -> None:
    shared = nn.Linear(2, 2)
    inner = nn.Sequential(shared, nn.BatchNorm1d(2))
    root = nn.Module()
    root.a = inner
    root.b = shared  # reached again, after its first place inside `a`
    root.c = nn.Sequential(nn.Linear(2, 2), None, nn.LayerNorm(2))
    root.c[0].weight = shared.weight  # tied into an excluded block: left out
    expected = [id(t) for t in (*root.parameters(), *root.buffers())]
    assert [id(t) for t in module_tensors((root,))] == expected
    outside_c = [t for t in (*root.parameters(), *root.buffers()) if all(t is not u for u in (*root.c.parameters(), *root.c.buffers()))]
    assert [id(t) for t in module_tensors((root,), exclude=(root.c,))] == [id(t) for t in outside_c]
    assert list(module_tensors((root.c,), exclude=(root.c,))) == []


def test_a_load_allocates_one_buffer_and_gives_each_storage_its_own_slice(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """One allocation per load (each a segment and a cudaFree of its own otherwise, at every cache
    release), yet every weight on a storage of its own, aligned as its master was: safetensors
    refuses tensors that share a storage, and CPU kernels compute by alignment."""
    module = SharedStorage()
    module.other = nn.Linear(5, 3)
    expected_layouts = layouts(module)
    stager = ModuleStager(module, CPU, pin_memory=False)
    allocated = count_device_allocations(monkeypatch)
    stager.load()
    assert len(allocated) == 1 and allocated[0] >= stager.weight_bytes
    assert layouts(module) == expected_layouts
    storages = {id(group.master): group for group in stager._groups}
    loaded = {storage_of(t): t.untyped_storage().nbytes() for t in module.state_dict().values()}
    assert len(loaded) == len(storages), "a storage of its own for each master's copy"
    assert sorted(loaded.values()) == sorted(group.nbytes for group in stager._groups)
    for group in stager._groups:
        target = group.bindings[0].target
        assert (storage_of(target) - group.alignment) % 64 == 0, "each copy at its master's alignment"
    safetensors.torch.save_file(module.other.state_dict(), tmp_path / "other.safetensors")
    assert torch.equal(safetensors.torch.load_file(tmp_path / "other.safetensors")["weight"], module.other.weight)


def test_a_retake_that_fails_after_taking_new_masters_waits_for_copies_reading_the_old(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The old masters are dropped as the exception leaves: a copy of the last load may still be
    reading them (the CPU has none, so the wait is counted where it is made)."""
    module = nn.Linear(4, 4)
    stager = ModuleStager(module, CPU, pin_memory=False)
    stager.load()
    stager.offload()
    module.weight = nn.Parameter(module.weight.detach() * 2)  # a new parameter: new masters to take
    waited: list[tuple] = []
    monkeypatch.setattr(ModuleStager, "_wait_before_letting_go", lambda self, groups: waited.append(groups))
    monkeypatch.setattr(staging, "claim", lambda owner, groups: (_ for _ in ()).throw(RuntimeError("injected")))
    before = stager._groups
    with pytest.raises(RuntimeError, match="injected"):
        stager.retake_masters()
    assert waited == [before]
