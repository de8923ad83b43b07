"""Accelerate hooks that stage a module's weights onto the device when it runs.

A :class:`StagingHook` is a plain ``accelerate.hooks.ModelHook`` subclass, attached with
``accelerate.hooks.add_hook_to_module``: diffusers finds the execution device through
``_hf_hook.execution_device``, and ``remove_all_hooks()`` (which ``enable_model_cpu_offload()``
calls) reaches :meth:`StagingHook.detach_hook`. It deliberately does not subclass ``CpuOffload`` or
``AlignDevicesHook``: diffusers' LoRA loaders strip hooks of those classes and re-enable their own
offloading.

The hook holds its group and its unit and nothing else; the group decides what gets evicted.
"""

from __future__ import annotations

import functools
import logging
import time
import warnings
from contextlib import AbstractContextManager
from typing import Any, Callable, NoReturn

import torch
from accelerate.hooks import ModelHook, remove_hook_from_module
from accelerate.utils import send_to_device
from torch import nn

from . import _device
from .residency import ResidencyGroup, ResidencyUnit
from .retry_with_room import RETRIED_METHODS, retried_with_room
from .text import format_bytes
from .weights import module_tensors

logger = logging.getLogger(__name__)

# diffusers' component methods that write into the weights in place (peft merging a LoRA into the
# base weights, a hotswap copying new adapter weights over the old). Run on a loaded component, the
# writes would land in the device copy and be lost at its next offload, so they run offloaded: on
# the masters, which are the weights then.
IN_PLACE_WEIGHT_METHODS = ("fuse_lora", "unfuse_lora", "load_lora_adapter")
# Methods whose writes in place an offload sees by the tensors' version counters, which inference
# tensors (the weights of a pipeline loaded under ``torch.inference_mode()``) do not have: on a
# component whose loaded tensors are such, they run offloaded first too, and the writes land in the
# masters. Otherwise they run where the weights are, and the offload copies back what they wrote.
VERSIONED_WRITE_METHODS = ("load_state_dict",)
# A staged component's own way into diffusers' group offloading, which would stack its hooks on
# the staging hook (the pipeline's is guarded apart, see guards.OTHER_OFFLOADS).
GROUP_OFFLOAD_METHOD = "enable_group_offload"

# Hook methods kept out of torch.compile, each with the function it wraps.
_UNCOMPILED: list[tuple[Callable, Callable]] = []


def _not_compiled(method: Callable) -> Callable:
    """Keep ``torch.compile`` out of a hook method: its body rebinds tensors and reads host state,
    which would only become graph breaks and guards.

    The disabled function is made when the first hook is created (:func:`_disable_compile_in_hooks`):
    not at import, because ``torch.compiler.disable`` imports dynamo, which costs seconds; and not
    at the method's first call, which may itself be traced, turning the set-up into more breaks."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return wrapper.disabled(*args, **kwargs)

    wrapper.disabled = None
    _UNCOMPILED.append((wrapper, method))
    return wrapper


def _disable_compile_in_hooks() -> None:
    for wrapper, method in _UNCOMPILED:
        if wrapper.disabled is None:
            wrapper.disabled = torch.compiler.disable(method)



def offloaded_first(
    method: Callable[..., Any],
    lock: AbstractContextManager,
    offload: Callable[[], None],
    after_writing: Callable[[], None] | None = None,
) -> Callable[..., Any]:
    """``method``, run under ``lock`` after ``offload``: a method that writes into weights in place
    (LoRA fusing) then writes into the host masters, which the next load copies. ``after_writing``
    runs after it, whether it raised or not: what it wrote before raising was written all the same."""

    @functools.wraps(method)
    def run_offloaded(*args: Any, **kwargs: Any) -> Any:
        with lock:
            offload()
            return call_then(lambda: method(*args, **kwargs), after_writing, method.__name__)

    return run_offloaded


def offloaded_where(
    unseen: Callable[[], bool],
    method: Callable[..., Any],
    lock: AbstractContextManager,
    offload: Callable[[], None],
    after_writing: Callable[[], None] | None = None,
) -> Callable[..., Any]:
    """``method``, run as :func:`offloaded_first` runs it where ``unseen()`` (its writes would go
    unseen where the weights are), and as it is otherwise."""
    offloaded = offloaded_first(method, lock, offload, after_writing)

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        if unseen():
            return offloaded(*args, **kwargs)
        return call_then(lambda: method(*args, **kwargs), after_writing, method.__name__)

    return run


def call_then(call: Callable[[], Any], after: Callable[[], None] | None, what: str) -> Any:
    """``call()`` (``what``, for the log), then ``after()`` whether it raised or not. When both
    raise, ``call``'s error is the one raised (it is what the caller asked about), and ``after``'s
    is logged."""
    try:
        result = call()
    except BaseException:
        if after is not None:
            try:
                after()
            except Exception:
                logger.warning("%s failed, and so did what follows it", what, exc_info=True)
        raise
    if after is not None:
        after()
    return result


def refuse_copying(*args: Any) -> NoReturn:
    """What copying or pickling a module staged by pinned offload, or a pipeline that shares one
    with the pipeline it was enabled on, meets: a second group over the same masters would stage
    them behind the first one's back, and streams and page-locked memory do not pickle."""
    raise TypeError(
        "A module staged by pinned offload cannot be copied or pickled on its own, nor a pipeline that shares "
        "its components: copy.deepcopy() the pipeline pinned offload was enabled on (the copy has no "
        "offloading), or call disable_pinned_offload() first."
    )


class StagingHook(ModelHook):
    """Loads its unit through the group before every forward and moves tensor inputs to the device.

    ``pre_forward`` is idempotent and takes no arguments when diffusers calls it directly (its
    ``apply_forward_hook`` does, for ``vae.decode`` and friends, and never calls ``post_forward``),
    so nothing here relies on ``post_forward``: the next unit's load evicts this one.

    While attached, ``module.compile()`` compiles the forward the hook wraps rather than the whole
    call, so the staging call stays outside the graph. The module's ``to()`` refuses a move to any device but the execution device or the
    CPU (the weights live on host masters and the device copy is the hook's business), and dtype casts
    (``vae.to(dtype=torch.float32)``, as SDXL does inside its call) go through the masters: they are
    cast on the host and retaken as new masters (a cast back reuses the masters it had: see
    :meth:`~diffusers_residency.staging.ModuleStager.convert`).
    """

    def __init__(self, group: ResidencyGroup, unit: ResidencyUnit) -> None:
        _disable_compile_in_hooks()
        self.group = group
        self.unit = unit
        # Per method the hook wrapped: what the module's instance had under its name before (a
        # user's ``vae.decode = torch.compile(vae.decode)``; None: the class's method), put back
        # when the hook is detached, and the wrapper.
        self._wrapped: dict[str, tuple[Callable[..., Any] | None, Callable[..., Any]]] = {}

    @property
    def execution_device(self) -> torch.device:
        return self.group.device

    def init_hook(self, module: nn.Module) -> nn.Module:
        original_to = module.to
        original_apply = module._apply
        # accelerate's remove_hook_from_module pops `to` from the instance dict itself; `_apply` is
        # popped in detach_hook.
        module.to = lambda *args, **kwargs: self._guarded_to(module, original_to, *args, **kwargs)
        module._apply = lambda fn, recurse=True: self._apply_through_masters(original_apply, fn, recurse)
        module.compile = lambda *args, **kwargs: self._compile_wrapped_forward(module, *args, **kwargs)
        self._wrapped = {}
        self._served_written_told = 0  # bytes (see _after_writing)
        # Every unit of the component, its streamed blocks included: loaded again at its next forward.
        offload = functools.partial(self.group.offload_component, self.unit.component, for_writing=True)
        written = self._after_writing
        lock = self.group.call_lock
        for name in IN_PLACE_WEIGHT_METHODS:
            if hasattr(module, name):
                self._wrap(module, name, offloaded_first(getattr(module, name), lock, offload, written))
        for name in VERSIONED_WRITE_METHODS:
            self._wrap(module, name, offloaded_where(self._writes_unseen, getattr(module, name), lock, offload, written))
        # Its hook holds streams and page-locked memory: a pickle would fail on them, unclearly.
        self._wrap(module, "__reduce_ex__", refuse_copying)
        if self.unit.name == self.unit.component and callable(getattr(module, GROUP_OFFLOAD_METHOD, None)):
            self._wrap(module, GROUP_OFFLOAD_METHOD, self._refuse_group_offload)
        for name in RETRIED_METHODS:
            method = getattr(module, name, None)
            # A submodule of that name (a model's own ``decode`` layers) is no entry point.
            if self.unit.name == self.unit.component and callable(method) and not isinstance(method, nn.Module):
                self._wrap(module, name, retried_with_room(method, self.group, self.unit.component, module))
        return module

    def _after_writing(self) -> None:
        """After a method wrote into the component's offloaded weights: copies of what it wrote into
        a host copy that ranks share (see ResidencyGroup.own_copies_of_written), and, where masters
        are served from checkpoint files, word of the pages it wrote there, which are the process's
        own now, in RAM beyond what a host budget planned for."""
        self.group.own_copies_of_written(self.unit.component)
        units = [unit for unit in self.group.units_of(self.unit.component) if unit.stager.file_backing is not None]
        written = sum(unit.stager.written_mapped_bytes() for unit in units)
        if written > self._served_written_told:
            logger.warning(
                "Writing into %r, whose weights a host_budget serves from checkpoint files, put %s of them in "
                "RAM beyond what the budget planned for: make such changes before enabling pinned offload",
                self.unit.component,
                format_bytes(written),
            )
            self._served_written_told = written

    def _refuse_group_offload(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"{self.unit.component!r} is staged by pinned offload; group offloading would stack its hooks on it. "
            "Disable pinned offload first (pipe.disable_pinned_offload(), or detach_staging_hook() on it)."
        )

    def _writes_unseen(self) -> bool:
        """Whether a write in place into the component's loaded weights would go unseen at their
        offload: some are inference tensors (see VERSIONED_WRITE_METHODS)."""
        units = self.group.units_of(self.unit.component)
        return any(unit.stager.loaded and unit.stager.loaded_versionless for unit in units)

    def _wrap(self, module: nn.Module, name: str, wrapper: Callable[..., Any]) -> None:
        self._wrapped[name] = (vars(module).get(name), wrapper)
        setattr(module, name, wrapper)

    @_not_compiled
    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        if self.group.estimate_from_inputs is not None and self.unit.stream is None:
            self.group.estimate_from_inputs(self.unit.component, args, kwargs)
        self.group.activate(self.unit)
        # A block's inputs come from its component's forward, whose hook moved the call's inputs
        # already: walking them again at every block costs more than many a block computes.
        if (args or kwargs) and self.unit.stream is None:
            device = self.group.device
            return send_to_device(args, device), send_to_device(kwargs, device)
        return args, kwargs

    def detach_hook(self, module: nn.Module) -> nn.Module:
        if self.unit.name == self.unit.component:
            # A streamed component's trunk goes last: its blocks first go back where they were.
            for block in self.group.units_of(self.unit.component):
                if block is not self.unit and getattr(block.module, "_hf_hook", None) is not None:
                    remove_hook_from_module(block.module)
        stager = self.unit.stager
        stager.offload()
        stager.unmap_masters(pin=False)  # the masters are about to be let go
        guards = {name: module.__dict__.pop(name) for name in ("_apply", "to", "compile") if name in module.__dict__}
        # A wrapper set over since (``vae.decode = torch.compile(vae.decode)`` while enabled) is left
        # as it is: it is what the user set last.
        guards.update(
            (name, module.__dict__.pop(name))
            for name, (_, wrapper) in self._wrapped.items()
            if module.__dict__.get(name) is wrapper
        )
        # Leave the module where it was found: host masters are already where a CPU module was.
        if self.unit.original_device.type != "cpu":
            try:
                module.to(self.unit.original_device)
            except BaseException:
                # A partial move (out of memory, say): back onto the masters, hook still in place.
                stager.rebind_masters()
                module.__dict__.update(guards)
                raise
        self.group.remove(self.unit)
        module.__dict__.update(
            (name, before) for name, (before, _) in self._wrapped.items() if name in guards and before is not None
        )
        return module

    @_not_compiled
    def _guarded_to(self, module: nn.Module, original_to: Callable[..., nn.Module], *args: Any, **kwargs: Any) -> nn.Module:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None:
            if _device.same_device(device, self.group.device):
                self.group.activate(self.unit)  # callers of .to(device) expect the weights there
            elif device.type == "cpu":
                self.group.offload_component(self.unit.component)
            else:
                raise RuntimeError(
                    f"{self.unit.name!r} is staged by diffusers-residency on {self.group.device}; it cannot be "
                    f"moved to {device} while that is on. Call pipe.disable_pinned_offload() (or "
                    "diffusers_residency.detach_staging_hook(module)) first."
                )
        casts = {k: v for k, v in (("dtype", dtype), ("memory_format", memory_format)) if v is not None}
        if not casts:
            return module
        if memory_format is not None:
            return original_to(**casts)
        # nn.Module.to hands _apply a function alone: the dtype it casts to is told here.
        self.group.cast_dtype = dtype
        try:
            return original_to(**casts)
        finally:
            self.group.cast_dtype = None

    def _compile_wrapped_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        # nn.Module.compile() compiles the whole call, staging included: the staging call runs
        # eagerly by design, so it would break the graph at the component's entry, and
        # fullgraph=True would fail. Compiling the forward this hook wraps keeps the hook outside
        # the graph and the model's forward whole. accelerate restores that forward, compiled, when
        # the hook is removed.
        component = self.unit.component
        moved = [unit for unit in self.group.units_of(component) if unit.evictable]
        if moved and replays_cuda_graphs(kwargs):
            # Not an error: the outputs stay right, only the recordings cost (see docs/torch-compile.md).
            warnings.warn(
                f"{component!r} is compiled to replay CUDA graphs, which capture its weights' device "
                f"addresses, and pinned offload moves it ({moved[0].policy.value}): each load puts the "
                "weights where the allocator has room, and each new set of addresses records the graphs "
                "again (a warm-up, a capture and memory for each). Keep it on the device, where the budget "
                f"has room, with pipe.enable_pinned_offload(components={{{component!r}: 'resident'}}), or compile "
                "without CUDA graphs (mode='default' or 'max-autotune-no-cudagraphs').",
                stacklevel=3,
            )
        # Compile the plain forward, not one compiled before (a second compile(), or a hook attached
        # again), and drop a compile of the whole call made before the hook came.
        forward = getattr(module._old_forward, "_torchdynamo_orig_callable", module._old_forward)
        module._old_forward = torch.compile(forward, *args, **kwargs)
        module._compiled_call_impl = None

    @_not_compiled
    def _apply_through_masters(self, original_apply: Callable[..., nn.Module], fn: Callable, recurse: bool) -> nn.Module:
        # Cast the host masters rather than a device copy: no device-to-host copy, and the results
        # are host tensors ready to become the new masters.
        unit, group = self.unit, self.group
        if group.cast_dtype is not None and not group.casting and _already_in(unit.module, group.cast_dtype):
            # nn.Module.to(dtype) casts floating-point tensors alone: to the dtype they all have, it
            # changes nothing. Offloaded for it, a unit would leave the device under a forward
            # running it (a no-op cast from another thread, or between a component's blocks).
            return unit.module
        convert = functools.partial(
            unit.stager.convert,
            lambda apply: original_apply(apply, recurse),
            fn,
            dtype=group.cast_dtype,
            call=group.calls if group.calls_running else None,
        )
        if group.casting:
            # A block under its trunk's cast (nn.Module._apply recurses into it): timed there.
            result = convert()
        else:
            units = group.units_of(unit.component)
            # The conversion reads masters mapped from checkpoint files where they are, as a load
            # does only once their files are checked: a file rewritten since would give other
            # weights, one cut short a SIGBUS. Every unit's, before any converts: a component left
            # half cast is in no dtype of its own.
            for file in {id(f): f for u in units for f in u.stager.mapped_files()}.values():
                file.refuse_if_changed()
            served = _served_bytes(units)
            if group.cast_dtype is not None:
                group.note_cast(unit.component, unit.module, group.cast_dtype)
            started = time.perf_counter()
            group.casting = True
            try:
                result = convert()
            finally:
                group.casting = False
                unit.host_seconds += time.perf_counter() - started
            if _served_bytes(units) < served:
                logger.warning(
                    "Casting %r, whose weights a host_budget serves from checkpoint files, took its results "
                    "into RAM, beyond what the budget planned for: cast it before enabling pinned offload",
                    unit.component,
                )
        if unit.sleep_level == 2 and not unit.stager.host_bytes()["mapped"]:
            # Cast while asleep at level 2: its masters are the results, memory of their own, and
            # none maps a file any more. It sleeps on with its masters in memory: level 1.
            unit.sleep_level = 1
        return result


def _already_in(module: nn.Module, dtype: torch.dtype) -> bool:
    """Whether every floating-point (or complex) tensor of ``module`` is a plain one of ``dtype``: a
    tensor subclass (a quantized weight) may cast in a ``to`` of its own."""
    return all(
        type(tensor) in (torch.Tensor, nn.Parameter) and tensor.dtype == dtype
        for tensor in module_tensors((module,))
        if tensor.is_floating_point() or tensor.is_complex()
    )


def _served_bytes(units: list[ResidencyUnit]) -> int:
    """Master bytes of ``units`` that a host budget serves from checkpoint files (see host_budget)."""
    return sum(unit.stager.host_bytes()["mapped"] for unit in units if unit.stager.file_backing is not None)


def replays_cuda_graphs(compile_kwargs: dict[str, Any]) -> bool:
    """Whether ``torch.compile`` with these arguments records CUDA graphs and replays them: dynamo's
    ``cudagraphs`` backend, and inductor (the default backend) in its ``reduce-overhead`` and
    ``max-autotune`` modes, with its ``triton.cudagraphs`` option, or with that set in its config."""
    backend = compile_kwargs.get("backend", "inductor")
    if backend == "cudagraphs":
        return True
    if backend != "inductor":
        return False
    mode = compile_kwargs.get("mode")
    if mode in (None, "default"):
        settings = {"triton.cudagraphs": torch._inductor.config.triton.cudagraphs}
    else:
        settings = dict(torch._inductor.list_mode_options(mode))
    settings.update(compile_kwargs.get("options") or {})
    return bool(settings.get("triton.cudagraphs"))
