"""Stage a module's weights on a device from one host master per storage.

Inference does not write to weights, so a module that leaves the device needs no device-to-host copy:
its parameters and buffers are *rebound* to host masters taken once, at attach time, and the device
copy is simply dropped. Loading allocates device storage, copies each master on a side stream and
rebinds the tensors to the device copy.

:class:`ModuleStager` is the load path (load, ready, offload, retake). What it stands on lives
beside it: the masters and their bindings (:mod:`.masters`), where copies go on the device
(:mod:`.placement`), masters mapped from checkpoint files (:mod:`.mapped_masters`), dtype
conversions over the masters (:mod:`.conversions`) and masters read from a copy that the ranks of a
host share (:mod:`.host_copy`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import replace

import torch
from torch import nn

from . import _device, file_reads, pinning
from .conversions import ConversionReuse
from .host_copy import HostCopy, HostCopyReads
from .mapped_masters import FileBackedMasters, FileBacking
from .masters import (
    Backing,
    MasterBindings,
    StorageGroup,
    TensorBinding,
    Views,
    bound_ids,
    claim,
    refuse_staged_elsewhere,
    release,
)
from .placement import DeviceCopies, DeviceSlots
from .retention import RetentionBudget
from .snapshots import snapshot
from .weights import (
    MergingLayers,
    Wrappers,
    module_tensors,
    refuse_shared_quantization_state,
    refuse_unstageable_tensors,
)

logger = logging.getLogger(__name__)


class ModuleStager(MasterBindings, DeviceCopies, FileBackedMasters, ConversionReuse, HostCopyReads):
    """Load a module (or a group of modules) onto a device on demand, from immutable host masters.

    ``load()`` allocates device storage on the compute stream (or takes it from :class:`DeviceSlots`),
    copies every master on the copy stream and makes the compute stream wait for it: the host does not
    wait for the copy. ``offload()`` rebinds every tensor to its master and drops the device storage
    (or gives it to the slots): no device-to-host copy and no host allocation.
    Out of memory on load releases the retained allocator cache and retries once. Whatever fails,
    every tensor is left bound to valid storage: the device copy if the load completed, else the master.
    """

    def __init__(
        self,
        modules: nn.Module | Iterable[nn.Module],
        device: torch.device,
        *,
        pin_memory: bool,
        pin_budget: int | float | None = None,
        copy_stream: torch.Stream | None = None,
        retention: RetentionBudget | None = None,
        exclude: Iterable[nn.Module] = (),
        one_buffer: bool | Callable[[int], bool] = True,
        moves_weights: Callable[[], bool] | None = None,
        file_backing: FileBacking | None = None,
        host_copy: HostCopy | None = None,
    ) -> None:
        """``moves_weights``: whether the modules' forwards move weights to storage of their own
        (diffusers' layerwise casting does), in which case a load does not take one buffer: the
        weights left where the load put them would hold every moved one's place in it too. Asked
        where masters are taken, where an offload finds weights moved, and where the owner says
        (:meth:`note_moves_weights`).
        ``file_backing``: masters to keep in checkpoint files (see :class:`~.mapped_masters.FileBacking`).
        Their weights are taken as masters where they are, neither copied nor page-locked (locking a
        mapping of a file would copy each page of it into anonymous memory), and then swapped for
        the views of the files. ``host_copy``: the copy of the weights that the ranks of this host
        share, which loads read for the masters in it (see :mod:`.host_copy`)."""
        self.modules = (modules,) if isinstance(modules, nn.Module) else tuple(modules)
        if not self.modules or not all(isinstance(m, nn.Module) for m in self.modules):
            raise TypeError("ModuleStager needs at least one nn.Module")
        # Submodules whose tensors are not this stager's (blocks streamed by stagers of their own).
        self.exclude = tuple(exclude)
        refuse_unstageable_tensors(self.modules, "The module")
        refuse_shared_quantization_state(self.modules)
        refuse_staged_elsewhere(self.modules, "The module", exclude=self.exclude)
        self.closed = False
        self.device = device
        self.pin_memory = pin_memory
        # Bytes this process may keep page-locked when this stager pins a master; None: never pin.
        self.pin_budget = pinning.resolve_pin_budget(pin_budget) if pin_memory else None
        self.retention = retention
        # Whether a load may take one device buffer for all its storages (see _placed), or a
        # function of the load's bytes that says so: asked at each load (a cast to a wider dtype
        # changes them). Whether the forwards move weights walks every submodule: asked where the
        # masters are taken, where an offload finds weights moved to storage of their own
        # (layerwise casting enabled after the masters were taken, on weights of its storage
        # dtype), and where the owner says (see note_moves_weights).
        self._one_buffer = one_buffer
        self._ask_moves_weights = moves_weights
        self.note_moves_weights()
        self.loaded = False
        self.loads = 0
        # Moved by all timed loads (all but those that read their masters back from files), a figure
        # that survives retakes.
        self.loaded_bytes = 0
        # Device storage of a load, one per group: held from allocation on, so a failure path can
        # synchronise before dropping it, and, for a load into DeviceSlots, while loaded, so that
        # the offload can hand it to the next block's load.
        self._device_storages: list[torch.Tensor] = []
        self._slot_layout: tuple = ()
        # Each tensor's binding, the address the last load bound it to and its version counter then
        # (None for an inference tensor, which has none), the wrappers' counters and the adapters
        # merged into each adapter layer's base: at offload, a tensor with a new layout was replaced
        # while loaded, and one where the load put it whose counter (or its wrapper's) moved, or
        # whose layer's merged adapters changed, was written in place.
        self._loaded_state: tuple[tuple[TensorBinding, int, int | None], ...] = ()
        self._loaded_wrapper_versions: tuple[int | None, ...] = ()
        self._loaded_merges: tuple[tuple[str, ...], ...] = ()
        self._copy = _device.TimedCopy(device, copy_stream)
        # A read-back of masters mapped from files, with the groups it reads: started when a load
        # copied them from the files (see read_ahead), taken by the next load, by a forward or an
        # offload once done, or waited for by unmap_masters.
        self._reading_ahead: tuple[tuple[StorageGroup, ...], file_reads.ReadBack] | None = None
        # Whether a load from masters mapped from files starts reading them back as soon as its
        # copies are done; a wake sets it False while it loads, and reads them back after.
        self.reads_back_after_loading = True
        # Where each group's copy goes in a load's buffer, the buffer's size, and the copies that
        # fill it (see _placed), for a layout and the masters' addresses.
        self._placement: tuple[tuple, tuple[int, ...], int, tuple[tuple[int, int], ...]] = ((), (), 0, ())
        # The views over the current and the kept masters, each with the groups it was made for, by
        # id of those (see _master_views).
        self._master_views_by: dict[int, tuple[tuple[StorageGroup, ...], Views]] = {}
        self.file_backing = file_backing
        # Bytes loaded from masters kept in checkpoint files, and the host seconds those loads took.
        self.read_bytes = 0
        self.read_seconds = 0.0
        self.host_copy = host_copy
        self._shared_versions = None
        self._wrapper_versions = {}
        self._groups, copied_host = snapshot(self.tensors(), None if file_backing else self.pin_budget, (), host_copy)
        # What the last load did (before one, what it would do).
        self.one_buffer = self._one_buffer_wanted()
        self._find_wrappers()
        self._init_conversions()
        claim(self, self._groups)
        self.rebind_masters()
        if copied_host:  # their originals were freed by the rebinding just done
            _device.release_freed_host_heap()
        if file_backing is not None:
            self.map_masters(file_backing.sources, compare=False)
        if retention is not None:
            retention.grow(self.weight_bytes)

    @property
    def _groups(self) -> tuple[StorageGroup, ...]:
        return self._current_groups

    @_groups.setter
    def _groups(self, groups: tuple[StorageGroup, ...]) -> None:
        self._current_groups = groups
        self._current_bound_ids = bound_ids(groups)
        # Where the copies go in a load's one buffer: worked out once per set of masters, not at
        # every load (see _placed).
        self._current_placement = None
        # Whether a load has masters to read back from files: found here, where the masters change,
        # and not at every load (a streamed block loads at every step).
        self._maps_files = any(group.mapped for group in groups)
        self._reads_host_copy = any(group.read_from is not None for group in groups)
        if self._reads_host_copy:
            self._note_shared_versions()
        # A read of masters that are no longer the current ones (taken again after a cast) would
        # hold its memory, unused, until the next load: stopped here, where the masters change.
        if self._reading_ahead is not None and self._reading_ahead[0] is not groups:
            self.drop_read_ahead()

    @property
    def load_seconds(self) -> float:
        return self._copy.seconds

    @property
    def load_in_flight(self) -> bool:
        """Whether the last load may still be copying (asked, not waited for): reading
        :attr:`load_seconds` would wait for it."""
        return self._copy.in_flight

    def _find_wrappers(self) -> None:
        """The wrapper subclasses among the modules' tensors (quantized weights): their device
        follows their bound inner tensors, and a write into one moves its own counter only; and
        the adapter layers that merge into their base weights, where no counter moves at all."""
        self._wrappers = Wrappers.among(module_tensors(self.modules, self.exclude))
        self._merging = MergingLayers.among(self.modules, self.exclude)
        if self._reads_host_copy:
            self._note_wrapper_versions()

    def rebind_masters(self) -> None:
        """Bind every tensor to its master, whatever it is bound to now (after a failed move)."""
        self._assign(self._master_views())
        self._device_storages = []
        self._loaded_state, self._loaded_wrapper_versions, self._loaded_merges = (), (), ()
        self.loaded = False

    def _one_buffer_wanted(self) -> bool:
        wanted = self._one_buffer
        return (wanted(self.weight_bytes) if callable(wanted) else wanted) and not self._moves_weights

    def note_moves_weights(self) -> None:
        """Ask again whether the modules' forwards move weights (see ``moves_weights``)."""
        self._moves_weights = self._ask_moves_weights is not None and self._ask_moves_weights()

    def _load_once(self, slots: DeviceSlots | None) -> None:
        same_placing = self.one_buffer == self._one_buffer_wanted()
        if self.loads and not self._maps_files and self._reading_ahead is None and same_placing:
            # The masters were current at the last load, and nearly always still are: the copies
            # are queued first, and the modules are checked while the device runs them: checked
            # before, the walk delays the first byte of a large UNet by milliseconds, a tenth of
            # its wake (docs/measurements.md). A change found after
            # (a parameter replaced while offloaded, layerwise casting enabled) throws the copy
            # away and loads again. Masters read back or mapped from files are checked before:
            # the load itself changes them.
            try:
                backings = self._copy_to_device(slots, None)
                current = self.masters_current()
            except BaseException:
                # Nothing is bound to the copies yet, but a weight replaced while offloaded has no
                # master yet either: the failed load's fallback (see _load) rebinds every tensor to
                # its master, and would put the old weight back.
                self.retake_masters()
                raise
            if current:
                self._bind_loaded(backings, slots, timed=True, from_files=False)
                return
            logger.debug("Modules changed since their last load: copying again")
            self._copy.join()  # the storage's next user waits for the copy into it
            self._device_storages = []
            self.loaded_bytes += self.weight_bytes  # moved all the same: the load rate counts it
            del backings
        self.retake_masters()
        self.one_buffer = self._one_buffer_wanted()
        reading = self._read_back()
        from_files = reading is None and self._maps_files
        try:
            backings = self._copy_to_device(slots, reading)
        except BaseException:
            if reading is not None:
                try:
                    _device.synchronize(self.device)  # the copies queued so far read pieces about to be unlocked
                except Exception:
                    # A device that cannot be waited for has failed; its copies will not read again.
                    logger.debug("Device synchronisation failed before unlocking masters read back", exc_info=True)
                finally:
                    reading.abandon()
            raise
        self._bind_loaded(backings, slots, timed=reading is None and not from_files, from_files=from_files)

    def _bind_loaded(
        self, backings: list[Backing], slots: DeviceSlots | None, *, timed: bool, from_files: bool
    ) -> None:
        """Bind the modules' tensors to the storage a load's copies were queued into."""
        self._bind(backings)
        if slots is None:
            # From here on the bound views keep the buffer alive, and let it go once they have all
            # moved to storage of their own (layerwise casting does, at every forward). A buffer to
            # be handed to the next block is held here instead, at most a window of blocks' worth.
            self._device_storages = []
        self._loaded_state = tuple(
            (b, b.target.data_ptr(), None if b.inference else b.target._version)
            for g in self._groups
            for b in g.bindings
        )
        self._loaded_wrapper_versions = self._wrappers.versions() if self._wrappers.tensors else ()
        self._loaded_merges = self._merging.states() if self._merging.layers else ()
        self.loaded = True
        self.loads += 1
        if timed:
            self.loaded_bytes += self.weight_bytes
        if from_files and self.reads_back_after_loading:
            try:
                self.read_ahead()
            except Exception:
                # The load stands: the masters stay mapped, and the offload checks their files.
                logger.warning("Could not start reading masters back from their checkpoint files", exc_info=True)

    def _fall_back_to_masters(self) -> None:
        """After a failure: wait for in-flight copies into the storage about to be dropped, rebind the
        masters, and give the allocator's cache back so a retry (or the next component) finds room."""
        try:
            _device.synchronize(self.device)
        except Exception:
            logger.debug("Device synchronisation failed while restoring host masters", exc_info=True)
        self.rebind_masters()
        if self.retention is not None:
            self.retention.release(reason="failed-load")
        else:
            _device.empty_cache(self.device)

    def load(self, *, ahead: bool = False, slots: DeviceSlots | None = None) -> None:
        """Bring the weights onto the device, into storage from ``slots`` when it has some of their
        layout; a no-op when they are there (the compute stream then waits for them, unless
        ``ahead``: loaded before they are needed, :meth:`ready` is called where they are).

        Weights replaced or added while offloaded (a LoRA adapter injected, projections fused, a
        submodule cast) get masters first (see :meth:`retake_masters`); masters of unchanged
        storages are reused as they are, so that copies only what is new."""
        if self.loaded:
            if not ahead:
                self.ready()
            return
        if self._reads_host_copy:
            self._copy_written_in_place()
        if self._conversions_to_forget():
            # No copy still reads the kept masters: the last one that did was queued before the
            # conversion, and the first load after it waited for that copy to end (TimedCopy.running
            # collects the previous copy before queueing the next).
            self.forget_conversions()
        self._load(ahead, slots)

    def ready(self) -> None:
        """Make the compute stream wait for the last load's copy (on the device, not the host). Called
        before every forward of a loaded unit, which also takes masters read back since it was
        loaded from the files, once that read is done (see :meth:`_settle_mapped_masters`)."""
        if self._reading_ahead is not None and self._reading_ahead[1].done():
            self._settle_mapped_masters()
        self._copy.join()

    def _load(self, ahead: bool, slots: DeviceSlots | None) -> None:
        try:
            self._load_once(slots)
        except torch.OutOfMemoryError:
            logger.info(
                "Out of memory staging %d bytes on %s; releasing the retained cache and retrying once",
                self.weight_bytes,
                self.device,
            )
            self._fall_back_to_masters()
            try:
                self._load_once(slots)
            except BaseException:
                self._fall_back_to_masters()
                raise
        except BaseException:
            self._fall_back_to_masters()
            raise
        if not ahead:
            self.ready()

    def offload(self, *, slots: DeviceSlots | None = None) -> None:
        """Rebind every tensor to its host master and drop the device copy, or give its storage to
        ``slots``; a tensor replaced while loaded keeps its new value and gets a master of its own.

        No synchronisation is needed: the device storage was allocated on the compute stream, so the
        allocator hands its blocks only to later work on that stream, which runs after the reads
        already queued there; a copy into storage from ``slots`` first waits for that compute.
        """
        if not self.loaded:
            return
        # A copy made ahead and never used: order it before the compute work that may get its
        # storage next.
        self.ready()
        if self._maps_files:
            self._settle_mapped_masters()
        replaced, written, moved = self._changed_while_loaded()
        if moved and not self._moves_weights:
            self.note_moves_weights()  # layerwise casting may have been enabled since
            if not self._moves_weights:
                # Not layerwise casting, whose moves leave the values the masters hold: given storage
                # of their own some other way (``weight.data = w`` of the same layout, a submodule's
                # ``.to(dtype)`` there and back), they hold the weights now, kept as writes are.
                written = [*written, *moved]
        if written:
            replaced |= self._keep_writes(written)
            # Written where no version counter shows it (a moved tensor's copy), and maybe after
            # this call's comparison of the masters with their copy ran (see check_sources_ahead).
            self.note_masters_written()
        storages, self._device_storages = self._device_storages, []
        if not replaced:
            self.rebind_masters()
            # Just rebound, every bound tensor is on its master: only their identity is left to check.
            if self._holds_only_bound_tensors():
                # Only storage that none of the modules' tensors still reaches is handed on: a
                # parameter replaced while loaded by one over the same storage
                # (``nn.Parameter(w.detach())``) would get the next block's weights copied into it.
                if slots is not None and storages:
                    slots.give(self._slot_layout, storages)
                return
            # Tensors added while loaded (``fuse_qkv_projections()``, a new adapter) were made where
            # the weights were, bound to no master: left there, a sleep or a disable would leave
            # them on the device. (A walk of the modules per offload, while the device still runs
            # what was queued.)
            self.retake_masters()
            return
        # Tensors replaced while loaded (layers cast to a storage dtype, weights assigned through
        # `.data`) are the module's weights now, and rebinding them to their masters would undo
        # that: keep them, bind the rest, and take masters for them (a copy of those alone).
        logger.info("%d tensors were replaced while loaded; taking masters for them", len(replaced))
        self._assign(self._master_views(), keep=replaced)
        self._loaded_state, self._loaded_wrapper_versions, self._loaded_merges = (), (), ()
        self.loaded = False
        self.retake_masters()

    def offload_for_writing(self) -> None:
        """Offload, and wait until no copy still reads the masters: they are about to be written."""
        self.offload()
        self._copy.wait()
        self.note_masters_written()

    def retake_masters(self) -> None:
        """Take new masters after the modules' tensors were replaced (a dtype cast such as SDXL's VAE
        upcast, a device move, new parameters). Expects the stager offloaded; a no-op if nothing changed.
        Storages still on their masters keep them, page-locked as they were."""
        let_go = self._retake()
        if let_go:
            self._wait_before_letting_go(let_go)

    def _wait_before_letting_go(self, groups: tuple[StorageGroup, ...]) -> None:
        # The last load may still be copying from these masters, and letting them go may unlock and
        # free them. (Held by ``groups`` until this returns.)
        self._copy.wait()

    def _retake(self) -> tuple[StorageGroup, ...]:
        """:meth:`retake_masters`, returning the groups whose masters it let go, for the caller to
        wait for copies still reading them (see :meth:`_wait_before_letting_go`) before dropping them."""
        self._require_offloaded("retake_masters()")
        tensors = list(self.tensors())  # walked once: a cast retakes the masters of every block
        if self.masters_current(tensors):
            return ()
        if any(t.is_meta for t in tensors):
            refuse_unstageable_tensors(self.modules, "The module")
        old = self._groups
        before = self.weight_bytes
        self._groups, copied_host = snapshot(tensors, self.pin_budget, self._groups + self._kept_groups, self.host_copy)
        self.forget_last_conversion()
        self._find_wrappers()
        self.note_moves_weights()
        active = {id(group.master) for group in self._groups}
        self._kept_groups = tuple(group for group in self._kept_groups if id(group.master) not in active)
        try:
            claim(self, self._groups)
            self.rebind_masters()
            if self._reads_host_copy:
                # A tensor newly bound over pages this rank wrote (see _note_shared_versions), before
                # the load this retake is part of reads the host's copy.
                self._copy_written_in_place()
            if copied_host:
                # A trim walks all of malloc's heap (milliseconds): only when copies into masters
                # freed the originals. (Conversion results dropped for kept masters leave holes too,
                # of the same sizes at every call, which the next call's conversions fill.)
                _device.release_freed_host_heap()
            if self.retention is not None:
                self.retention.resize(before, self.weight_bytes)
        except BaseException:
            # The old masters go with ``old`` when this raises, and the last load may still be
            # copying from them: the same wait as for masters let go on success.
            self._wait_before_letting_go(old)
            raise
        logger.debug("Retook host masters: %d -> %d bytes", before, self.weight_bytes)
        return tuple(group for group in old if id(group.master) not in active)

    def _require_offloaded(self, what: str) -> None:
        if self.loaded:
            raise RuntimeError(f"{what} needs the stager offloaded first")

    def close(self) -> None:
        """Leave every tensor on a host master of its own and forget the device; the stager is
        unusable after."""
        self.offload()
        self.unmap_masters(pin=False)
        self._copy.wait()
        self.forget_conversions()
        # Unlock the masters now rather than whenever the stager is collected: the tensors keep
        # the memory, pageable again, as it was before the stager pinned it.
        self._groups = tuple(
            replace(group, pinned=group.pinned and group.pin is None, pin=None) for group in self._groups
        )
        self._master_views_by = {}
        if self.retention is not None:
            self.retention.shrink(self.weight_bytes)
            self.retention = None
        release(self, self._groups)
        self.closed = True
