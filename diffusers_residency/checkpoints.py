"""A pipeline's safetensors files as masters: finding a component's, viewing its weights in them,
and writing a component's weights to a folder of files where it has none.

A level-2 sleep and a host budget (see :mod:`.host_budget`) both serve masters from these views
(:class:`~.files.MappedBytes`) instead of memory of their own.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from diffusers import DiffusionPipeline
from torch import nn

from .files import MappedBytes, OpenFile, bytes_of, hold_the_same_bytes
from .weights import flat_bytes, stored_tensors

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_DTYPE_NAMES = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}
# The alignment a written file's tensor data starts at (see write_checkpoint).
DATA_ALIGNMENT = 64
# The file an offload folder holds for each component (see write_checkpoint).
_OFFLOAD_FILE = "weights.safetensors"


def component_folder(pipe: DiffusionPipeline, name: str) -> Path | None:
    """The folder of component ``name``'s safetensors files in the directory the pipeline was loaded
    from (``pipe.name_or_path``), or None where there is none."""
    root = Path(pipe.name_or_path or "")
    folder = root / name
    return folder if root.is_dir() and any(folder.glob("*.safetensors")) else None


def _plain_tensors_by_name(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters and buffers that are one plain tensor each (a quantized weight's parts
    are not one tensor of a file), by name, a tied one under each of its names."""
    by_name: dict[str, torch.Tensor] = {}
    for name, tensor in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        stored = stored_tensors(tensor)
        if len(stored) == 1:
            by_name[name] = stored[0]
    return by_name


def checkpoint_views(directory: Path, module: nn.Module) -> dict[int, MappedBytes]:
    """The module's tensors' bytes in the ``*.safetensors`` files of a component folder, each a flat
    memory-mapped view and its place in the open file, keyed by ``id`` of the tensor they hold.
    Tensors whose name, dtype or shape differ from the file's, or whose bytes sit at an offset their
    dtype cannot be viewed at, are left out (they keep their own masters)."""
    by_name = _plain_tensors_by_name(module)
    views: dict[int, MappedBytes] = {}
    for path in _checkpoint_files(directory):
        file = OpenFile(path)
        size = os.fstat(file.fd).st_size
        try:
            (header_size,) = struct.unpack("<Q", os.pread(file.fd, 8, 0))
            header = json.loads(os.pread(file.fd, min(header_size, size), 8))
            if not isinstance(header, dict) or 8 + header_size > size:
                raise ValueError("its header is cut short or is no table of tensors")
        except (struct.error, ValueError, OverflowError) as exc:
            raise ValueError(
                f"{path} is no safetensors file that can be read ({exc}): move it out of {directory}, "
                "or sleep at level 1"
            ) from None
        # A private mapping: pages are read from the page cache when touched, never written back.
        mapped = flat_bytes(torch.UntypedStorage.from_file(file.mapping_path, shared=False, nbytes=size))
        for name, entry in header.items():
            tensor = by_name.get(name)
            if tensor is None or name == "__metadata__":
                continue
            start, end = (8 + header_size + offset for offset in entry["data_offsets"])
            if (
                _SAFETENSORS_DTYPES.get(entry["dtype"]) == tensor.dtype
                and tuple(entry["shape"]) == tuple(tensor.shape)
                and start % tensor.dtype.itemsize == 0
            ):
                views[id(tensor)] = MappedBytes(_storage_of_its_own(mapped, start, end), file, start)
    return views


def _checkpoint_files(directory: Path) -> list[Path]:
    """The ``*.safetensors`` files of a component folder that hold its weights: those a sharded
    checkpoint's index names, where it has one (as ``from_pretrained`` loads them; an older single
    file saved there before stays beside the shards), else every one."""
    files = sorted(directory.glob("*.safetensors"))
    indexed: set[str] = set()
    for index in directory.glob("*.safetensors.index.json"):
        try:
            indexed.update(map(str, json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return files  # no index to go by: every file, as before it was written
    return [path for path in files if path.name in indexed] if indexed else files


def _storage_of_its_own(mapped: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Bytes ``start:end`` of a mapped file as a flat tensor over a storage of its own, which keeps
    the file's mapping alive. Weights bound to it are one per storage, as ``from_pretrained`` left
    them, not views into one storage of the whole file: a snapshot takes one master per storage,
    and a later enable (after ``disable_pinned_offload``) can serve each from its file again."""
    if end == start:
        return mapped[start:end]
    buffer = (ctypes.c_uint8 * (end - start)).from_address(mapped.data_ptr() + start)
    buffer.mapping = mapped  # torch.frombuffer keeps the buffer alive, and the buffer the mapping
    return torch.frombuffer(buffer, dtype=torch.uint8)


def _fills_its_storage(tensor: torch.Tensor) -> bool:
    return tensor.is_contiguous() and tensor.storage_offset() == 0 and tensor.nbytes == tensor.untyped_storage().nbytes()


def _saved_by_name(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's weights that a checkpoint holds, by name: parameters and persistent buffers that
    are one plain tensor (a quantized weight's parts are not one tensor of a file, and buffers
    computed at construction are in none)."""
    return {
        name: stored[0]
        for name, tensor in module.state_dict(keep_vars=True).items()
        if len(stored := stored_tensors(tensor)) == 1 and stored[0].numel()
    }


def saved_weights(modules: Iterable[nn.Module]) -> list[torch.Tensor]:
    """The weights of ``modules`` that a checkpoint holds (see :func:`_saved_by_name`), each once."""
    found = {id(tensor): tensor for module in modules for tensor in _saved_by_name(module).values()}
    return list(found.values())


def servable(tensor: torch.Tensor) -> bool:
    """Whether a file can serve the tensor's master: one tensor that fills its storage. (Weights that
    are views into one shared storage, as some loaders leave them after a dtype change, have one
    master for the storage, which no file holds.)"""
    return _fills_its_storage(tensor) and tensor.dtype in _DTYPE_NAMES  # complex ones: no file format has them


def equal_views(tensors: list[torch.Tensor], views: Mapping[int, MappedBytes]) -> dict[int, MappedBytes]:
    """The views of ``views`` that hold the same bytes as their tensor (on the host), compared by
    threads from the files (see :func:`~.files.hold_the_same_bytes`), by ``id`` of the tensor. A
    weight changed since it was loaded (a fused LoRA, a cast) has none."""
    viewed = [tensor for tensor in tensors if id(tensor) in views and servable(tensor)]
    host = [flat_bytes(tensor.untyped_storage()) for tensor in viewed]
    same = hold_the_same_bytes(host, [views[id(tensor)] for tensor in viewed])
    return {id(tensor): views[id(tensor)] for tensor, equal in zip(viewed, same) if equal}


def write_checkpoint(folder: Path, module: nn.Module) -> Path:
    """Write ``module``'s weights that a file can serve (see :func:`servable`) into
    ``folder/weights.safetensors``, replacing the file at once when complete (a reader never sees
    half a file), and return its folder. Each weight's bytes go from its own memory to the file:
    no second copy of the component is made in memory, as ``safetensors.torch.save_file`` would."""
    folder.mkdir(parents=True, exist_ok=True)
    saved = [(name, tensor) for name, tensor in _saved_by_name(module).items() if servable(tensor)]
    named = {id(tensor): (name, tensor) for name, tensor in reversed(saved)}
    # Widest items first, as safetensors orders them: each tensor then starts at an offset its
    # dtype can be viewed at (a 6-byte float16 buffer before float32 weights would misplace them).
    named = dict(sorted(named.items(), key=lambda item: -item[1][1].element_size()))
    tensors = [tensor for _, tensor in named.values()]
    header: dict[str, dict] = {}
    offset = 0
    for name, tensor in named.values():
        header[name] = {
            "dtype": _DTYPE_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    # The data starts 64-byte aligned, as memory of a weight's own is: a weight served from the
    # file is then aligned as far as its offset in the data allows (the CPU's kernels can round
    # differently with their operands' alignment). The tensors follow each other without gaps.
    encoded += b" " * (-(8 + len(encoded)) % DATA_ALIGNMENT)
    descriptor, temporary = tempfile.mkstemp(dir=folder, suffix=".partial")
    try:
        with os.fdopen(descriptor, "wb") as out:
            out.write(struct.pack("<Q", len(encoded)) + encoded)
            for tensor in tensors:
                out.write(bytes_of(flat_bytes(tensor.detach().cpu().untyped_storage())))
        os.replace(temporary, folder / _OFFLOAD_FILE)
    except BaseException:
        os.unlink(temporary)
        raise
    return folder
