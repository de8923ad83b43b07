"""Pipelines that share components, called from several threads."""

from __future__ import annotations

import threading

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxImg2ImgPipeline, FluxPipeline

from diffusers_residency.bench.builders import call_kwargs, pipeline_output

from .helpers import PipelineCase

CALLS = 20


@pytest.mark.parametrize("sharing", [FluxPipeline, FluxImg2ImgPipeline], ids=["same-class", "img2img"])
def test_two_threads_calling_pipelines_that_share_components_are_exact(flux: PipelineCase, sharing: type) -> None:
    config = flux.pipe.scheduler.config
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config, use_dynamic_shifting=False, shift=3.0)
    other = sharing.from_pipe(flux.pipe, scheduler=scheduler)
    other.set_progress_bar_config(disable=True)
    image = flux.reference[:1] * 2 - 1 if sharing is FluxImg2ImgPipeline else None

    def other_kwargs() -> dict:
        kwargs = call_kwargs("flux", "tiny")
        return kwargs if image is None else {**kwargs, "image": image, "strength": 0.8}

    other_reference = pipeline_output(other, other_kwargs())
    assert not torch.equal(other_reference, flux.reference), "another scheduler, another output"
    flux.pipe.enable_pinned_offload("cpu", components={"transformer": "streamed"}, vram_budget=10**9)
    failures: list[BaseException] = []
    inexact: list[str] = []

    def serve(name: str, run, reference: torch.Tensor) -> None:
        try:
            for _ in range(CALLS):
                if not torch.equal(run(), reference):
                    inexact.append(name)
        except BaseException as exc:  # reported below, with the thread's traceback
            failures.append(exc)

    threads = [
        threading.Thread(target=serve, args=("text-to-image", flux.run, flux.reference)),
        threading.Thread(target=serve, args=("shared", lambda: pipeline_output(other, other_kwargs()), other_reference)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
        assert not thread.is_alive(), "a call never ended: the threads wait on each other"
    if failures:
        raise failures[0]
    assert not inexact, inexact


def test_a_pipeline_class_defined_after_enabling_takes_the_lock_when_built_from_staged_components(flux: PipelineCase) -> None:
    flux.pipe.enable_pinned_offload("cpu")

    class Later(FluxPipeline):
        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **kwargs)

    assert not getattr(Later.__dict__["__call__"], "_residency_wrapper", False)
    later = Later(**flux.pipe.components)
    assert Later.__dict__["__call__"]._residency_wrapper, "wrapped as it was built from staged components"
    later.set_progress_bar_config(disable=True)
    assert torch.equal(pipeline_output(later, call_kwargs("flux", "tiny")), flux.reference)


def test_calls_waiting_while_a_component_is_replaced_enable_the_pipeline_again_once(flux: PipelineCase) -> None:
    import logging

    flux.pipe.enable_pinned_offload(device="cpu")
    first_step, go_on = threading.Event(), threading.Event()

    def held_at_its_first_step(pipe, step, timestep, kwargs):
        first_step.set()
        go_on.wait(30)
        return kwargs

    outputs, errors = [], []

    def call(**extra) -> None:
        try:
            outputs.append(pipeline_output(flux.pipe, {**call_kwargs("flux"), **extra}))
        except BaseException as error:
            errors.append(error)

    running = threading.Thread(target=call, kwargs={"callback_on_step_end": held_at_its_first_step})
    running.start()
    assert first_step.wait(30)
    flux.pipe.vae = PipelineCase("flux").pipe.vae  # the same weights: the outputs stay the same
    said = []
    handler = logging.Handler()
    handler.emit = said.append
    logger = logging.getLogger("diffusers_residency.pipeline_residency")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        waiting = [threading.Thread(target=call) for _ in range(2)]
        for thread in waiting:
            thread.start()
        go_on.set()
        for thread in (running, *waiting):
            thread.join(120)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    assert not errors and len(outputs) == 3
    assert all(torch.equal(output, flux.reference) for output in outputs)
    assert len([record for record in said if "enabling it again" in record.getMessage()]) == 1
