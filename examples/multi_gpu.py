"""One pipeline per GPU, one host copy of the weights for all of them (data-parallel serving).

    torchrun --nproc-per-node 2 examples/multi_gpu.py            # a GPU per rank, or the CPU
    torchrun --nproc-per-node 2 examples/multi_gpu.py --device cpu

Every rank builds the same pipeline on the host (here a real FluxPipeline from a tiny config with
random weights, so this runs with no download; with a checkpoint, ``FluxPipeline.from_pretrained``)
and enables pinned offload with ``share_host_masters=True``: the host's first rank writes each
component's weights to shared memory once, every rank checks them against its own, maps them and
page-locks them for its GPU, and its private copy goes. ``vram_budget`` applies to each rank's own
GPU. ``python -m diffusers_residency.bench.ranks`` measures the same with every call timed.
"""

import argparse
import os

import torch
import torch.distributed as dist

import diffusers_residency  # noqa: F401  (adds enable_pinned_offload & co. to DiffusionPipeline)
from diffusers_residency.bench.builders import build_pipeline, call_kwargs

parser = argparse.ArgumentParser()
parser.add_argument("--device", default=None)
args = parser.parse_args()
local_rank = int(os.environ.get("LOCAL_RANK", "0"))
accelerator = torch.accelerator.current_accelerator(check_available=True)
device = torch.device(args.device) if args.device else torch.device(accelerator.type, local_rank) if accelerator else torch.device("cpu")

# The builder saves and loads the pipeline back, and transformers' save_pretrained writes from rank 0
# only under a process group: build first, then join. (A from_pretrained of a checkpoint does not care.)
pipe = build_pipeline("flux", "tiny")
# The ranks exchange a few small messages while enabling, and nothing while serving: gloo will do.
dist.init_process_group("gloo")

# Each rank page-locks the host's one copy for its own GPU.
pipe.enable_pinned_offload(device, share_host_masters=True)
image = pipe(**call_kwargs("flux", "tiny", seed=dist.get_rank())).images[0]  # each rank its own image
print(f"rank {dist.get_rank()}: image {tuple(image.shape)} on {image.device}")
print(pipe.residency_report())

dist.destroy_process_group()
