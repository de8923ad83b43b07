"""Host masters: the weights' own memory page-locked in place, within a budget, never a second copy.

Page locking (``cudaHostRegister``) cannot exist on a machine without CUDA, so these tests replace
it at its one named point, ``_device.register_host_memory``, with a registry that enforces the
driver's rule (a page is registered at most once). On the GPU machine ``test_gpu.py`` covers the
real call.
"""

from __future__ import annotations

import gc
import mmap
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from diffusers_residency import ModuleStager, _device, file_reads, files, machine_memory, pinning, ring
from diffusers_residency.file_reads import ReadBack
from diffusers_residency.files import MappedBytes

CPU = torch.device("cpu")
PAGE = mmap.PAGESIZE


class FakeDriver:
    """What the CUDA driver does with registrations, as far as the package can observe it."""

    def __init__(self) -> None:
        self.ranges: dict[int, int] = {}
        self._lock = threading.Lock()  # read-back pieces are registered by reader threads

    def register(self, address: int, nbytes: int, device: torch.device | None = None) -> bool:
        assert address % PAGE == 0 and nbytes % PAGE == 0, "registration must cover whole pages"
        with self._lock:
            if any(address < start + size and start < address + nbytes for start, size in self.ranges.items()):
                return False  # cudaErrorHostMemoryAlreadyRegistered
            self.ranges[address] = nbytes
            return True

    def unregister(self, address: int, device: torch.device | None = None) -> None:
        with self._lock:
            del self.ranges[address]

    @property
    def registered_bytes(self) -> int:
        return sum(self.ranges.values())

    def covers(self, tensor: torch.Tensor) -> bool:
        start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
        return any(base <= start and end <= base + size for base, size in self.ranges.items())


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> FakeDriver:
    gc.collect()
    assert pinning.locked_bytes() == 0, "an earlier test left masters registered"
    fake = FakeDriver()
    monkeypatch.setattr(_device, "can_register_host_memory", lambda: True)
    monkeypatch.setattr(_device, "register_host_memory", fake.register)
    monkeypatch.setattr(_device, "unregister_host_memory", fake.unregister)
    yield fake
    assert pinning.LOCKED.ranges() == sorted((start, start + size) for start, size in fake.ranges.items())
    assert pinning.locked_bytes() == fake.registered_bytes


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(module.state_dict(keep_vars=True))


def large_and_small() -> torch.nn.Module:
    """One weight large enough to be locked in place (75.5 MB), and small ones beside it."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4096, 4608), torch.nn.GELU(), torch.nn.Linear(4608, 8)).eval()


def test_large_weights_are_locked_in_place_small_ones_copied_once_into_a_block(driver: FakeDriver) -> None:
    module = large_and_small()
    x = torch.randn(3, 4096)
    expected = module(x)
    large = module[0].weight
    assert pinning.owns_its_pages([large.detach().view(-1).view(torch.uint8)]) == [True]
    address = large.data_ptr()
    small_addresses = {name: t.data_ptr() for name, t in weights(module).items() if t is not large}

    stager = ModuleStager(module, CPU, pin_memory=True, pin_budget=1 << 40)
    assert large.data_ptr() == address, "the large weight is locked where it is: no copy"
    assert all(weights(module)[name].data_ptr() != old for name, old in small_addresses.items())
    assert stager.pinned and stager.host_bytes()["pinned"] == stager.weight_bytes
    assert all(driver.covers(t) for t in weights(module).values())
    # Two registrations: the large weight's pages, and one exactly sized block for the small ones.
    assert len(driver.ranges) == 2 and driver.registered_bytes == pinning.locked_bytes()
    assert driver.registered_bytes <= stager.weight_bytes + 4 * PAGE + 3 * 512

    stager.load()
    assert torch.equal(module(x), expected)
    stager.offload()
    assert torch.equal(module(x), expected)
    stager.close()
    assert driver.ranges == {} and pinning.locked_bytes() == 0
    assert large.data_ptr() == address and torch.equal(module(x), expected)


def test_masters_side_by_side_in_a_locked_block_load_in_one_copy(driver: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small masters copied into one locked block keep their distances in the load's buffer and go
    in one copy: a component's thousands of small storages, copied one by one, ran below the bus's
    rate on the H200 machine. A weight locked in place is a copy of its own; every weight still
    gets a storage of its own, at its master's alignment."""
    module = large_and_small()
    x = torch.randn(3, 4096)
    expected = module(x)
    stager = ModuleStager(module, CPU, pin_memory=True, pin_budget=1 << 40)
    spans: list[int] = []
    span = pinning.host_span
    monkeypatch.setattr(pinning, "host_span", lambda address, nbytes: (spans.append(nbytes), span(address, nbytes))[1])
    offsets, _, runs = stager._placed()
    # The large weight first (module order), locked where it is; then the block of the three small ones.
    assert runs == ((0, 0), (1, 3))
    block = [group.master.data_ptr() for group in stager._groups[1:]]
    assert [offset - offsets[1] for offset in offsets[1:]] == [address - block[0] for address in block]
    stager.load()
    assert spans == [offsets[3] + stager._groups[3].nbytes - offsets[1]]
    storages = {t.untyped_storage().data_ptr() for t in weights(module).values()}
    assert len(storages) == 4, "a storage of its own for each weight"
    assert all((t.data_ptr() - g.alignment) % 64 == 0 for g in stager._groups for t in [g.bindings[0].target])
    assert torch.equal(module(x), expected)
    stager.offload()
    module[2].bias = torch.nn.Parameter(module[2].bias.detach() + 1)  # a master of its own, in no block
    expected = module(x)
    stager.retake_masters()
    assert stager._placed()[2] == ((0, 0), (1, 2), (3, 3))
    stager.load()
    assert torch.equal(module(x), expected)
    stager.close()


def test_a_large_weight_in_the_malloc_heap_is_copied_not_locked_in_place(
    driver: FakeDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """glibc serves large requests from free chunks of its main heap, beside other allocations: a
    weight there shares its first and last pages, and locking them would break copies of whatever
    malloc puts there later (a pipeline's output, on the H200 machine)."""
    module = large_and_small()
    large = module[0].weight
    address = large.data_ptr()
    # Where the weight lands depends on the heap's history; make it the heap, as it was there.
    monkeypatch.setattr(pinning, "_malloc_heap_range", lambda: (address - 4 * PAGE, address + (256 << 20)))
    stager = ModuleStager(module, CPU, pin_memory=True, pin_budget=1 << 40)
    assert large.data_ptr() != address, "copied into a block of its own"
    assert stager.pinned and all(driver.covers(t) for t in weights(module).values())
    assert not any(start <= address < start + size for start, size in driver.ranges.items())
    stager.close()


def test_pipeline_masters_all_locked_and_outputs_unchanged(flux, driver: FakeDriver) -> None:
    stager = ModuleStager(flux.pipe.transformer, CPU, pin_memory=True, pin_budget=1 << 40)
    assert stager.pinned and all(driver.covers(t) for t in weights(flux.pipe.transformer).values())
    stager.load()
    assert torch.equal(flux.run(), flux.reference)
    stager.offload()
    assert torch.equal(flux.run(), flux.reference)
    stager.close()
    assert driver.ranges == {}


def test_pin_budget_counts_every_component_and_leaves_the_rest_pageable(flux, driver: FakeDriver) -> None:
    first = ModuleStager(flux.pipe.transformer, CPU, pin_memory=True, pin_budget=1 << 40)
    budget = pinning.locked_bytes() + PAGE  # room for the first component only
    second = ModuleStager(flux.pipe.text_encoder_2, CPU, pin_memory=True, pin_budget=budget)

    assert first.pinned and not second.pinned
    assert second.host_bytes() == {"pinned": 0, "pageable": second.weight_bytes, "mapped": 0}
    assert pinning.locked_bytes() <= budget
    first.load()
    second.load()
    assert torch.equal(flux.run(), flux.reference), "loads from pageable masters work too"
    second.offload()
    assert torch.equal(flux.run(), flux.reference)
    first.close()
    second.close()


def test_pages_locked_by_someone_else_are_copied_once_into_a_locked_block(driver: FakeDriver) -> None:
    module = large_and_small()
    x = torch.randn(3, 4096)
    expected = module(x)
    large = module[0].weight
    before, address = large.detach().clone(), large.data_ptr()
    foreign = address - address % PAGE + 16 * PAGE
    driver.ranges[foreign] = PAGE  # another library locked one of its pages

    stager = ModuleStager(module, CPU, pin_memory=True, pin_budget=1 << 40)
    assert large.data_ptr() != address and torch.equal(large, before)
    assert driver.covers(large) and stager.pinned
    stager.load()
    assert torch.equal(module(x), expected)
    stager.close()
    del driver.ranges[foreign]


def test_components_never_register_a_page_twice(flux, driver: FakeDriver) -> None:
    stagers = [
        ModuleStager(flux.pipe.transformer, CPU, pin_memory=True, pin_budget=1 << 40),
        ModuleStager(flux.pipe.text_encoder, CPU, pin_memory=True, pin_budget=1 << 40),
        ModuleStager(flux.pipe.text_encoder_2, CPU, pin_memory=True, pin_budget=1 << 40),
    ]
    assert all(stager.pinned for stager in stagers), "overlapping pages went to a block, not refused"
    assert pinning.locked_bytes() == driver.registered_bytes
    for stager in stagers:
        stager.close()
    assert driver.ranges == {}


def test_pin_budget_arguments() -> None:
    ram = machine_memory.machine_memory_limit()
    assert pinning.resolve_pin_budget(None) == int(pinning.DEFAULT_PIN_FRACTION * ram)
    assert pinning.resolve_pin_budget(0.5) == int(0.5 * ram)
    assert pinning.resolve_pin_budget(1 << 30) == 1 << 30
    for bad, error in ((0.0, ValueError), (1.5, ValueError), (-1, ValueError), ("8GB", TypeError), (True, TypeError)):
        with pytest.raises(error, match="pin_budget"):
            pinning.resolve_pin_budget(bad)


def test_bad_pin_budget_is_refused_before_anything_changes(flux) -> None:
    before = {name: t.data_ptr() for name, t in weights(flux.pipe.transformer).items()}
    with pytest.raises(ValueError, match="pin_budget"):
        flux.pipe.enable_pinned_offload("cpu", pin_budget=2.0)
    assert not hasattr(flux.pipe.transformer, "_hf_hook")
    assert {name: t.data_ptr() for name, t in weights(flux.pipe.transformer).items()} == before


def test_a_block_holds_each_copy_at_its_alignment_and_takes_empty_tensors() -> None:
    sources = [
        torch.empty(0, dtype=torch.uint8),
        torch.arange(5, dtype=torch.uint8),
        torch.ones(700, dtype=torch.uint8),
    ]
    masters = pinning.copy_to_host(sources, [0, 3, 48], budget=0, pin=False)
    assert [m.data.numel() for m in masters] == [0, 5, 700]
    assert all(torch.equal(m.data, s) for m, s in zip(masters, sources))
    assert [m.data.data_ptr() % 64 for m in masters[1:]] == [3, 48]
    assert not any(m.pinned for m in masters)


def test_taking_masters_again_keeps_every_unchanged_one_and_locks_only_what_is_new(driver: FakeDriver) -> None:
    module = large_and_small()
    stager = ModuleStager(module, CPU, pin_memory=True, pin_budget=1 << 40)
    before = {name: t.data_ptr() for name, t in weights(module).items()}
    groups, staged, ranges = len(stager._groups), stager.weight_bytes, dict(driver.ranges)

    module.append(torch.nn.Linear(8, 8))  # a new layer, as an adapter would add
    stager.retake_masters()
    assert {name: weights(module)[name].data_ptr() for name in before} == before, "no master copied again"
    assert len(stager._groups) == groups + 2
    assert stager.weight_bytes == staged + (8 * 8 + 8) * 4
    assert ranges.items() <= driver.ranges.items() and len(driver.ranges) == len(ranges) + 1
    assert stager.pinned
    stager.close()
    assert driver.ranges == {}


def test_level_2_masters_give_their_pages_back_and_are_locked_again_on_waking(driver: FakeDriver) -> None:
    module = large_and_small()
    x = torch.randn(3, 4096)
    expected = module(x)
    stager = ModuleStager(module, CPU, pin_memory=True, pin_budget=1 << 40)
    large = module[0].weight
    view = large.detach().clone().view(-1).view(torch.uint8)  # stands in for the checkpoint's bytes
    registered = len(driver.ranges)

    released = stager.map_masters({id(large): MappedBytes(view)})
    assert released == view.numel() and stager.host_bytes()["mapped"] == view.numel()
    assert len(driver.ranges) == registered - 1, "the large weight's pages are unlocked"
    assert torch.equal(module(x), expected)

    stager.unmap_masters()
    assert stager.pinned and stager.host_bytes()["mapped"] == 0 and driver.covers(large)
    stager.load()
    assert torch.equal(module(x), expected)
    stager.offload()
    stager.map_masters({id(large): MappedBytes(large.detach().clone().view(-1).view(torch.uint8))})
    stager.close()  # gives the mapped master memory of its own without locking it first
    assert driver.ranges == {} and torch.equal(module(x), expected)


def _mapped_checkpoint(tmp_path, module: torch.nn.Module) -> dict[int, MappedBytes]:
    from safetensors.torch import save_file

    from diffusers_residency.checkpoints import checkpoint_views

    save_file({name: t.detach() for name, t in weights(module).items()}, str(tmp_path / "model.safetensors"))
    return checkpoint_views(tmp_path, module)


def test_masters_mapped_from_a_file_read_it_unless_their_pages_were_written(tmp_path, monkeypatch) -> None:
    torch.manual_seed(0)
    module = torch.nn.Sequential(*(torch.nn.Linear(512, 512, bias=False) for _ in range(3)))
    views = _mapped_checkpoint(tmp_path, module)
    sources = [views[id(layer.weight)] for layer in module]
    assert all(source.file is not None for source in sources)
    # Written through its mapping after it was mapped: the process's own pages now, not the file's.
    sources[1].view[PAGE * 4 : PAGE * 4 + 8] = 255
    expected = [source.view.clone() for source in sources]
    reads = []
    real_preadv = files.os.preadv

    def counted_preadv(fd, buffers, offset):
        reads.append(offset)
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(files.os, "preadv", counted_preadv)
    masters = file_reads.finish_or_unlock(ReadBack(sources, [0, 0, 0], 0, pin=False))
    assert [torch.equal(master.data, want) for master, want in zip(masters, expected)] == [True] * 3
    assert sorted(set(reads)) == sorted({sources[0].offset, sources[2].offset}), "the written view is copied"
    assert all(master.data.data_ptr() % 512 == 0 and not master.pinned for master in masters)


def test_masters_back_to_back_in_a_file_are_read_with_one_scatter_read(tmp_path, monkeypatch) -> None:
    """A piece's masters that lie back to back in the file take one ``preadv`` into their slots
    (slots are padded apart), short reads included; a run with a page written through the mapping
    is read one master at a time, the written one from its view."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(*(torch.nn.Linear(256, 256, bias=False) for _ in range(6)))
    views = _mapped_checkpoint(tmp_path, module)
    sources = [views[id(layer.weight)] for layer in module]
    order = sorted(range(6), key=lambda i: sources[i].offset)
    assert all(sources[b].offset == sources[a].offset + sources[a].view.numel() for a, b in zip(order, order[1:]))
    real_preadv = files.os.preadv
    reads: list[tuple[int, int]] = []

    def short_preadv(fd, buffers, offset):
        reads.append((offset, len(buffers)))
        return real_preadv(fd, [buffers[0][:3000]], offset)  # a short read: 3000 bytes at most

    monkeypatch.setattr(files.os, "preadv", short_preadv)
    alignments = [0, 4, 0, 8, 0, 0]
    masters = file_reads.finish_or_unlock(ReadBack(sources, alignments, 0, pin=False))
    assert all(torch.equal(master.data, source.view) for master, source in zip(masters, sources))
    assert [master.data.data_ptr() % 512 for master in masters] == alignments
    assert reads[0] == (sources[order[0]].offset, 6), "the first read asks for all six masters at once"
    assert len(reads) == 6 * -(-256 * 256 * 4 // 3000), "each short read is taken up where it ended"

    reads.clear()
    sources[3].view[PAGE : PAGE + 8] = 7
    masters = file_reads.finish_or_unlock(ReadBack(sources, alignments, 0, pin=False))
    assert all(torch.equal(master.data, source.view) for master, source in zip(masters, sources))
    assert sources[3].offset not in {offset for offset, _ in reads}, "the written master is copied from its view"
    assert all(count == 1 for _, count in reads), "one master per read in a run with a written page"


def _six_mapped_weights(tmp_path, monkeypatch) -> list[MappedBytes]:
    """Six 256 KiB weights back to back in a file, going through a ring of two slots of 100 KiB: a
    slot holds parts of two weights, a weight spans slots, and each slot is filled eight times."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(*(torch.nn.Linear(256, 256, bias=False) for _ in range(6)))
    views = _mapped_checkpoint(tmp_path, module)
    monkeypatch.setattr(ring, "_RING_SLOT_BYTES", 100 << 10)
    monkeypatch.setattr(ring, "_RING_SLOTS", 2)
    return [views[id(layer.weight)] for layer in module]


@pytest.mark.parametrize("budget", [1 << 40, 0])
def test_copying_from_files_goes_through_a_ring_of_slots_locked_once(tmp_path, driver: FakeDriver, monkeypatch, budget: int) -> None:
    sources = _six_mapped_weights(tmp_path, monkeypatch)
    sources[4].view[PAGE : PAGE + 8] = 7  # written through the mapping: copied from the view, not the file
    targets = [torch.zeros(source.view.numel(), dtype=torch.uint8) for source in sources]
    registered: list[int] = []
    register = driver.register
    monkeypatch.setattr(_device, "register_host_memory", lambda *args: registered.append(args[1]) or register(*args))
    ring.copy_from_files(sources, targets, budget, pin=True, device=CPU)
    assert all(torch.equal(target, source.view) for target, source in zip(targets, sources))
    assert len(registered) == (2 if budget else 0), "each slot locked once, within the budget"
    assert driver.ranges == {} and pinning.locked_bytes() == 0, "and unlocked before it returns"


@pytest.mark.parametrize("failure", ["read", "file written"])
def test_copying_from_files_that_fails_part_way_leaves_nothing_locked(tmp_path, driver: FakeDriver, monkeypatch, failure: str) -> None:
    sources = _six_mapped_weights(tmp_path, monkeypatch)
    targets = [torch.zeros(source.view.numel(), dtype=torch.uint8) for source in sources]
    real_preadv, reads = files.os.preadv, []
    (path,) = tmp_path.glob("*.safetensors")

    def preadv(fd, buffers, offset):
        reads.append(offset)
        if len(reads) == 5:
            if failure == "read":
                raise OSError("injected: unreadable")
            stamp = path.stat()
            os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 10**9))  # a save into the folder
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(files.os, "preadv", preadv)
    with pytest.raises((OSError, RuntimeError), match="injected" if failure == "read" else "changed since"):
        ring.copy_from_files(sources, targets, 1 << 40, pin=True, device=CPU)
    assert driver.ranges == {} and pinning.locked_bytes() == 0


def test_masters_read_back_are_locked_in_pieces_each_master_inside_one(driver: FakeDriver, monkeypatch) -> None:
    monkeypatch.setattr(file_reads, "_PIECE_BYTES", 3 * PAGE)
    sizes = [PAGE, 2 * PAGE, PAGE + 100, 5 * PAGE, 7]
    sources = [MappedBytes(torch.randint(0, 256, (size,), dtype=torch.uint8)) for size in sizes]
    alignments = [0, 0, 4, 0, 2]
    masters = file_reads.finish_or_unlock(ReadBack(sources, alignments, 1 << 40, pin=True))
    assert len(driver.ranges) == 4, "pieces of [1, 2], [3], [4] and [5] pages' worth"
    for master, source, alignment in zip(masters, sources, alignments):
        assert torch.equal(master.data, source.view) and master.pinned and driver.covers(master.data)
        assert master.data.data_ptr() % 512 == alignment
    assert len({id(master.pin) for master in masters}) == 4
    starts = sorted(driver.ranges)
    assert all(start % file_reads.HUGE_PAGE == starts[0] % file_reads.HUGE_PAGE for start in starts)
    del masters, master
    gc.collect()
    assert driver.ranges == {}, "each piece is unlocked with the last master in it"

    budget = 3 * PAGE  # the first piece fits, the rest do not
    masters = file_reads.finish_or_unlock(ReadBack(sources, alignments, budget, pin=True))
    assert [master.pinned for master in masters] == [True, True, False, False, False]
    assert all(torch.equal(master.data, source.view) for master, source in zip(masters, sources))


def test_a_small_unit_is_read_back_in_a_piece_per_thread(driver: FakeDriver, monkeypatch) -> None:
    """Each piece is one thread's: a unit under a piece's worth would be read by one thread alone."""
    monkeypatch.setattr(file_reads, "_PIECE_BYTES", 8 * PAGE)
    monkeypatch.setattr(file_reads, "_SMALLEST_PIECE_BYTES", PAGE)
    monkeypatch.setattr(file_reads, "READ_THREADS", 4)
    sources = [MappedBytes(torch.full((PAGE,), index, dtype=torch.uint8)) for index in range(8)]
    read = ReadBack(sources, [0] * 8, 1 << 40, pin=True)
    masters = read.finish()
    assert [piece.members for piece in read.pieces] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert all(torch.equal(master.data, source.view) for master, source in zip(masters, sources))
    assert len(driver.ranges) == 4
    del masters, read
    gc.collect()
    assert driver.ranges == {}


def test_a_failed_read_back_unlocks_every_piece_locked_so_far(driver: FakeDriver, monkeypatch) -> None:
    monkeypatch.setattr(file_reads, "_PIECE_BYTES", PAGE)
    sources = [MappedBytes(torch.full((PAGE,), index, dtype=torch.uint8)) for index in range(6)]
    real_fill = file_reads.fill_from_file

    def failing_fill(slot, source):
        if source is sources[3]:
            raise OSError("injected: unreadable")
        real_fill(slot, source)

    monkeypatch.setattr(file_reads, "fill_from_file", failing_fill)
    with pytest.raises(OSError, match="injected"):
        file_reads.finish_or_unlock(ReadBack(sources, [0] * 6, 1 << 40, pin=True))
    assert driver.ranges == {}, "the pieces before the failure are unlocked at once"
    assert pinning.locked_bytes() == 0, "and those never filled no longer count against the budget"


def test_an_abandoned_read_back_gives_back_every_claim_and_lock_before_it_returns(driver: FakeDriver, monkeypatch) -> None:
    """Pieces not started are cancelled and their budget claims given back; pieces being filled
    finish, lock, and are unlocked again, all before abandon() returns (no garbage collection)."""
    monkeypatch.setattr(file_reads, "_PIECE_BYTES", PAGE)
    gate = threading.Event()
    real_fill = file_reads.fill_from_file

    def gated_fill(slot, source):
        assert gate.wait(timeout=10)
        real_fill(slot, source)

    monkeypatch.setattr(file_reads, "fill_from_file", gated_fill)
    sources = [MappedBytes(torch.full((PAGE,), index, dtype=torch.uint8)) for index in range(40)]
    read = ReadBack(sources, [0] * 40, 1 << 40, pin=True)
    assert pinning.locked_bytes() == 40 * PAGE, "every piece's budget is claimed at the start"
    threading.Timer(0.2, gate.set).start()
    read.abandon()
    assert pinning.locked_bytes() == 0 and driver.ranges == {}


@pytest.mark.parametrize("where", ["registration", "submission"])
def test_a_read_back_that_fails_to_start_or_to_lock_gives_its_claims_back(driver: FakeDriver, monkeypatch, where: str) -> None:
    monkeypatch.setattr(file_reads, "_PIECE_BYTES", PAGE)
    sources = [MappedBytes(torch.full((PAGE,), index, dtype=torch.uint8)) for index in range(6)]
    if where == "registration":
        # The runtime raising (rather than returning an error) inside the call, on a reader thread.
        calls = iter(range(100))

        def register(address, nbytes, device=None):
            if next(calls) == 2:
                raise RuntimeError("injected: the runtime failed")
            return driver.register(address, nbytes, device)

        monkeypatch.setattr(_device, "register_host_memory", register)
    else:
        pool = file_reads._reader_pool()

        class FailingPool:
            def __init__(self) -> None:
                self.submitted = 0

            def submit(self, *args):
                self.submitted += 1
                if self.submitted == 3:
                    raise RuntimeError("injected: cannot schedule")
                return pool.submit(*args)

        monkeypatch.setattr(file_reads, "_reader_pool", FailingPool)
    with pytest.raises(RuntimeError, match="injected"):
        file_reads.finish_or_unlock(ReadBack(sources, [0] * 6, 1 << 40, pin=True))
    gc.collect()
    assert pinning.locked_bytes() == 0 and driver.ranges == {}


def _four_layers_read_back_in_four_pieces(tmp_path, monkeypatch) -> tuple[torch.nn.Module, ModuleStager, torch.Tensor]:
    """A stager whose four masters map a checkpoint file, read back one per piece."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(*(torch.nn.Linear(512, 512, bias=False) for _ in range(4))).eval()
    monkeypatch.setattr(file_reads, "_PIECE_BYTES", module[0].weight.nbytes)
    stager = ModuleStager(module, CPU, pin_memory=True, pin_budget=1 << 40)
    assert stager.map_masters(_mapped_checkpoint(tmp_path, module)) == 4 * module[0].weight.nbytes
    return module, stager, torch.randn(2, 512)


def test_a_load_copies_each_piece_read_back_as_soon_as_it_is_locked(tmp_path, driver: FakeDriver, monkeypatch) -> None:
    """A load that finds its masters being read back (a unit woken without a load, called next)
    copies each piece as soon as it is read and locked, while the next ones are read, rather than
    after all of them."""
    module, stager, x = _four_layers_read_back_in_four_pieces(tmp_path, monkeypatch)
    expected = module(x)
    copied = [threading.Event() for _ in range(4)]
    real_wait_for, real_fill_piece = ReadBack.wait_for, ReadBack._fill_piece
    pieces_read_before_the_copy_ahead: list[int] = []

    def wait_for(read, index):
        real_wait_for(read, index)
        copied[read.piece_of[index].number].set()  # the load copies it next, on this thread

    def fill_piece(read, piece):
        if piece.number and not copied[piece.number - 1].wait(timeout=5):
            pieces_read_before_the_copy_ahead.append(piece.number)
        return real_fill_piece(read, piece)

    monkeypatch.setattr(ReadBack, "wait_for", wait_for)
    monkeypatch.setattr(ReadBack, "_fill_piece", fill_piece)
    stager.read_ahead()
    stager.load()
    assert pieces_read_before_the_copy_ahead == []
    assert stager.host_bytes()["mapped"] == 0 and stager.pinned
    assert len(driver.ranges) == 4 and all(driver.covers(group.master) for group in stager._groups)
    assert torch.equal(module(x), expected)
    assert stager.loaded_bytes == 0 and stager.load_seconds == 0, "the files' read is not a load rate"
    stager.offload()
    assert torch.equal(module(x), expected), "the masters read back are the masters from here on"
    stager.load()
    assert stager.loaded_bytes == stager.weight_bytes and stager.load_seconds > 0
    stager.offload()
    stager.close()
    assert driver.ranges == {}


def test_a_read_ahead_serves_the_load_unless_the_masters_changed_since(tmp_path, driver: FakeDriver, monkeypatch) -> None:
    module, stager, x = _four_layers_read_back_in_four_pieces(tmp_path, monkeypatch)
    started: list[ReadBack] = []
    real_init = ReadBack.__init__

    def init(read, *args, **kwargs):
        started.append(read)
        real_init(read, *args, **kwargs)

    monkeypatch.setattr(ReadBack, "__init__", init)
    expected = module(x)
    registered_in: list[torch.device | None] = []
    register = driver.register
    monkeypatch.setattr(_device, "register_host_memory", lambda *args: registered_in.append(args[2]) or register(*args))
    stager.read_ahead()
    stager.read_ahead()  # one under way already
    stager.load()
    assert len(started) == 1 and torch.equal(module(x), expected)
    assert registered_in == [stager.device] * 4, "locked in the context of the device it copies to"
    stager.offload()
    (tmp_path / "again").mkdir()
    assert stager.map_masters(_mapped_checkpoint(tmp_path / "again", module)) == stager.weight_bytes
    started.clear()

    stager.read_ahead()
    module[1].weight.data = module[1].weight.data * 2  # replaced while its read was under way
    expected = module(x)
    stager.retake_masters()
    # From the files, then reads back the masters it loaded. Loaded ahead, it is not made ready,
    # which would take the masters read back if that read were done already: they stay mapped
    # until the offload, however fast the read.
    stager.load(ahead=True)
    assert len(started) == 2, "the read started ahead read the old masters: a new one reads the new"
    while not started[-1].done():  # the worst case for the check below: the read already done
        time.sleep(0.001)
    assert torch.equal(module(x), expected) and stager.host_bytes()["mapped"] == 3 * module[0].weight.nbytes
    stager.offload()
    stager.unmap_masters()  # waits for that read, rather than reading again
    assert len(started) == 2 and stager.host_bytes()["mapped"] == 0 and stager.pinned
    assert torch.equal(module(x), expected)
    stager.close()
    started.clear()  # a finished read-back holds the registrations of its pieces too
    gc.collect()
    assert driver.ranges == {}


def test_a_load_from_the_files_that_fails_leaves_the_masters_mapped(tmp_path, driver: FakeDriver, monkeypatch) -> None:
    module, stager, x = _four_layers_read_back_in_four_pieces(tmp_path, monkeypatch)
    expected = module(x)
    mapped, registered = stager.host_bytes()["mapped"], dict(driver.ranges)
    real_preadv = files.os.preadv
    third = stager._groups[2].mapped_from

    def failing_preadv(fd, buffers, offset):
        if offset <= third.offset < offset + sum(len(buffer) for buffer in buffers):
            raise OSError("injected: unreadable")
        return real_preadv(fd, buffers, offset)

    with monkeypatch.context() as patch:
        patch.setattr(files.os, "preadv", failing_preadv)
        with pytest.raises(OSError, match="injected"):
            stager.load()
        assert not stager.loaded and stager.host_bytes()["mapped"] == mapped
        assert driver.ranges == registered, "the slots locked before the failure are unlocked"
        assert pinning.locked_bytes() == sum(registered.values())

        def failing_synchronize(device):
            raise RuntimeError("injected: the device failed too")

        patch.setattr(_device, "synchronize", failing_synchronize)
        with pytest.raises(OSError, match="injected"):
            stager.load()
        assert driver.ranges == registered, "unlocked even when the device cannot be waited for"
    assert torch.equal(module(x), expected), "the weights are their mapped masters again"
    stager.load()
    stager.offload()
    stager.unmap_masters()
    assert stager.host_bytes()["mapped"] == 0 and torch.equal(module(x), expected)
    stager.close()
    assert driver.ranges == {}


def test_tensors_remade_over_mapped_masters_keep_a_master_per_view(tmp_path, monkeypatch) -> None:
    """Masters mapped from a file are slices of one mapping of the whole file. A tensor remade over
    such a slice (a new parameter over the same data, a transposed view, an alias) must stay with
    that slice when masters are taken again, not take the whole file as its master."""
    module, stager, x = _four_layers_read_back_in_four_pieces(tmp_path, monkeypatch)
    first, second = module[0], module[1]
    first.weight = torch.nn.Parameter(first.weight.detach())
    second.weight.data = second.weight.data.t().contiguous().t()  # a copy: a master of its own
    module[2].register_parameter("alias", module[3].weight)  # tied to a mapped weight
    module[3].weight.data = module[3].weight.data.t().t()  # the same bytes, viewed anew
    expected = module(x)
    stager.retake_masters()
    largest = module[0].weight.nbytes
    assert max(group.nbytes for group in stager._groups) == largest, "one master per weight, not the file"
    assert stager.host_bytes()["mapped"] == 3 * largest
    stager.load()
    assert torch.equal(module(x), expected)
    assert module[2].alias.data_ptr() == module[3].weight.data_ptr(), "still tied"
    stager.offload()
    stager.unmap_masters()
    assert torch.equal(module(x), expected) and stager.host_bytes()["mapped"] == 0


def test_a_budget_too_small_for_the_padded_block_copies_nothing(flux, driver: FakeDriver) -> None:
    transformer = flux.pipe.transformer
    addresses = {name: t.data_ptr() for name, t in weights(transformer).items()}
    exact = sum(t.untyped_storage().nbytes() for t in weights(transformer).values())
    stager = ModuleStager(transformer, CPU, pin_memory=True, pin_budget=exact)  # no room for padding
    assert not stager.pinned and driver.ranges == {}
    assert {name: t.data_ptr() for name, t in weights(transformer).items()} == addresses, "nothing copied"
    stager.close()


_HEAP_RSS_SCRIPT = """
import ctypes, os, torch
libc = ctypes.CDLL(None)
libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: serve allocations below 1 GiB from the heap
from diffusers_residency import _device
from diffusers_residency.staging import ModuleStager
_device.can_register_host_memory = lambda: True  # a driver that registers anything (no GPU here)
_device.register_host_memory = lambda address, nbytes, device=None: True
_device.unregister_host_memory = lambda address, device=None: None

def rss():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

module = torch.nn.Sequential(*(torch.nn.Linear(2048, 2048) for _ in range(8)))  # 128 MiB in the heap
guard = torch.ones(1 << 16)  # keeps the weights off the top of the heap, where free() trims anyway
before = rss()
stager = ModuleStager(module, torch.device("cpu"), pin_memory=True, pin_budget=1 << 40)
print(rss() - before)
"""


@pytest.mark.slow
def test_weights_copied_out_of_the_heap_do_not_stay_resident_twice() -> None:
    """Weights in malloc's heap are copied into masters; the holes they leave are given back, so host
    memory holds them once, not twice."""
    done = subprocess.run([sys.executable, "-c", _HEAP_RSS_SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    growth = int(done.stdout.split()[-1])
    assert growth < 32 << 20, f"RSS grew by {growth / 2**20:.0f} MiB for 128 MiB of weights copied out of the heap"


def _present_pages(tensor: torch.Tensor) -> list[bool]:
    """Whether each page wholly inside the tensor's bytes is mapped in this process now."""
    start = -(-tensor.data_ptr() // PAGE) * PAGE
    end = (tensor.data_ptr() + tensor.numel()) // PAGE * PAGE
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(8 * (start // PAGE))
        entries = pagemap.read(8 * ((end - start) // PAGE))
    return [bool(entries[i + 7] & 0x80) for i in range(0, len(entries), 8)]


def test_a_weight_copied_out_of_a_file_mapping_gives_back_the_pages_it_only_read(tmp_path) -> None:
    path = tmp_path / "weights.bin"
    original = torch.arange(64 * PAGE, dtype=torch.uint8)
    path.write_bytes(original.numpy().tobytes())
    mapped = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=64 * PAGE)
    weight = torch.empty(0, dtype=torch.uint8).set_(mapped, 100, (60 * PAGE,), (1,))  # not page-aligned
    assert int(weight.sum()) > 0 and all(_present_pages(weight)), "read: its pages are mapped"
    weight[20 * PAGE : 20 * PAGE + 10] = 7  # one page written: the process's own copy now
    expected = weight.clone()
    heap = torch.arange(PAGE * 8, dtype=torch.uint8)  # anonymous memory: never given back
    (master, heap_master) = pinning.copy_to_host([weight, heap], [0, 0], 0, pin=False)
    assert torch.equal(master.data, expected) and torch.equal(heap_master.data, heap)
    present = _present_pages(weight)
    written = (20 * PAGE + 100) // PAGE - 1  # the written page among the whole pages inside the weight
    assert present[written] and sum(present) == 1, "every page it only read was given back"
    assert all(_present_pages(heap))
    assert torch.equal(weight, expected), "read again, the file's pages hold the same bytes"


@pytest.mark.skipif(files.READ_THREADS < 2, reason="one reader thread: this copy's held chunk would hold it")
def test_a_ring_with_room_reads_the_next_copy_while_this_one_is_read(tmp_path, monkeypatch) -> None:
    """Where a copy leaves slots free, the next copy's reads start with its own: here this copy's
    last chunk is held until a chunk of the next one has been read, which a read-ahead started
    only once this copy's chunks were all read would never do."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(*(torch.nn.Linear(256, 256, bias=False) for _ in range(2)))
    views = _mapped_checkpoint(tmp_path, module)
    first, second = ([views[id(layer.weight)]] for layer in module)
    kept = ring.Ring(100 << 10, 6, 0, pin=False, device=CPU)  # room for two weights of 3 chunks
    real_fill = ring.Ring._fill
    next_read = threading.Event()
    held: list[bool] = []

    def fill(self: ring.Ring, chunk, k: int, sources) -> bool:
        if sources[0] is second[0]:
            next_read.set()
        elif not held and chunk.parts[-1][1] + chunk.parts[-1][2] == first[0].view.numel():
            held.append(next_read.wait(timeout=10))
        return real_fill(self, chunk, k, sources)

    def copied(sources: list[MappedBytes]) -> torch.Tensor:
        target = torch.empty(sources[0].view.numel(), dtype=torch.uint8)
        kept.copy(sources, [target])
        return target

    try:
        assert torch.equal(copied(first), first[0].view) and torch.equal(copied(second), second[0].view)
        monkeypatch.setattr(ring.Ring, "_fill", fill)
        next_read.clear()
        assert torch.equal(copied(first), first[0].view)
        assert held == [True], "the next copy was read while this one's last chunk waited"
        assert kept._ahead is not None and kept._ahead[0] == second
        assert torch.equal(copied(second), second[0].view)
    finally:
        kept.close()


def test_a_kept_ring_reads_the_copy_that_followed_last_time_ahead_and_never_serves_stale_bytes(tmp_path) -> None:
    torch.manual_seed(0)
    module = torch.nn.Sequential(*(torch.nn.Linear(256, 256, bias=False) for _ in range(3)))
    views = _mapped_checkpoint(tmp_path, module)
    first, second, third = ([views[id(layer.weight)]] for layer in module)
    kept = ring.Ring(100 << 10, 3, 0, pin=False, device=CPU)  # 3 slots: a weight is 3 chunks

    def copied(sources: list[MappedBytes]) -> torch.Tensor:
        target = torch.empty(sources[0].view.numel(), dtype=torch.uint8)
        kept.copy(sources, [target])
        return target

    try:
        for sources in (first, second, first):
            assert torch.equal(copied(sources), sources[0].view)
        assert kept._ahead is not None and kept._ahead[0] == second, "second followed first: read ahead"
        assert all(fill.result() for fill in kept._ahead[3]), "read from the file"
        second[0].view[PAGE : PAGE + 8] = 255  # written through its mapping after it was read ahead
        assert torch.equal(copied(second), second[0].view), "the chunk written since is read again"
        assert kept._ahead is not None and kept._ahead[0] == first
        # Read ahead from views written before (a fused LoRA), then written again (unfused).
        assert torch.equal(copied(first), first[0].view) and kept._ahead[0] == second
        assert not all(fill.result() for fill in kept._ahead[3]), "the written chunk copied from the views"
        second[0].view[PAGE : PAGE + 8] = 7
        assert torch.equal(copied(second), second[0].view), "views written again after the read ahead"
        assert torch.equal(copied(third), third[0].view), "another copy than the one read ahead"
        assert torch.equal(copied(first), first[0].view)
    finally:
        kept.close()
    assert kept._ahead is None
