"""What holds a module's weights: its tensors, and the plain tensors behind them that hold the bytes.

A parameter is usually a plain tensor over a storage of its own. Quantized checkpoints are not:
torchao's and optimum-quanto's weights are *wrapper* tensor subclasses with no storage, whose bytes
live in inner tensors (``__tensor_flatten__`` names them); bitsandbytes' ``Params4bit`` holds the
packed weight and keeps its scales in a ``quant_state`` beside it; a DTensor holds its shard.
Staging moves the plain tensors (the *stored* tensors), one master per storage as for any weight,
and then makes each wrapper's own metadata (its device) follow its inner tensors.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

# Attributes of bitsandbytes' ``QuantState`` (and of its nested ``state2``) that hold tensors the
# 4-bit matmul reads on the weight's device.
_QUANT_STATE_TENSORS = ("absmax", "code", "offset")
_PYTHON_DISPATCH = torch._C.DispatchKeySet(torch._C.DispatchKey.Python)


def module_tensors(modules: Iterable[nn.Module], exclude: Iterable[nn.Module] = ()) -> Iterator[torch.Tensor]:
    """Every parameter and buffer of the modules, each object once, in ``parameters()`` then
    ``buffers()`` order, but those of ``exclude`` (blocks that a stager of their own streams, when
    ``modules`` is their component's trunk).

    The walk stops at excluded modules rather than going through them and dropping what it finds:
    a streamed component's trunk is walked at each of its loads and casts, and its blocks hold
    nearly all of its tensors. They are read once, to leave out a tensor the rest also reaches (a
    weight tied between the trunk and a block)."""
    exclude = tuple(exclude)
    # Read from the modules' own dicts: ``parameters()`` would name every tensor on the way, and
    # this set is built at every load of the trunk (an id of None in it matches no tensor).
    seen: set[int] = set()
    for below in _modules_outside(exclude, set()):
        seen.update(map(id, below._parameters.values()))
        seen.update(map(id, below._buffers.values()))
    excluded = {id(m) for m in exclude}
    for module in modules:
        tree = _modules_outside(module, excluded)
        for members in (m._parameters for m in tree), (m._buffers for m in tree):
            for member in members:
                for tensor in member.values():
                    if tensor is not None:
                        key = id(tensor)
                        if key not in seen:
                            seen.add(key)
                            yield tensor


def shared_tensor(module: nn.Module, parts: Sequence[tuple[str, nn.Module]]) -> tuple[str, str] | None:
    """Two holders of one tensor among ``parts`` (named submodules, such as a module's repeated
    blocks) and the rest of ``module`` (named ``""``), or None where each part's tensors are its
    own: a tied weight, or a submodule two parts share."""
    holder: dict[int, str] = {}
    for name, part in parts:
        for tensor in module_tensors((part,)):
            if holder.setdefault(id(tensor), name) != name:
                return holder[id(tensor)], name
    for rest in _modules_outside(module, {id(part) for _, part in parts}):
        for tensor in chain(rest._parameters.values(), rest._buffers.values()):
            if tensor is not None and id(tensor) in holder:
                return holder[id(tensor)], ""
    return None


def _modules_outside(roots: nn.Module | Sequence[nn.Module], excluded: set[int]) -> list[nn.Module]:
    """The roots and their submodules in ``named_modules()`` order (one root's after another's),
    each once, without the excluded ones and what lies below them."""
    # The excluded ones count as visited from the start: one lookup per module on a walk that
    # runs at every load of a streamed block.
    stack = [roots] if isinstance(roots, nn.Module) else list(reversed(roots))
    found, visited = [], set(excluded)
    while stack:
        module = stack.pop()
        # Marked when reached, as named_modules() does: a module shared by two parents comes
        # where the walk first reaches it, not where it was first seen as a child.
        key = id(module)
        if key in visited:
            continue
        visited.add(key)
        found.append(module)
        if module._modules:
            stack.extend(reversed([c for c in module._modules.values() if c is not None]))
    return found


def stored_tensors(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The plain tensors that hold ``tensor``'s bytes: itself, for an ordinary tensor.

    A DTensor gives its shard object (``_local_tensor``, not ``to_local()``: that is an alias made
    through autograd, and rebinding it would leave the DTensor on its old storage); a wrapper
    subclass its inner tensors, nested ones included; a bitsandbytes parameter itself and the
    tensors of its quantization state."""
    if type(tensor) is nn.Parameter or type(tensor) is torch.Tensor:
        return (tensor,)  # nearly every weight: no attribute lookups on the way
    local = getattr(tensor, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return stored_tensors(local)
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        return tuple(chain.from_iterable(stored_tensors(getattr(tensor, name)) for name in names))
    return (tensor, *_quantization_state_tensors(tensor))


def module_stored_tensors(modules: Iterable[nn.Module], exclude: Iterable[nn.Module] = ()) -> Iterator[torch.Tensor]:
    """The stored tensors (see :func:`stored_tensors`) of :func:`module_tensors`, each object once."""
    seen: set[int] = set()
    for tensor in module_tensors(modules, exclude):
        for stored in stored_tensors(tensor):
            key = id(stored)
            if key not in seen:
                seen.add(key)
                yield stored


def _quantization_state_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Tensors that a bitsandbytes parameter keeps beside its bytes: ``Int8Params.SCB`` (its
    ``CB`` is the parameter's own storage), and ``Params4bit.quant_state``'s scales and code."""
    found = []
    scales = getattr(tensor, "SCB", None)
    if isinstance(scales, torch.Tensor):
        found.append(scales)
    state = getattr(tensor, "quant_state", None)
    while state is not None:
        found.extend(t for t in (getattr(state, name, None) for name in _QUANT_STATE_TENSORS) if isinstance(t, torch.Tensor))
        state = getattr(state, "state2", None)
    return found


def flat_bytes(storage: torch.UntypedStorage, start: int = 0, nbytes: int | None = None) -> torch.Tensor:
    """A flat byte tensor over ``storage`` from byte ``start``: ``nbytes`` of it, or the rest."""
    nbytes = storage.nbytes() - start if nbytes is None else nbytes
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, start, (nbytes,), (1,))


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind the tensors: what staging them moves (quantized bytes
    for a quantized weight)."""
    sizes = {}
    for tensor in tensors:
        for stored in stored_tensors(tensor):
            storage = stored.untyped_storage()
            sizes[(stored.device, storage.data_ptr())] = storage.nbytes()
    return sum(sizes.values())


# Tensor types staging refuses, with why. bitsandbytes' 8-bit layers move the weight's bytes and
# scales into the layer's own matmul state at their first forward (``Linear8bitLt.init_8bit_state``),
# out of reach of the parameter: a load would not reach what runs, and the device copy would never go.
_REFUSED_TYPES = {
    "bitsandbytes.nn.modules.Int8Params": "bitsandbytes' 8-bit layers keep their weights in the layer's own "
    "matmul state, out of reach of staging. Use 4-bit (load_in_4bit=True) or torchao's int8 weight-only instead"
}


def refuse_unstageable_tensors(modules: Iterable[nn.Module], what: str) -> None:
    """Raise before anything changes if a weight cannot be staged exactly: one with no data (a model
    loaded with ``device_map`` or ``low_cpu_mem_usage`` that was never materialised), or a tensor
    subclass whose bytes are not reachable as plain tensors, or that cannot be rebuilt over them."""
    for module in modules:
        for name, tensor in chain(module.named_parameters(), module.named_buffers()):
            kind = f"{type(tensor).__module__}.{type(tensor).__qualname__}"
            if kind in _REFUSED_TYPES:
                raise ValueError(f"{what} holds {name!r} as a {kind}: {_REFUSED_TYPES[kind]}.")
            try:
                stored = stored_tensors(tensor)
                for inner in stored:
                    inner.untyped_storage().data_ptr()
                wrappers: list[torch.Tensor] = []
                _collect_wrappers(tensor, wrappers)
                for wrapper in wrappers:  # as Wrappers.follow() rebuilds them at a load
                    _rebuilt(wrapper)
            except Exception as error:
                raise ValueError(
                    f"{what} holds {name!r} as a {kind}, whose bytes cannot be staged ({type(error).__name__}: "
                    f"{error}). Quantize with a library whose tensors flatten to plain ones and back "
                    "(torchao, optimum-quanto, GGUF, bitsandbytes 4-bit)."
                ) from error
            if any(inner.is_meta for inner in stored):
                raise ValueError(
                    f"{what} has weights on the 'meta' device (first: {name!r}), so there is nothing to stage. "
                    "Load the model with its weights (e.g. without device_map='meta' or init_empty_weights), "
                    "then enable offloading."
                )


def refuse_shared_quantization_state(modules: Iterable[nn.Module]) -> None:
    """Raise before anything changes if two weights share a tensor of their quantization state.

    Older bitsandbytes releases gave the nested state of every 4-bit weight one shared ``code``
    tensor. Staged apart (two blocks, two components), one stager would move it while another uses
    it, and the error would only say that the weights are staged twice."""
    owner: dict[int, int] = {}
    for module in modules:
        for name, parameter in module.named_parameters():
            if type(parameter) is nn.Parameter:
                continue
            for state in _quantization_state_tensors(parameter):
                if owner.setdefault(id(state), id(parameter)) != id(parameter):
                    raise ValueError(
                        f"{name!r} shares a tensor of its quantization state with another weight, as bitsandbytes "
                        f"{_version_of('bitsandbytes')} does for every 4-bit weight. Upgrade bitsandbytes "
                        "(pip install -U bitsandbytes) and load the model again, then enable offloading."
                    )


def _version_of(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


@dataclass
class Wrappers:
    """The wrapper subclasses among some tensors, innermost first, and what moves their metadata.

    A wrapper's device is its own metadata, set when it was made: rebinding its inner tensors moves
    its bytes but not that. ``follow()`` gives each wrapper the device of its inner tensors by
    ``wrapper.data = template``, a wrapper of the same type, shape and stride rebuilt once per device
    with ``__tensor_unflatten__`` (as ``nn.Module._apply`` rebuilds one in a ``.to()``): ``.data``
    takes the template's metadata and keeps the object, its attributes and its inner tensors, so
    every holder of the parameter sees it move.

    A write into a wrapper (torchao's ``copy_``, so ``load_state_dict``) fills its inner tensors
    without moving their version counters, only the wrapper's: :meth:`versions` reads those."""

    tensors: tuple[torch.Tensor, ...] = ()
    # The first inner tensor of each wrapper, whose device the wrapper follows, and the device each
    # wrapper was last given: a follow that finds them equal (every offload of an unchanged block)
    # asks nothing of the wrapper, whose every attribute goes through its ``__torch_function__``.
    _inner: tuple[torch.Tensor, ...] = ()
    _devices: list[torch.device] = field(default_factory=list)
    # (id of a wrapper, device) -> its template there.
    _templates: dict[tuple[int, torch.device], torch.Tensor] = field(default_factory=dict)

    @classmethod
    def among(cls, tensors: Iterable[torch.Tensor]) -> Wrappers:
        found: list[torch.Tensor] = []
        for tensor in tensors:
            _collect_wrappers(tensor, found)
        return cls(tuple(found), tuple(stored_tensors(w)[0] for w in found), [w.device for w in found])

    def versions(self) -> tuple[int | None, ...]:
        """Each wrapper's version counter (None for an inference tensor, which has none)."""
        # Read past the wrappers' own __torch_function__, which costs about a microsecond an attribute.
        with torch._C.DisableTorchFunctionSubclass():
            return tuple(None if w.is_inference() else w._version for w in self.tensors)

    def written_since(self, versions: tuple[int | None, ...]) -> set[int]:
        """Ids of the inner tensors of every wrapper written since ``versions`` were read."""
        return _stored_where_changed(self.tensors, versions, self.versions, stored_tensors)

    def follow(self) -> None:
        """Give every wrapper the device its inner tensors are on now."""
        for index, (wrapper, inner) in enumerate(zip(self.tensors, self._inner)):
            device = inner.device
            if device == self._devices[index]:
                continue
            template = self._template(wrapper, device)
            # The subclass's own dispatch is left out: ``.data =`` moves metadata only, and torchao's
            # float8 tensors, for one, implement none of the ops it asks of them across devices.
            with torch.no_grad(), torch._C._ExcludeDispatchKeyGuard(_PYTHON_DISPATCH):
                wrapper.data = template
            self._devices[index] = device

    def _template(self, wrapper: torch.Tensor, device: torch.device) -> torch.Tensor:
        template = self._templates.get((id(wrapper), device))
        if template is None:
            template = self._templates[(id(wrapper), device)] = _rebuilt(wrapper)
        return template


@dataclass(frozen=True)
class MergingLayers:
    """The adapter layers among some modules that merge their adapters into their base weights
    (peft's LoRA layers, by their ``merged_adapters`` and ``base_layer``).

    peft merges and unmerges through ``weight.data += delta``, which moves no version counter, and
    at times no guarded method sees: a layer whose adapters were disabled while merged unmerges in
    its next forward, ``set_adapter`` unmerges first, and a pipeline made with ``from_pipe`` has no
    guarded ``unfuse_lora()``. A layer's list of merged adapters changes whenever its base weights
    were written so: read at a load and again at the offload, a change says which loaded weights
    hold the only current values. (A merge and its unmerge both made while loaded leave the list as
    it was, and the weights as the masters hold them up to rounding: not seen.)"""

    layers: tuple[nn.Module, ...] = ()

    @classmethod
    def among(cls, modules: Iterable[nn.Module], exclude: Iterable[nn.Module] = ()) -> MergingLayers:
        """Those of ``modules`` and their submodules, but those of ``exclude`` (see module_tensors)."""
        tree = _modules_outside(tuple(modules), {id(m) for m in exclude})
        return cls(tuple(m for m in tree if _merges_into_base(m)))

    def states(self) -> tuple[tuple[str, ...], ...]:
        return tuple(tuple(layer.merged_adapters) for layer in self.layers)

    def written_since(self, states: tuple[tuple[str, ...], ...]) -> set[int]:
        """Ids of the stored tensors of each layer's base whose merged adapters changed since ``states``."""
        return _stored_where_changed(
            self.layers, states, self.states, lambda layer: module_stored_tensors((layer.base_layer,))
        )


def _stored_where_changed(
    owners: Sequence[Any],
    then: Sequence[Any],
    read_now: Callable[[], Sequence[Any]],
    stored: Callable[[Any], Iterable[torch.Tensor]],
) -> set[int]:
    """Ids of the tensors ``stored`` gives for each owner whose reading changed since ``then`` (read
    again only where there was one)."""
    if not then:
        return set()
    return {id(tensor) for owner, was, now in zip(owners, then, read_now()) if was != now for tensor in stored(owner)}


def _merges_into_base(module: nn.Module) -> bool:
    return isinstance(getattr(module, "merged_adapters", None), list) and isinstance(
        getattr(module, "base_layer", None), nn.Module
    )


def _rebuilt(wrapper: torch.Tensor) -> torch.Tensor:
    """A new wrapper like ``wrapper`` over its inner tensors as they are now."""
    names, context = wrapper.__tensor_flatten__()
    inner = {name: getattr(wrapper, name) for name in names}
    # Made as the wrapper was made: one made under inference mode (a call's) would make an ordinary
    # wrapper an inference tensor, which autograd and in-place updates then refuse.
    with torch.inference_mode(wrapper.is_inference()):
        return type(wrapper).__tensor_unflatten__(inner, context, wrapper.size(), wrapper.stride())


def _collect_wrappers(tensor: torch.Tensor, found: list[torch.Tensor]) -> None:
    if type(tensor) is nn.Parameter or type(tensor) is torch.Tensor or not is_traceable_wrapper_subclass(tensor):
        return
    if isinstance(getattr(tensor, "_local_tensor", None), torch.Tensor):
        # A DTensor stays on its mesh's device type, as it was made: its shard is what moves.
        return
    names, _ = tensor.__tensor_flatten__()
    for name in names:
        _collect_wrappers(getattr(tensor, name), found)
    found.append(tensor)
