"""Planning for a VRAM budget: the plan, block streaming, and the report after a call.

    python examples/vram_budget.py            # the current accelerator, or the CPU
    python examples/vram_budget.py --device cpu

The pipeline is a real FluxPipeline built from a tiny config with random weights (no download), so
its weights take well under a megabyte: the budget here is half of them plus a reserve for
activations. With a checkpoint, pass a budget such as ``vram_budget="16GB"``, or nothing at all
(``"auto"``: the memory the device has free).
"""

import argparse

import torch

import diffusers_residency  # noqa: F401  (adds enable_pinned_offload & co. to DiffusionPipeline)
from diffusers_residency.bench.builders import build_pipeline, call_kwargs

parser = argparse.ArgumentParser()
parser.add_argument("--device", default=None)
args = parser.parse_args()
device = args.device or torch.accelerator.current_accelerator(check_available=True) or "cpu"

pipe = build_pipeline("flux", "tiny")
weights = sum(p.numel() * p.element_size() for c in pipe.components.values() if isinstance(c, torch.nn.Module) for p in c.parameters())
reserve = 64 * 2**20  # the activations, cuBLAS workspaces and the allocator's rounding
pipe.enable_pinned_offload(device, vram_budget=weights // 2 + reserve, activation_reserve=reserve)
print(pipe.residency_plan())  # the transformer streams its blocks behind a resident prefix

image = pipe(**call_kwargs("flux", "tiny")).images[0]
print(f"image {tuple(image.shape)} on {image.device}")
print(pipe.residency_report())  # one row per component; a streamed one counts every block load

# Keep the VAE whole and resident whatever the plan says; the planner places the rest around it.
budget = weights * 3 // 4 + reserve
pipe.enable_pinned_offload(device, components={"vae": "resident"}, vram_budget=budget, activation_reserve=reserve)
print(pipe.residency_plan())
pipe.disable_pinned_offload()
