"""Dtype conversions of staged modules, run over their masters, with the masters from before the
last one kept for the way back.

Pipelines cast a component and back inside every call (SDXL upcasts its VAE to float32 to decode
and casts it back to float16): a result with the same bits as a kept master is bound to it instead
of becoming a new one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

from .masters import StorageGroup, TensorBinding, Views
from .retention import RetentionBudget

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


def as_bits(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors (of one dtype and layout) as integers of their bits: for contiguous ones, the
    widest integers that tile all their bytes. ``torch.equal`` on the host takes about as long per
    element whatever its width, so float16 weights compared as 8-byte words take a quarter of the
    time they take as 2-byte ones (SDXL's VAE casts compare 0.5 GB at each call)."""
    if all(t.is_contiguous() for t in tensors):
        flat = [t.reshape(-1).view(torch.uint8) for t in tensors]
        for size, bits in _BITS_BY_ITEMSIZE.items():
            if all(f.numel() % size == 0 and f.storage_offset() % size == 0 for f in flat):
                return tuple(f.view(bits) for f in flat)
    bits = _BITS_BY_ITEMSIZE[tensors[0].dtype.itemsize]
    return tuple(t.view(bits) for t in tensors)


def same_bits(kept: torch.Tensor, fresh: torch.Tensor) -> bool:
    """Whether ``kept`` can stand for ``fresh``: same dtype and layout, and the same bits throughout."""
    if kept.dtype != fresh.dtype or kept.shape != fresh.shape or kept.stride() != fresh.stride():
        return False
    if kept.dtype.itemsize not in _BITS_BY_ITEMSIZE:
        return False
    return torch.equal(*as_bits(kept, fresh))


def conversion_key(source: torch.Tensor, dtype: torch.dtype) -> tuple:
    """Where a converted tensor came from (its bytes' address and layout), and the dtype it went to."""
    return (source.data_ptr(), source.dtype, tuple(source.shape), source.stride(), dtype)


class ConversionReuse:
    """:meth:`convert` and the masters it keeps. Part of :class:`~.staging.ModuleStager`, whose
    masters, loads and retakes it uses."""

    loads: int
    retention: RetentionBudget | None
    _groups: tuple[StorageGroup, ...]
    _master_views_by: dict[int, tuple[tuple[StorageGroup, ...], Views]]

    def _init_conversions(self) -> None:
        # Masters the last conversion left, and a view of each tensor it converted, on both sides,
        # by where it came from: the way back finds its master among them.
        self._kept_groups: tuple[StorageGroup, ...] = ()
        self._kept_conversions: dict[tuple, torch.Tensor] = {}
        self._loads_at_conversion: int | None = None
        self._most_loads_between_conversions = 0

    def _conversions_to_forget(self) -> bool:
        """Whether the kept masters can go (see LOADS_KEEPING_CONVERSIONS), asked before a load."""
        return bool(self._kept_groups) and self._loads_since_conversion() >= max(
            LOADS_KEEPING_CONVERSIONS, 2 * self._most_loads_between_conversions + 1
        )

    def convert(
        self, apply: Callable[[Callable[[torch.Tensor], torch.Tensor]], T], fn: Callable[[torch.Tensor], torch.Tensor]
    ) -> T:
        """Run a conversion of the modules (``apply``: ``nn.Module._apply``, ``fn``: what ``.to(dtype)``
        or ``.half()`` gives it) over the masters, and take its results as the new masters.

        Pipelines cast a component and back inside every call: SDXL upcasts its VAE to float32 to
        decode and casts it back to float16. Taking every result as a new master page-locked fresh
        host memory twice a call, at about half a second per GiB (docs/measurements.md). So the masters from
        before the last conversion are kept, and a result with the same bits as one of them (the
        float16 weights, on the way back) is bound to it instead. Each result is still computed and
        compared, never assumed: a master written in place since (a LoRA fused into it) fails the
        comparison, and the fresh result is taken.
        """
        self.offload()
        before = self._groups
        # Masters that view a checkpoint file (asleep at level 2) are slices of the file's mapping,
        # not storages of their own: bound to one, the weights would keep the file as their master.
        own = {id(b.target): (b, group.master) for group in before if not group.mapped for b in group.bindings}
        # (where the source was bound, its master, the tensor that takes the result)
        converted: list[tuple[TensorBinding, torch.Tensor, torch.Tensor]] = []

        def reusing(tensor: torch.Tensor) -> torch.Tensor:
            result = fn(tensor)
            bound = own.get(id(tensor))
            if bound is None or not isinstance(result, torch.Tensor) or result is tensor or result.device.type != "cpu":
                # Not a host copy of one of this stager's tensors: a block's (staged on its own), a
                # DTensor (its shard is what is bound), a mapped master's, a tensor the conversion
                # left as it was, or one it moved to a device. Taken by retake_masters as it comes.
                return result
            kept = self._kept_conversions.get(conversion_key(tensor, result.dtype))
            if kept is not None and same_bits(kept, result):
                result = kept
            # The module keeps a parameter and takes its new data; a buffer is replaced.
            converted.append((*bound, tensor if isinstance(tensor, nn.Parameter) else result))
            return result

        kept_before = self._kept_groups
        result = apply(reusing)
        if converted and self._kept_groups and self._bound_to(self._kept_groups, list(self.tensors())):
            self._swap_kept_masters()
            return result
        let_go = self._retake()
        if not converted:
            # Nothing to keep from this one (a cast to the dtype it has): what was kept stands.
            if let_go:
                self._wait_before_letting_go(let_go)
            return result
        bound = {id(b.target): (b, group.master) for group in self._groups for b in group.bindings}
        kept_conversions = {}
        with torch.inference_mode(False):
            for source_binding, source_master, target in converted:
                if id(target) not in bound:
                    continue
                binding, master = bound[id(target)]
                source, now = source_binding.view_over(source_master), binding.view_over(master)
                kept_conversions[conversion_key(source, now.dtype)] = now
                kept_conversions[conversion_key(now, source.dtype)] = source
        masters = {id(group.master) for group in self._groups}
        kept = tuple(group for group in before if id(group.master) not in masters and not group.mapped)
        # All of them (the usual case) is the very tuple their cached master views were made for.
        self._kept_groups = before if len(kept) == len(before) else kept
        self._kept_conversions = kept_conversions
        # Kept masters are not let go: a cast and its way back wait for no copy (the device may
        # still be loading the blocks that ran just before the cast; the host converts meanwhile).
        held = masters | {id(group.master) for group in self._kept_groups}
        dropped = tuple(group for group in before + kept_before if id(group.master) not in held)
        if dropped:
            self._wait_before_letting_go(dropped)
        self._count_conversion()
        return result

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

    def forget_conversions(self) -> None:
        """Let go of the masters kept from before the last conversion (their memory, if nothing else holds it)."""
        self._kept_groups = ()
        self._kept_conversions = {}
        # Their views, too: they hold the masters' memory.
        self._master_views_by = {key: entry for key, entry in self._master_views_by.items() if entry[0] is self._groups}
