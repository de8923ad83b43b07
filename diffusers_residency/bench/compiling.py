"""How ``--compile`` compiles the denoiser the way a user would, undoes it for the next mode, and
counts what torch.compile made while a mode's calls were timed (graphs, CUDA graph recordings)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers import DiffusionPipeline

# The components diffusers' pipelines call at every denoising step: what --compile compiles.
DENOISERS = ("transformer", "unet")


@dataclass(frozen=True)
class CompileSettings:
    """How --compile compiles the denoiser: ``how`` is ``regional`` (``compile_repeated_blocks``) or
    ``whole`` (``component.compile()``); ``mode`` is torch.compile's (``None``: its default)."""

    how: str
    backend: str = "inductor"
    mode: str | None = None

    def kwargs(self) -> dict[str, Any]:
        """What ``torch.compile`` is called with."""
        return {"backend": self.backend, "mode": self.mode, "fullgraph": True}


def compile_denoiser(pipe: DiffusionPipeline, settings: CompileSettings) -> None:
    """Compile the denoiser the way a user would."""
    denoiser = next(pipe.components[name] for name in DENOISERS if name in pipe.components)
    compile_ = denoiser.compile_repeated_blocks if settings.how == "regional" else denoiser.compile
    compile_(**settings.kwargs())


def uncompile(pipe: DiffusionPipeline) -> None:
    """Undo :func:`compile_denoiser` once the mode's hooks are gone, so the next mode starts from the
    plain modules: ``nn.Module.compile`` leaves ``_compiled_call_impl``, and a staging hook removed
    after ``compile()`` leaves the compiled forward as the instance's ``forward``."""
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            for module in component.modules():
                module._compiled_call_impl = None
                if hasattr(module.__dict__.get("forward"), "_torchdynamo_orig_callable"):
                    del module.forward
    torch._dynamo.reset()


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def cuda_graphs_recorded(device: torch.device) -> int:
    """CUDA graphs that inductor's graph tree for ``device`` holds (what ``reduce-overhead`` records):
    a compiled forward whose weights come back at addresses not seen before records again. The
    tree is torch's private state (``torch._inductor.cudagraph_trees``); nothing public counts
    recordings."""
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(device.index or 0, create_if_none_exists=False)
    nodes = [] if manager is None or manager.roots is None else [n for roots in manager.roots.values() for n in roots]
    recorded = 0
    while nodes:
        node = nodes.pop()
        recorded += 1
        nodes.extend(child for children in node.children.values() for child in children)
    return recorded
