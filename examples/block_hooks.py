"""Staging hooks attached per module from a script, without ``enable_pinned_offload``.

Each text encoder and the VAE are staged as whole modules; the transformer is staged block by block,
so at most one of its blocks is on the device at a time, while its small input and output layers
stay resident. All hooks share one ResidencyGroup: one device, one copy stream, one retention budget.

    python examples/block_hooks.py [--device cuda]
"""

import argparse

import torch

from diffusers_residency import ResidencyGroup, attach_staging_hook, detach_staging_hook
from diffusers_residency.bench.builders import build_pipeline, call_kwargs

parser = argparse.ArgumentParser()
parser.add_argument("--device", default=None)
args = parser.parse_args()
device = args.device or torch.accelerator.current_accelerator(check_available=True) or "cpu"

pipe = build_pipeline("flux", "tiny")
group = ResidencyGroup(device)

for name in ("text_encoder", "text_encoder_2", "vae"):
    attach_staging_hook(getattr(pipe, name), group, name=name)
transformer = pipe.transformer
for index, block in enumerate([*transformer.transformer_blocks, *transformer.single_transformer_blocks]):
    attach_staging_hook(block, group, name=f"transformer.block{index}")
for name, child in transformer.named_children():
    if name not in ("transformer_blocks", "single_transformer_blocks"):
        attach_staging_hook(child, group, name=f"transformer.{name}", policy="resident")

print(f"execution device: {pipe._execution_device}")
image = pipe(**call_kwargs("flux", "tiny")).images[0]
print(f"image {tuple(image.shape)}; units on the device now:", [u.name for u in group.units if u.stager.loaded])

for unit in list(group.units):
    detach_staging_hook(unit.module)
