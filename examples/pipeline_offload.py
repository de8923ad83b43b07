"""Pinned offload on a whole pipeline: one call to enable, the report, and a clean disable.

    python examples/pipeline_offload.py            # the current accelerator, or the CPU
    python examples/pipeline_offload.py --device cpu

The pipeline is a real FluxPipeline built from a tiny config with random weights, so this runs with
no download. With a checkpoint, replace the builder with ``FluxPipeline.from_pretrained(...)``.
"""

import argparse

import torch

import diffusers_residency  # noqa: F401  (adds enable_pinned_offload & co. to DiffusionPipeline)
from diffusers_residency.bench.builders import build_pipeline, call_kwargs

parser = argparse.ArgumentParser()
parser.add_argument("--device", default=None)
args = parser.parse_args()
device = args.device or torch.accelerator.current_accelerator(check_available=True) or "cpu"

pipe = build_pipeline("flux", "tiny")  # weights on the host, as from_pretrained leaves them
# Planned for the memory the device has free: with room, everything stays resident after its first
# load; on the CPU (no free-memory figure) text encoders, transformer and VAE take turns.
pipe.enable_pinned_offload(device)
image = pipe(**call_kwargs("flux", "tiny")).images[0]
print(f"image {tuple(image.shape)} on {image.device}")
print(pipe.residency_report())

# Stage every component but the VAE, as diffusers' model offload would: calling enable again
# reconfigures, and vram_budget=None asks for no plan.
pipe.enable_pinned_offload(device, components={"vae": "resident"}, vram_budget=None)
pipe(**call_kwargs("flux", "tiny"))
print(pipe.residency_report())

pipe.disable_pinned_offload()  # every component back where it was, weights bit-identical
