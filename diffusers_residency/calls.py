"""The wrapper of pipeline calls: one call at a time per residency group, and, for a pipeline whose
plan learns from its calls, the call's shape told before it runs and its end after.

``pipe(...)`` looks ``__call__`` up on the class, so the wrapper goes on each pipeline class: those
defined when pinned offload is first enabled, and those a pipeline is built from staged components
of later (through ``register_modules``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any

from diffusers import DiffusionPipeline

from .adaptive import abort_call, begin_call, end_call
from .call_shapes import call_shape, call_signature
from .guards import guard_other_offloads
from .hooks import StagingHook
from .pipeline_residency import STATE_ATTR
from .residency import ResidencyGroup


def _wrap_call(cls: type[DiffusionPipeline]) -> None:
    """Wrap calls of ``cls``'s pipelines, once per class (``pipe(...)`` looks ``__call__`` up on the
    class): a pipeline whose components pinned offload stages holds its groups' call locks for the
    call, so that pipelines sharing components (``from_pipe``) called from several threads run one
    call at a time; a pipeline with its calls measured also tells the plan its shape before the
    call and that it ended after. A pipeline with no staged component only pays the look for one.
    A ``__call__`` that is no plain function (a generator's would return before its work) is left
    as it is."""
    cls = next((owner for owner in cls.__mro__ if "__call__" in owner.__dict__), None)  # where it is defined
    original = None if cls is None else cls.__dict__["__call__"]
    plain = inspect.unwrap(original) if inspect.isfunction(original) else original
    if (
        cls is None
        or getattr(original, "_residency_wrapper", False)
        or not inspect.isfunction(original)
        or inspect.isgeneratorfunction(plain)
        or inspect.iscoroutinefunction(plain)
        or inspect.isasyncgenfunction(plain)
    ):
        return
    # By the called pipeline's class: the parents a ``super()`` call in ``cls``'s reaches are those
    # of the class called (see call_signature). A few classes a wrapper, at most.
    signature = functools.lru_cache(maxsize=16)(lambda caller: call_signature(cls, caller))

    @functools.wraps(original)
    def call(self: DiffusionPipeline, *args: Any, **kwargs: Any) -> Any:
        state = self.__dict__.get(STATE_ATTR)
        if state is not None:
            state = state.staging_replaced(self)
            state = state if state is not None and state.active_in(self) else None
        groups = [state.group] if state is not None else groups_staging(self)
        if not groups:
            return original(self, *args, **kwargs)
        with contextlib.ExitStack() as locks:
            for group in groups:
                locks.enter_context(group.call_lock)
                locks.enter_context(group.running_call())
            if state is None or state.profile is None or state.in_call:
                # Not measured, or a call inside one (a subclass's __call__ calling its parent's):
                # the outermost call is the one planned for.
                return original(self, *args, **kwargs)
            state.in_call = True
            try:
                begin_call(state, call_shape(signature(type(self)), args, kwargs, state.default_size))
                result = original(self, *args, **kwargs)
            except BaseException as error:
                abort_call(state, error)
                raise
            finally:
                state.in_call = False
            end_call(state)
            return result

    call._residency_wrapper = True
    cls.__call__ = call


def wrap_every_pipeline_call() -> None:
    """Wrap the calls of every pipeline class defined so far, and guard the offloading methods they
    define of their own (see :func:`guard_offloads_of`): a pipeline built earlier from the
    components being enabled now (``FluxImg2ImgPipeline.from_pipe(pipe)`` before
    ``pipe.enable_pinned_offload()``) is of any class, and its calls must take the lock too. Classes
    defined later are wrapped when a pipeline of theirs is built from staged components through
    ``register_modules`` (see :func:`wrap_calls_sharing_components`)."""
    classes = [DiffusionPipeline]
    while classes:
        cls = classes.pop()
        classes.extend(cls.__subclasses__())
        if "__call__" in cls.__dict__:
            _wrap_call(cls)
        guard_offloads_of(cls)


def groups_staging(pipe: DiffusionPipeline) -> list[ResidencyGroup]:
    """The groups staging ``pipe``'s components (it shares them with enabled pipelines), in one
    order for every caller, so that two calls taking several locks never wait on each other. Read
    from the instance's attributes: ``pipe.components`` raises for pipelines that register modules
    their ``__init__`` does not take."""
    groups = {
        id(hook.group): hook.group
        for hook in (getattr(value, "_hf_hook", None) for value in list(pipe.__dict__.values()))
        if isinstance(hook, StagingHook)
    }
    return [groups[key] for key in sorted(groups)]


def guard_offloads_of(cls: type[DiffusionPipeline]) -> None:
    """Guard diffusers' offloading methods that ``cls`` defines (see guards.guard_other_offloads),
    for its pipelines whose components pinned offload stages."""
    guard_other_offloads(cls, lambda pipe: bool(groups_staging(pipe)))


def wrap_calls_sharing_components(register_modules: Callable[..., None]) -> Callable[..., None]:
    """``DiffusionPipeline.register_modules``, which diffusers' pipelines' ``__init__`` call with
    their components, made to wrap the calls of a pipeline built from components pinned offload
    stages (``from_pipe``, or by hand) whose class was defined after enabling: its calls then share
    the enabled pipeline's call lock. A component assigned afterwards (``p.vae = pipe.vae``) is not
    seen here."""

    @functools.wraps(register_modules)
    def registering(self: DiffusionPipeline, **modules: Any) -> None:
        register_modules(self, **modules)
        if any(isinstance(getattr(module, "_hf_hook", None), StagingHook) for module in modules.values()):
            _wrap_call(type(self))
            guard_offloads_of(type(self))

    return registering
