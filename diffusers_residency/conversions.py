"""Dtype conversions of staged modules, run over their masters, with the masters from before the
last one kept for the way back.

Pipelines cast a component and back inside every call (SDXL upcasts its VAE to float32 to decode
and casts it back to float16): a result with the same bits as a kept master is bound to it instead
of becoming a new one, and once a pair of casts has settled, a cast binds the kept masters without
converting anything, when nothing can have written the masters it converts from (see
:meth:`ConversionReuse.convert`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import nn

from .files import equal_bytes
from .masters import StorageGroup, TensorBinding, Views, bound_as_taken
from .retention import RetentionBudget

logger = logging.getLogger(__name__)

T = TypeVar("T")


# When a stager lets go of the masters kept from before its last conversion (see
# ConversionReuse.convert): at a load, once it has loaded this many times since, and more than twice as
# often as it ever did between two conversions. A component cast and cast back inside each call
# (SDXL's VAE) loads about as often between its casts at every call: once, or once per tile or
# slice, or once per preview decode between calls. One that goes on loading without a cast was cast
# for good, and would hold its old masters (and page-locked memory under the pin budget) forever.
LOADS_KEEPING_CONVERSIONS = 2


# Integer dtypes by item size, widest first: comparing tensors through them compares bits, not
# values (0.0 and -0.0 differ, a NaN equals itself).
_BITS_BY_ITEMSIZE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
# Tensor types whose bytes are their values (a subclass may keep them elsewhere, or none).
_PLAIN = (torch.Tensor, nn.Parameter)


def as_bits(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors (of one dtype and layout) as integers of their bits: for contiguous ones, the
    widest integers that tile all their bytes. ``torch.equal`` takes about as long per element
    whatever its width, so float16 weights compared as 8-byte words take a quarter of the time they
    take as 2-byte ones."""
    if all(t.is_contiguous() for t in tensors):
        flat = [t.reshape(-1).view(torch.uint8) for t in tensors]
        for size, bits in _BITS_BY_ITEMSIZE.items():
            if all(f.numel() % size == 0 and f.storage_offset() % size == 0 for f in flat):
                return tuple(f.view(bits) for f in flat)
    bits = _BITS_BY_ITEMSIZE[tensors[0].dtype.itemsize]
    return tuple(t.view(bits) for t in tensors)


def same_bits(kept: torch.Tensor, fresh: torch.Tensor) -> bool:
    """Whether ``kept`` can stand for ``fresh``: same dtype and layout, and the same bits throughout.

    Plain host tensors laid out densely, as masters and conversions' results are, are compared by
    ``memcmp`` (see :func:`~.files.equal_bytes`): SDXL's VAE compares 160 MB of masters at each
    call's upcast, which ``torch.equal`` spread over every core of the host."""
    if kept.dtype != fresh.dtype or kept.shape != fresh.shape or kept.stride() != fresh.stride():
        return False
    if kept.dtype.itemsize not in _BITS_BY_ITEMSIZE:
        return False
    if all(type(t) in _PLAIN and t.device.type == "cpu" and t.is_contiguous() for t in (kept, fresh)):
        return equal_bytes(kept, fresh)
    return torch.equal(*as_bits(kept, fresh))


def conversion_key(source: torch.Tensor, dtype: torch.dtype) -> tuple:
    """Where a converted tensor came from (its bytes' address and layout), and the dtype it went to."""
    return (source.data_ptr(), source.dtype, tuple(source.shape), source.stride(), dtype)


@dataclass(eq=False)
class SourcesCheck:
    """A comparison of a stager's masters with the copy made of them (see
    :meth:`ConversionReuse._note_conversion`), run on a thread of its own from the start of a
    pipeline call (see :func:`check_sources_ahead`)."""

    groups: tuple[StorageGroup, ...]
    copies: tuple[torch.Tensor, ...]
    call: int
    done: threading.Event = field(default_factory=threading.Event)
    same: bool = False

    def run(self) -> None:
        try:
            self.same = all(same_bits(group.master, copy) for group, copy in zip(self.groups, self.copies))
        except Exception:
            # Not known to be the same: the cast converts afresh, which is always right.
            logger.debug("Comparing masters with their copy failed", exc_info=True)
        finally:
            self.done.set()


def check_sources_ahead(stagers: Sequence[ConversionReuse], call: int) -> None:
    """Pipeline call ``call`` begins: compare, on one thread, the masters of each stager that keeps a
    copy of them with that copy, for the call's first cast to take (see
    :meth:`ConversionReuse._sources_unchanged`).

    SDXL's VAE compares 160 MB at its upcast, which comes after the whole denoising loop: compared
    there, on the thread that launches the call's kernels, every millisecond of it is a millisecond
    of the call (its UNet's steps wait on that thread). Compared meanwhile, the upcast only waits
    for the answer. The thread holds the GIL only between comparisons (``memcmp`` lets go of it)."""
    started = [(stager, check) for stager in stagers if (check := stager._start_sources_check(call)) is not None]
    if not started:
        return
    checks = [check for _, check in started]
    thread = threading.Thread(target=_run_checks, args=(checks,), name="diffusers_residency-sources-check", daemon=True)
    try:
        thread.start()
    except BaseException as error:
        # No thread to be had (or the interpreter shutting down): the casts compare on their own
        # thread, as between calls. A check left behind would be waited for and never answered.
        for stager, _ in started:
            stager._sources_check = None
        if not isinstance(error, Exception):
            raise
        logger.debug("Could not start comparing masters ahead of the call's casts", exc_info=True)


def _run_checks(checks: Sequence[SourcesCheck]) -> None:
    for check in checks:
        check.run()


class ConversionReuse:
    """:meth:`convert` and the masters it keeps. Part of :class:`~.staging.ModuleStager`, whose
    masters, loads and retakes it uses."""

    loads: int
    retention: RetentionBudget | None
    _groups: tuple[StorageGroup, ...]
    _maps_files: bool
    _master_views_by: dict[int, tuple[tuple[StorageGroup, ...], Views]]

    def _init_conversions(self) -> None:
        # Masters the last conversion left, and a view of each tensor it converted, on both sides,
        # by where it came from: the way back finds its master among them.
        self._kept_groups: tuple[StorageGroup, ...] = ()
        self._kept_conversions: dict[tuple, torch.Tensor] = {}
        # The keys of _kept_conversions whose master is known to hold what converting from the key's
        # source gives (computed from it, or compared with what it gives): the way back of a
        # narrowing (float32 to float16 and up again) does not give the masters it came from.
        self._verified_conversions: set[tuple] = set()
        self._loads_at_conversion: int | None = None
        self._most_loads_between_conversions = 0
        # The last conversion: the pipeline call it was made in (None: outside one), the masters it
        # left current, and their tensors' version counters then (None: an inference tensor has none).
        self._last_conversion: tuple[int | None, tuple[StorageGroup, ...], tuple | None] | None = None
        # A copy of the masters that the first conversion of a call converted from, with those masters,
        # made where it converted them afresh: the next call's first conversion compares with it.
        self._sources_copy: tuple[tuple[StorageGroup, ...], tuple[torch.Tensor, ...]] | None = None
        # The comparison with that copy started as the latest pipeline call began (see check_sources_ahead).
        self._sources_check: SourcesCheck | None = None

    def _conversions_to_forget(self) -> bool:
        """Whether the kept masters can go (see LOADS_KEEPING_CONVERSIONS), asked before a load."""
        return bool(self._kept_groups) and self._loads_since_conversion() >= max(
            LOADS_KEEPING_CONVERSIONS, 2 * self._most_loads_between_conversions + 1
        )

    def convert(
        self,
        apply: Callable[[Callable[[torch.Tensor], torch.Tensor]], T],
        fn: Callable[[torch.Tensor], torch.Tensor],
        *,
        dtype: torch.dtype | None = None,
        call: int | None = None,
    ) -> T:
        """Run a conversion of the modules (``apply``: ``nn.Module._apply``, ``fn``: what ``.to(dtype)``
        or ``.half()`` gives it) over the masters, and take its results as the new masters.
        ``dtype``: the dtype ``fn`` casts floating tensors to, where known (``module.to(dtype)``);
        ``call``: the pipeline call under way, if any.

        Pipelines cast a component and back inside every call: SDXL upcasts its VAE to float32 to
        decode and casts it back to float16. Taking every result as a new master page-locked fresh
        host memory twice a call, at about half a second per GiB (docs/measurements.md). So the masters from
        before the last conversion are kept, and a result with the same bits as one of them (the
        float16 weights, on the way back) is bound to it instead. A result is computed and
        compared unless its source cannot have changed since the kept master was made from it (see
        :meth:`_sources_unchanged`): a master written in place since (a LoRA fused into it) fails
        the comparison, and the fresh result is taken.
        """
        self.offload()
        # Tensors added since the masters were taken (a fused projection's) get masters first, as
        # they are: converted first under inference mode (a call made in it casting SDXL's VAE),
        # they would be taken as the inference tensors it gives, whose writes no counter shows.
        self.retake_masters()
        before = self._groups
        # Masters that view a checkpoint file (asleep at level 2) are slices of the file's mapping,
        # not storages of their own: bound to one, the weights would keep the file as their master.
        own = {id(b.target): (b, group.master) for group in before if not group.mapped for b in group.bindings}
        # (where the source was bound, its master, the tensor that takes the result)
        converted: list[tuple[TensorBinding, torch.Tensor, torch.Tensor]] = []
        unchanged = dtype is not None and bool(self._kept_groups) and self._sources_unchanged(call)
        compared_equal: set[tuple] = set()

        def reusing(tensor: torch.Tensor) -> torch.Tensor:
            bound = own.get(id(tensor))
            if unchanged and bound is not None and tensor.dtype != dtype and bound_as_taken(*bound):
                # A conversion of one dtype to another is a function of the bits: a kept master
                # verified to hold it, neither side written since, holds what it would give.
                key = conversion_key(tensor, dtype)
                if key in self._verified_conversions:
                    kept = self._kept_conversions[key]
                    converted.append((*bound, tensor if isinstance(tensor, nn.Parameter) else kept))
                    return kept
            result = fn(tensor)
            if bound is None or not isinstance(result, torch.Tensor) or result is tensor or result.device.type != "cpu":
                # Not a host copy of one of this stager's tensors: a block's (staged on its own), a
                # DTensor (its shard is what is bound), a mapped master's, a tensor the conversion
                # left as it was, or one it moved to a device. Taken by retake_masters as it comes.
                return result
            key = conversion_key(tensor, result.dtype)
            kept = self._kept_conversions.get(key)
            if kept is not None and same_bits(kept, result):
                result = kept
                compared_equal.add(key)
            # The module keeps a parameter and takes its new data; a buffer is replaced.
            converted.append((*bound, tensor if isinstance(tensor, nn.Parameter) else result))
            return result

        kept_before = self._kept_groups
        result = apply(reusing)
        if converted and self._kept_groups and self._bound_to(self._kept_groups, list(self.tensors())):
            if not unchanged:
                # A source may have changed since the ways back were compared: none stands.
                self._verified_conversions = set()
            self._verified_conversions |= compared_equal
            self._swap_kept_masters()
            self._note_conversion(call, before, fresh=not unchanged)
            return result
        let_go = self._retake()
        if not converted:
            # Nothing to keep from this one (a cast to the dtype it has): what was kept stands, and
            # so do the counters noted at the last conversion (a write since is still to be seen).
            if let_go:
                self._wait_before_letting_go(let_go)
            return result
        bound = {id(b.target): (b, group.master) for group in self._groups for b in group.bindings}
        kept_conversions, verified = {}, set()
        with torch.inference_mode(False):
            for source_binding, source_master, target in converted:
                if id(target) not in bound:
                    continue
                binding, master = bound[id(target)]
                source, now = source_binding.view_over(source_master), binding.view_over(master)
                kept_conversions[conversion_key(source, now.dtype)] = now
                kept_conversions[conversion_key(now, source.dtype)] = source
                verified.add(conversion_key(source, now.dtype))
        masters = {id(group.master) for group in self._groups}
        kept = tuple(group for group in before if id(group.master) not in masters and not group.mapped)
        # All of them (the usual case) is the very tuple their cached master views were made for.
        self._kept_groups = before if len(kept) == len(before) else kept
        self._kept_conversions, self._verified_conversions = kept_conversions, verified
        # Kept masters are not let go: a cast and its way back wait for no copy (the device may
        # still be loading the blocks that ran just before the cast; the host converts meanwhile).
        held = masters | {id(group.master) for group in self._kept_groups}
        dropped = tuple(group for group in before + kept_before if id(group.master) not in held)
        if dropped:
            self._wait_before_letting_go(dropped)
        self._count_conversion()
        self._note_conversion(call, before, fresh=True)
        return result

    def _sources_unchanged(self, call: int | None) -> bool:
        """Whether the current masters still hold what they held at the last conversion, so that a
        kept master known to hold a conversion of one (see ``_verified_conversions``) stands for it.

        Inside a pipeline call, after a conversion made in the same call (SDXL's cast back after its
        decode), the masters were bound since that conversion to the modules alone, which only
        the pipeline's code used: their version counters tell whether anything wrote them. A write
        through ``.data`` moves no counter, and is not seen there (docs/changing-weights.md).
        Between calls, anything may have written them: the counters must stand too, and the
        masters must equal the copy made when they were last converted afresh
        (:meth:`_note_conversion`), a comparison of the sources' bytes alone, where converting and
        comparing the results reads three times as many for SDXL's VAE. Compared as this call began
        (see :func:`check_sources_ahead`), they are taken as they were then: from there on, as for a
        cast within one call, the counters tell."""
        last = self._last_conversion
        if self._maps_files or last is None or last[1] is not self._groups:
            return False
        noted_in, _, versions = last
        if versions is not None and any(target._version != version for target, version in versions):
            return False
        if call is not None and noted_in == call:
            return versions is not None
        copy = self._sources_copy
        if copy is None or copy[0] is not self._groups:
            return False
        check = self._sources_check
        if check is not None and check.call == call and check.groups is self._groups and check.copies is copy[1]:
            check.done.wait()
            return check.same
        return all(same_bits(group.master, bytes_then) for group, bytes_then in zip(self._groups, copy[1]))

    def _start_sources_check(self, call: int) -> SourcesCheck | None:
        """The comparison :meth:`_sources_unchanged` would make in pipeline call ``call``, to run
        ahead of it (see :func:`check_sources_ahead`), or None where it would make none."""
        copy = self._sources_copy
        if copy is None or copy[0] is not self._groups or self._maps_files:
            self._sources_check = None
            return None
        self._sources_check = SourcesCheck(copy[0], copy[1], call)
        return self._sources_check

    def _note_conversion(self, call: int | None, before: tuple[StorageGroup, ...], *, fresh: bool) -> None:
        """Record what :meth:`_sources_unchanged` asks after a conversion from ``before``; ``fresh``:
        one whose sources may have changed, or that took new masters.

        A fresh conversion breaks what the copy of the sources promised (masters that the kept
        ones were verified against): the copy goes, and one is made of the sources of the first
        conversion of a call, where they all became the kept masters. Made once for SDXL's VAE
        (its float16 masters), and compared at every call's upcast."""
        last = self._last_conversion
        first_of_call = call is not None and (last is None or last[0] != call)
        bindings = [b for group in self._groups for b in group.bindings]
        versions = None if any(b.inference for b in bindings) else tuple((b.target, b.target._version) for b in bindings)
        self._last_conversion = (call, self._groups, versions)
        if not fresh:
            return
        self._sources_copy = self._sources_check = None
        if first_of_call and self._kept_groups is before:
            with torch.inference_mode(False):
                self._sources_copy = (before, tuple(group.master.clone() for group in before))

    def note_masters_written(self) -> None:
        """Something is about to write into the current masters where no version counter may show
        it (peft merges a LoRA through ``.data``): the next conversion compares its results."""
        self._last_conversion = None

    def forget_last_conversion(self) -> None:
        """The masters were taken again: what the last conversion noted of the ones before goes
        (it would hold them, and tensors the modules no longer have), and the copy of its sources."""
        self._last_conversion = None
        self._sources_copy = self._sources_check = None

    def _swap_kept_masters(self) -> None:
        """Make the kept masters current and the current ones kept, after a conversion that bound
        every tensor to a kept master: the second cast of a pair, such as SDXL's VAE going back to
        float16, or, from the second call on, going up to float32 again. Nothing to group, pin or
        rebind, no view to make, and no master let go; the kept conversions hold both ways already."""
        before = self.weight_bytes
        self._groups, self._kept_groups = self._kept_groups, self._groups
        if self.retention is not None:
            self.retention.resize(before, self.weight_bytes)
        self._count_conversion()

    def _count_conversion(self) -> None:
        if self._loads_at_conversion is not None:
            self._most_loads_between_conversions = max(self._most_loads_between_conversions, self._loads_since_conversion())
        self._loads_at_conversion = self.loads

    def _loads_since_conversion(self) -> int:
        return self.loads - (self._loads_at_conversion or 0)

    @property
    def keeps_conversions(self) -> bool:
        """Whether masters from before the last conversion are kept (see :meth:`convert`)."""
        return bool(self._kept_groups)

    def forget_conversions(self) -> None:
        """Let go of the masters kept from before the last conversion (their memory, if nothing else holds it)."""
        self._kept_groups = ()
        self._kept_conversions = {}
        self._verified_conversions = set()
        self.forget_last_conversion()
        # Their views, too: they hold the masters' memory.
        self._master_views_by = {key: entry for key, entry in self._master_views_by.items() if entry[0] is self._groups}
