"""Data-parallel ranks on one host, each serving the same pipeline under pinned offload: every call's
time on every rank, and the host memory of all the ranks together, with the host's copy of the
weights shared (``share_host_masters=True``) or one copy per rank (``--own-copies``).

    torchrun --nproc-per-node 2 -m diffusers_residency.bench.ranks --pipeline flux --scale full \\
        --vram-budget 16GB --calls 3

Each rank computes on GPU ``LOCAL_RANK`` modulo the GPUs there are: with fewer GPUs than ranks,
ranks share a GPU, and its compute, so their times say nothing of one rank per GPU. Host memory is
each process's Pss (``/proc/self/smaps_rollup``), which splits a page that several processes map
between them: summed over the ranks, the host's copy counts once. Rank 0 prints the results.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from .. import _device
from ..text import format_bytes, parse_bytes
from .builders import PIPELINE_KINDS, build_pipeline, call_kwargs, pipeline_output


def _process_pss() -> int:
    with open("/proc/self/smaps_rollup") as rollup:
        return next(int(line.split()[1]) * 1024 for line in rollup if line.startswith("Pss:"))


def _weight_bytes(pipe) -> int:
    modules = [module for module in pipe.components.values() if isinstance(module, torch.nn.Module)]
    return sum(tensor.numel() * tensor.element_size() for module in modules for tensor in module.state_dict().values())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipeline", choices=PIPELINE_KINDS, default="flux")
    parser.add_argument("--scale", choices=("tiny", "full"), default="tiny")
    parser.add_argument("--vram-budget", default=None, help="per rank, e.g. 16GB; its GPU memory is capped to it too")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--own-copies", action="store_true", help="each rank keeps its own masters (no sharing)")
    args = parser.parse_args(argv)

    accelerator = _device.current_accelerator()
    dtype = torch.bfloat16 if accelerator is not None else torch.float32
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if accelerator is not None:
        device = torch.device(accelerator.type, local_rank % torch.accelerator.device_count())
        torch.accelerator.set_device_index(device.index)
    else:
        device = torch.device("cpu")
    # Built before the process group: builders save tiny pipelines and load them back, and
    # transformers' save_pretrained writes from rank 0 only under a process group. A full-scale
    # one is built on the device (its random initialisation takes minutes on the CPU), then moved
    # to the host, where sharing wants it, as from_pretrained would have left it.
    pipe = build_pipeline(args.pipeline, args.scale, dtype=dtype, device=device if args.scale == "full" else "cpu")
    pipe.to("cpu")
    _device.empty_cache(device)
    weights = _weight_bytes(pipe)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    budget = parse_bytes(args.vram_budget) if args.vram_budget else None
    _device.cap_device_memory(device, budget)

    dist.barrier()
    started = time.perf_counter()
    pipe.enable_pinned_offload(
        device, vram_budget=args.vram_budget or "auto", share_host_masters=not args.own_copies
    )
    enable_seconds = time.perf_counter() - started
    seconds = []
    for call in range(args.calls):
        dist.barrier()  # the ranks' calls run side by side, as a data-parallel service's would
        started = time.perf_counter()
        pipeline_output(pipe, call_kwargs(args.pipeline, args.scale, seed=rank * 1000 + call))
        _device.synchronize(device)
        seconds.append(time.perf_counter() - started)
    dist.barrier()
    sharing = pipe.residency_report().host_sharing
    mine = {
        "rank": rank,
        "device": str(device),
        "enable": enable_seconds,
        "calls": seconds,
        "pss": _process_pss(),
        "shared": sharing.shared_bytes if sharing else 0,
        "owned": sharing.owned_bytes if sharing else None,
    }
    every = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        _print(every, weights, args)
    dist.barrier()
    dist.destroy_process_group()


def _print(every: list[dict], weights: int, args: argparse.Namespace) -> None:
    copies = "one copy per rank" if args.own_copies else "the host's copy shared"
    print(f"{args.pipeline} ({args.scale}), {len(every)} ranks, vram_budget {args.vram_budget or 'auto'} each, {copies}")
    print(f"weights {format_bytes(weights)} per pipeline")
    calls = len(every[0]["calls"])
    print("| rank | device | enable s | " + " | ".join(f"call {i + 1} s" for i in range(calls)) + " | Pss | masters shared | owned |")
    print("| --- " * (6 + calls) + "|")
    for figures in every:
        times = " | ".join(f"{value:.3f}" for value in figures["calls"])
        owned = "-" if figures["owned"] is None else format_bytes(figures["owned"])
        print(
            f"| {figures['rank']} | {figures['device']} | {figures['enable']:.2f} | {times} | "
            f"{format_bytes(figures['pss'])} | {format_bytes(figures['shared'])} | {owned} |"
        )
    total = sum(figures["pss"] for figures in every)
    print(f"host memory of all ranks (Pss): {format_bytes(total)}, {total / weights:.2f}x the weights of one pipeline")


if __name__ == "__main__":
    main()
