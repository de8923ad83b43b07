"""Weights shared by the ranks of one host (``share_host_masters``), on the CPU: several processes
under ``torch.distributed``'s gloo backend, each serving the same pipeline, as data-parallel ranks
on one host do."""

from __future__ import annotations

import datetime
import errno
import glob
import json
import multiprocessing
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from diffusers_residency import ModuleStager, StagingHook, shared_masters
from diffusers_residency.bench.builders import build_pipeline
from diffusers_residency.pages import PAGE
from diffusers_residency.pipeline import pipeline_state
from diffusers_residency.shared_masters import FILE_PREFIX, SHARED_FOLDER
from diffusers_residency.weights import module_stored_tensors

from .helpers import PipelineCase
from .test_changing_weights import lora_state_dict

# Bytes of a weight added to the transformer where the processes' Pss is compared (see _serve).
BALLAST = 128 << 20

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.isdir(SHARED_FOLDER), reason=f"needs shared memory at {SHARED_FOLDER}"),
]


def _join(rank: int, world: int, store: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )


def _shared_mappings() -> dict[str, tuple[int, int]]:
    """This process's mappings of shared weights: path -> (size, Pss), in kB (``/proc/self/smaps``)."""
    found: dict[str, tuple[int, int]] = {}
    current = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if not fields[0].endswith(":"):  # a mapping's first line: its address range, ..., its path
                current = fields[5] if FILE_PREFIX in line else None
                if current is not None:
                    found.setdefault(current, (0, 0))
            elif current is not None and fields[0] in ("Size:", "Pss:"):
                size, pss = found[current]
                found[current] = (size + int(fields[1]), pss) if fields[0] == "Size:" else (size, pss + int(fields[1]))
    return found


def _process_pss() -> int:
    """This process's proportional share of the memory it maps, in bytes (``/proc/self/smaps_rollup``)."""
    with open("/proc/self/smaps_rollup") as rollup:
        return next(int(line.split()[1]) * 1024 for line in rollup if line.startswith("Pss:"))


def _in_mapping(tensor: torch.Tensor) -> bool:
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            if FILE_PREFIX in line:
                low, high = (int(value, 16) for value in line.split()[0].split("-"))
                if low <= address < high:
                    return True
    return False


def _pipeline() -> PipelineCase:
    """The tiny FLUX pipeline, saved and loaded back, built before the process group is: under one,
    transformers' ``save_pretrained`` writes from rank 0 only."""
    return PipelineCase("flux")


def _modules(case: PipelineCase) -> list[torch.nn.Module]:
    return [module for module in case.pipe.components.values() if isinstance(module, torch.nn.Module)]


# What rank 1 writes, in turn, and the weights that each write changes, in place or by replacing
# them (by name in the transformer, or the VAE for "vae."): those masters, and only those, leave the
# host's copy
# (a LoRA's fusing is found by pages, which neighbours share: there, at least those).
WRITES = {
    # In place through a parameter while the transformer is off the device: into its master, this
    # rank's private mapping of the host's copy.
    "offloaded": ("proj_out.weight",),
    # Into the VAE, which a call leaves on the device: copied back into its master at the offload.
    "loaded": ("vae.decoder.conv_out.bias",),
    # One tensor written in place and another replaced through .data, while offloaded.
    "written and replaced": ("x_embedder.weight", "x_embedder.bias"),
    # Written, then cast to float64 and back (the masters of before taken back by their bits).
    "written then cast": ("norm_out.linear.weight",),
    # A parameter made anew over the same bytes (sharing its version counter), then written in
    # place, while offloaded: the new one is taken over pages already written.
    "made anew then written": ("time_text_embed.timestep_embedder.linear_1.weight",),
    # One weight written in place, and another moved onto its bytes through .data, while offloaded:
    # the one moved is bound there anew, over pages already written.
    "written and moved": (
        "time_text_embed.timestep_embedder.linear_2.weight",
        "time_text_embed.text_embedder.linear_2.weight",
    ),
    # A LoRA loaded and fused (peft adds into the base weights through .data).
    "fused": ("transformer_blocks.0.attn.to_q.base_layer.weight",),
    # Written, then a level-2 sleep and a wake: masters mapped from the files, and read back into
    # memory of the rank's own, every one (last: the host's copy is left behind for good).
    "written then asleep": ("context_embedder.weight",),
}


def _write(pipe, step: str, lora: dict, enabled: bool) -> None:
    """Make ``step``'s write (see WRITES) into ``pipe``; ``enabled``: pinned offload is, and sleeps
    and casts (the ``mirror`` does neither)."""
    transformer = pipe.transformer
    with torch.no_grad():
        if step == "offloaded":
            transformer.proj_out.weight.add_(1.0)
        elif step == "loaded":
            pipe.vae.decoder.conv_out.bias.add_(0.5)
        elif step == "written and replaced":
            transformer.x_embedder.weight.add_(0.5)
            transformer.x_embedder.bias.data = transformer.x_embedder.bias + 3.0
        elif step == "written then asleep":
            transformer.context_embedder.weight.add_(0.25)
        elif step == "written then cast":
            transformer.norm_out.linear.weight.add_(0.125)
        elif step == "written and moved":
            embedders = transformer.time_text_embed
            embedders.timestep_embedder.linear_2.weight.add_(0.5)
            embedders.text_embedder.linear_2.weight.data = embedders.timestep_embedder.linear_2.weight.data
        elif step == "made anew then written":
            linear = transformer.time_text_embed.timestep_embedder.linear_1
            linear.weight = torch.nn.Parameter(linear.weight.detach())
            linear.weight.add_(0.5)
    if step == "written then asleep" and enabled:
        pipe.sleep(2)
        pipe.wake_up()
    if step == "written then cast" and enabled:
        # Values unchanged; the mirror is not cast, as its copies would land at other alignments,
        # which CPU kernels round by (pinned offload keeps the masters' alignments).
        transformer.to(torch.float64)
        transformer.to(torch.float32)
    if step == "fused":
        pipe.load_lora_weights(lora, adapter_name="style")
        pipe.fuse_lora()


def _write_on_rank_1(rank: int, case: PipelineCase, mirror: PipelineCase, lora: dict, step: str) -> None:
    """Rank 1 makes ``step``'s write into its weights, and into the resident ``mirror``'s alike, on
    the host, where the offloaded pipeline's writes are made too (a LoRA fused on a GPU may round
    otherwise)."""
    if rank != 1:
        return
    device = mirror.pipe.device
    mirror.pipe.to("cpu")
    _write(case.pipe, step, lora, enabled=True)
    _write(mirror.pipe, step, lora, enabled=False)
    mirror.pipe.to(device)


def _own_masters(case: PipelineCase) -> tuple[set[str], int]:
    """The names of the weights whose masters left the host's copy (the component's name before
    those of components other than the transformer), and the bytes of every master outside it,
    those a cast keeps included (see conversions)."""
    names = {
        id(tensor): (name if component == "transformer" else f"{component}.{name}")
        for component, module in case.pipe.components.items()
        if isinstance(module, torch.nn.Module)
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]
    }
    stagers = [unit.stager for unit in pipeline_state(case.pipe).group.units]
    own = [group for stager in stagers for group in stager._groups if group.read_from is None and group.nbytes]
    kept = [group for stager in stagers for group in stager._kept_groups if group.read_from is None]
    unnamed = "a tensor of no component: {} {}".format
    return (
        {names.get(id(b.target), unnamed(tuple(b.target.shape), b.target.dtype)) for group in own for b in group.bindings},
        sum(g.nbytes for g in own + kept),
    )


def _loads_read_shared_mappings(case: PipelineCase) -> bool:
    """Whether every master read from the host's copy is read from a shared mapping of its file."""
    shared = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if FILE_PREFIX in line and fields[1][3] == "s":
                shared.append(tuple(int(value, 16) for value in fields[0].split("-")))
    groups = [group for unit in pipeline_state(case.pipe).group.units for group in unit.stager._groups]
    return all(
        any(low <= group.source.data_ptr() < high for low, high in shared)
        for group in groups
        if group.read_from is not None
    )


def _serve(rank: int, world: int, store: str, results: str, mode: str, device: str) -> None:
    """One rank: enable with shared masters, and write what it saw to ``results/<rank>.txt``.
    ``mode``: "share"; "apart" (rank 1 holds other weights for the VAE); "extra" (rank 1 has one
    component more, so one exchange more to make); "refuse" (rank 1 asks
    for what sharing refuses); "full" (the writer finds no room in shared memory); "die" (rank 1
    is killed as it maps a file); "sleep" (each rank sleeps and wakes, see _sleep_and_wake)."""
    case = _pipeline()
    if device != "cpu":  # the resident reference on the device, then back to the host to share
        case.pipe.to(device)
        case.reference = case.run()
        case.pipe.to("cpu")
    if mode == "apart" and rank == 1:
        with torch.no_grad():
            next(case.pipe.vae.parameters()).add_(1.0)
    if mode == "extra" and rank == 1:
        case.pipe.register_modules(image_encoder=torch.nn.Linear(4, 4))
    if mode == "full" and rank == 0:
        os.posix_fallocate = lambda *_: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device"))
    if mode == "die" and rank == 1:
        shared_masters._map = lambda *_: os.kill(os.getpid(), signal.SIGKILL)
    if mode == "share":
        # The tiny pipeline's 2 MB would be lost in a process's own memory: a weight of BALLAST
        # bytes, the same on every rank, makes the host's one copy show in the processes' Pss.
        generator = torch.Generator().manual_seed(0)
        ballast = torch.randn(BALLAST // 4, generator=generator)
        case.pipe.transformer.register_buffer("ballast", ballast)
        del ballast
    # Built before the process group is, as _pipeline says: what rank 1 writes is written into
    # these too, resident, for its output to be compared with.
    mirror = _pipeline() if mode == "share" else None
    lora = lora_state_dict(case) if mode == "share" else {}
    if mirror is not None and device != "cpu":
        mirror.pipe.to(device)
    _join(rank, world, store)
    pss_before = _process_pss()
    extra = {"host_budget": "1GB"} if mode == "refuse" and rank == 1 else {}
    try:
        # Every component offloaded between calls (no budget), whatever the device's room.
        case.pipe.enable_pinned_offload(device, vram_budget=None, share_host_masters=True, **extra)
    except (ValueError, RuntimeError) as exc:
        moved = any(_in_mapping(t) for module in _modules(case) for t in module_stored_tensors((module,)) if t.numel())
        Path(results, f"{rank}.txt").write_text(f"refused ({'moved' if moved else 'unchanged'}): {exc}")
        return
    if mode == "sleep":
        _sleep_and_wake(rank, case, results)
        return
    exact = all(torch.equal(case.run(), case.reference) for _ in range(2))
    masters = [group.master for unit in pipeline_state(case.pipe).group.units for group in unit.stager._groups]
    inside = all(_in_mapping(master) for master in masters if master.numel())
    weights = sum(master.numel() for master in masters)
    dist.barrier()  # every rank has mapped every file before any Pss is read
    mappings = _shared_mappings()
    size, pss = sum(v[0] for v in mappings.values()), sum(v[1] for v in mappings.values())
    process_pss = (pss_before, _process_pss())
    sharing = case.pipe.residency_report().host_sharing
    figures = {"exact": exact, "inside": inside, "weights": weights, "size": size, "pss": pss, "files": len(mappings)}
    figures |= {"rank": rank, "report": str(sharing), "shared": sharing.shared_bytes, "owned": sharing.owned_bytes}
    figures["process pss"] = process_pss
    figures["pinned"] = all(unit.stager.pinned for unit in pipeline_state(case.pipe).group.units)
    dist.barrier()  # no rank writes before every rank has read its Pss
    figures["read shared"] = _loads_read_shared_mappings(case)
    for step in WRITES:
        # Rank 1 writes; every rank's output must equal its mirror's (rank 0's, untouched), and
        # rank 1's must differ from what it was before (else the comparison shows nothing).
        before = case.run()
        _write_on_rank_1(rank, case, mirror, lora, step)
        dist.barrier()
        output = case.run()
        own, own_bytes = _own_masters(case)
        figures[step] = {
            "as written": torch.equal(output, mirror.run()),
            "changed": not torch.equal(output, before),
            "own": sorted(own),
            "own bytes": own_bytes,
            "owned": case.pipe.residency_report().host_sharing.owned_bytes,
        }
        dist.barrier()
    Path(results, f"{rank}.txt").write_text(json.dumps(figures))
    dist.barrier()
    dist.destroy_process_group()


def _sleep_and_wake(rank: int, case: PipelineCase, results: str) -> None:
    """Each level of sleep and a wake, every output compared with the resident one; a level-2 sleep
    swaps the masters for views of the checkpoint files, and the wake reads them back into memory of
    the rank's own (see docs/multi-gpu.md)."""
    figures = {}
    for level in (1, 2):
        case.pipe.sleep(level)
        case.pipe.wake_up()
        figures[f"level {level}"] = all(torch.equal(case.run(), case.reference) for _ in range(2))
        figures[f"owned after level {level}"] = case.pipe.residency_report().host_sharing.owned_bytes
    Path(results, f"{rank}.txt").write_text(json.dumps(figures))
    dist.barrier()
    dist.destroy_process_group()


def _run_ranks(tmp_path: Path, world: int, *, mode: str = "share", device: str = "cpu") -> tuple[list[int], list[str]]:
    """Each rank's exit code, and what each wrote (missing: "")."""
    context = multiprocessing.get_context("spawn")
    store, results = str(tmp_path / "store"), str(tmp_path / "results")
    os.makedirs(results)
    ranks = [context.Process(target=_serve, args=(rank, world, store, results, mode, device)) for rank in range(world)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=240)
    for process in ranks:
        if process.is_alive():  # hung in an exchange: a failure someone did not tell
            process.kill()
            process.join()
    written = [Path(results, f"{rank}.txt") for rank in range(world)]
    return [process.exitcode for process in ranks], [path.read_text() if path.exists() else "" for path in written]


def _ours() -> set[str]:
    return set(glob.glob(os.path.join(SHARED_FOLDER, FILE_PREFIX + "*")))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_ranks_of_a_host_share_one_copy_and_stay_exact(tmp_path: Path, device: str) -> None:
    # On CUDA, two ranks on one GPU, each page-locking the host's copy.
    before = _ours()
    codes, lines = _run_ranks(tmp_path, 2, device=device)
    assert codes == [0, 0], lines
    every = [json.loads(line) for line in lines]
    # Host memory across the ranks: before enabling, each holds its own copy of the ballast; after,
    # they hold one between them (Pss splits a shared page between the processes that map it).
    pss_before, pss_after = (sum(figures["process pss"][moment] for figures in every) for moment in (0, 1))
    assert pss_before - pss_after >= 0.8 * BALLAST, (pss_before, pss_after)
    for figures in every:
        assert figures["exact"], "every rank's output equal to its resident output"
        assert figures["inside"], "every master lies in the host's shared copy"
        assert figures["files"] == 4, "one mapping per component"
        assert figures["size"] * 1024 >= figures["weights"]
        assert (figures["shared"], figures["owned"]) == (figures["weights"], 0)
        assert figures["pinned"] == (device != "cpu"), "on a GPU, loads read the host's copy page-locked"
        assert figures["read shared"], "loads read the host's copy through a shared mapping"
        written: set[str] = set()
        loose = False  # from the LoRA's fusing on: the table names one of the weights it fuses
        for step, names in WRITES.items():
            seen = figures[step]
            assert seen["as written"], f"{step}: each rank's output is its own weights'"
            assert seen["changed"] == (figures["rank"] == 1), f"{step}: a rank's writes are its own"
            written |= set(names) if figures["rank"] == 1 else set()
            # The masters rank 1 wrote, and no others (neighbours in their pages included; but the
            # LoRA's other weights, and after a level-2 sleep all), are its own now; its report
            # counts them, and no more than a page at each end of each.
            own = set(seen["own"])
            loose = loose or step == "fused"
            assert own >= written if loose else own == written, (step, own, written)
            assert seen["own bytes"] <= seen["owned"] <= seen["own bytes"] + 2 * PAGE * len(own), (step, seen)
        assert figures["report"].startswith(f"rank {figures['rank']} of 2, host masters shared with ranks [0, 1]: ")
        # Each rank maps each file twice (its tensors' private mapping, and the one loads read), and
        # its share of the mapped pages is a quarter of both: the pages are the host's, once.
        assert abs(figures["pss"] - figures["size"] / 4) <= 0.05 * figures["size"], figures
    assert _ours() == before


def test_ranks_sharing_sleep_and_wake_exact(tmp_path: Path) -> None:
    codes, lines = _run_ranks(tmp_path, 2, mode="sleep")
    assert codes == [0, 0], lines
    for figures in map(json.loads, lines):
        assert figures["level 1"] and figures["level 2"], figures
        # Level 1 keeps the masters where they are, the host's copy; level 2 reads them back into
        # memory of the rank's own.
        assert figures["owned after level 1"] == 0 and figures["owned after level 2"] > 0, figures


@pytest.mark.parametrize(
    ("mode", "told"),
    [
        ("apart", "share_host_masters: rank 1 holds other weights for 'vae' than rank 0"),
        ("extra", "share_host_masters: rank 1 shares components ['text_encoder', 'text_encoder_2', 'image_encoder',"),
        ("refuse", "share_host_masters: rank 1 could not enable (share_host_masters keeps every master in shared"),
        ("full", "share_host_masters: rank 0 could not write 'text_encoder' to /dev/shm ([Errno 28]"),
    ],
)
def test_a_failure_on_one_rank_is_raised_on_every_rank_before_anything_changes(
    tmp_path: Path, mode: str, told: str
) -> None:
    # Other weights on one rank (the components before the VAE were fine), a refusal on one rank
    # only, no room in shared memory for the writer: each rank raises, none waits for the other,
    # no weight is rebound and no file is left.
    before = _ours()
    codes, lines = _run_ranks(tmp_path, 2, mode=mode)
    assert codes == [0, 0], lines
    assert all(line.startswith("refused (unchanged): ") for line in lines), lines
    assert all(told in line for line in lines) or (mode == "refuse" and told in lines[0]), lines
    assert _ours() == before


def test_a_rank_killed_while_enabling_leaves_no_file_behind(tmp_path: Path) -> None:
    # Rank 1 dies as it maps the first file; the writer finds it gone at the next exchange,
    # unlinks the file and raises.
    before = _ours()
    codes, lines = _run_ranks(tmp_path, 2, mode="die")
    assert codes == [0, -signal.SIGKILL], lines
    assert lines[0].startswith("refused (unchanged): "), lines
    assert _ours() == before


def _die_mid_call(rank: int, world: int, store: str) -> None:
    case = _pipeline()
    _join(rank, world, store)
    case.pipe.enable_pinned_offload("cpu", share_host_masters=True)
    if rank == 1:
        case.pipe.transformer.register_forward_pre_hook(lambda *_: os.kill(os.getpid(), signal.SIGKILL))
    case.run()
    dist.destroy_process_group()


def test_a_rank_killed_mid_call_leaves_no_file_behind(tmp_path: Path) -> None:
    before = _ours()
    context = multiprocessing.get_context("spawn")
    store = str(tmp_path / "store")
    ranks = [context.Process(target=_die_mid_call, args=(rank, 2, store)) for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=240)
    assert [process.exitcode for process in ranks] == [0, -signal.SIGKILL]
    assert _ours() == before


@pytest.mark.parametrize(
    ("before", "extra", "match"),
    [
        (False, {}, "torch.distributed initialised"),
        (False, {"host_budget": "1GB"}, "host_budget serves some from files"),
        (True, {}, "given to the first enable_pinned_offload"),
    ],
)
def test_sharing_that_cannot_be_done_is_refused_before_anything_changes(before: bool, extra: dict, match: str) -> None:
    case = PipelineCase("flux")
    if before:
        case.pipe.enable_pinned_offload("cpu")
    hooks = {name: getattr(module, "_hf_hook", None) for name, module in case.pipe.components.items()}
    with pytest.raises(ValueError, match=match):
        case.pipe.enable_pinned_offload("cpu", share_host_masters=True, **extra)
    assert hooks == {name: getattr(module, "_hf_hook", None) for name, module in case.pipe.components.items()}
    assert torch.equal(case.run(), case.reference)


def test_a_report_counts_as_owned_only_the_pages_its_own_pipeline_wrote(tmp_path: Path) -> None:
    # Two pipelines sharing in one process (a world of one rank): a write into the second one's
    # host copy is the second one's own, not the first one's.
    _join(0, 1, str(tmp_path / "store"))
    try:
        first, second = _pipeline(), _pipeline()
        for case in (first, second):
            case.pipe.enable_pinned_offload("cpu", share_host_masters=True)
        with torch.no_grad():
            second.pipe.transformer.proj_out.weight.add_(1.0)  # offloaded: into its master
        assert first.pipe.residency_report().host_sharing.owned_bytes == 0
        assert second.pipe.residency_report().host_sharing.owned_bytes > 0
        assert torch.equal(first.run(), first.reference)
    finally:
        dist.destroy_process_group()


def test_writes_no_tensor_counter_shows_still_leave_the_host_copy(tmp_path: Path) -> None:
    # A world of one rank. A quantized weight written through its wrapper (torchao's copy_ moves
    # the wrapper's counter, not its inner tensors') and a layer built under inference mode (no
    # counters at all), each written in place while offloaded: the next load reads the writes.
    quantization = pytest.importorskip("torchao.quantization")
    torch.manual_seed(0)
    quantized, reference = (torch.nn.Sequential(torch.nn.Linear(256, 256)).eval() for _ in range(2))
    reference.load_state_dict(quantized.state_dict())
    for module in (quantized, reference):
        quantization.quantize_(module, quantization.Int8WeightOnlyConfig())
    with torch.inference_mode():
        inference = torch.nn.Linear(256, 256)
    other = torch.nn.Sequential(torch.nn.Linear(256, 256))
    quantization.quantize_(other, quantization.Int8WeightOnlyConfig())
    _join(0, 1, str(tmp_path / "store"))
    try:
        host_copy = shared_masters.share_host_weights(
            {"quantized": quantized, "inference": inference}, None, torch.device("cpu")
        )
        stagers = [
            ModuleStager(module, torch.device("cpu"), pin_memory=False, host_copy=host_copy)
            for module in (quantized, inference)
        ]
        assert all(group.read_from is not None for stager in stagers for group in stager._groups if group.nbytes)
        with torch.no_grad():
            quantized.load_state_dict(other.state_dict())
            reference.load_state_dict(other.state_dict())
        with torch.inference_mode():
            inference.weight.fill_(0.5)
            x = torch.randn(4, 256)
            for stager in stagers:
                stager.load()
            assert torch.equal(quantized(x), reference(x))
            assert torch.equal(inference.weight, torch.full_like(inference.weight, 0.5))
    finally:
        dist.destroy_process_group()


def test_a_weight_sharing_a_page_with_one_written_stays_in_the_host_copy(tmp_path: Path) -> None:
    # A world of one rank. Small weights lie back to back in the host copy's file, several to a
    # page: writing one makes the page this rank's own, and its neighbours' bytes there are still
    # the copy's. Neither after a write found through the page table (fuse_lora's way) nor when a
    # cast binds the buffer anew over that page does a neighbour get a copy of its own.
    torch.manual_seed(0)
    module = torch.nn.Linear(100, 7)
    module.register_buffer("scale", torch.randn(500))
    _join(0, 1, str(tmp_path / "store"))
    try:
        host_copy = shared_masters.share_host_weights({"module": module}, None, torch.device("cpu"))
        stager = ModuleStager(module, torch.device("cpu"), pin_memory=False, host_copy=host_copy)
        pages = {group.master.data_ptr() // PAGE for group in stager._groups}
        assert len(pages) == 1, "the three weights share one page of the file"
        expected = {name: tensor.clone() for name, tensor in module.state_dict().items()}
        with torch.no_grad():
            module.weight.data.add_(1.0)  # through .data: only the page table can tell
            expected["weight"] += 1.0
        stager.copy_written_pages()
        for dtype in (torch.float64, torch.float32):  # as the pipeline's hooks cast: through the masters
            stager.convert(module._apply, lambda tensor, dtype=dtype: tensor.to(dtype))
        stager.load()  # the buffer was bound anew by the cast, over the page written
        reading = {id(b.target): group.read_from is not None for group in stager._groups for b in group.bindings}
        assert reading == {id(module.weight): False, id(module.bias): True, id(module.scale): True}
        for name, tensor in module.state_dict().items():
            assert torch.equal(tensor, expected[name]), name
    finally:
        dist.destroy_process_group()


def test_an_inference_weight_sharing_a_page_with_one_written_stays_in_the_host_copy(tmp_path: Path) -> None:
    # A world of one rank. Tensors made under inference mode have no version counter: their
    # masters are checked against the page table at every load, and a neighbour's write in their
    # page leaves them in the host's copy.
    with torch.inference_mode():
        module = torch.nn.Linear(100, 7)
    _join(0, 1, str(tmp_path / "store"))
    try:
        host_copy = shared_masters.share_host_weights({"module": module}, None, torch.device("cpu"))
        stager = ModuleStager(module, torch.device("cpu"), pin_memory=False, host_copy=host_copy)
        assert len({group.master.data_ptr() // PAGE for group in stager._groups}) == 1, "one page for both"
        with torch.inference_mode():
            expected = module.bias.clone(), module.weight + 1.0
            module.weight.add_(1.0)
            stager.load()
        reading = {id(b.target): group.read_from is not None for group in stager._groups for b in group.bindings}
        assert reading == {id(module.weight): False, id(module.bias): True}
        assert torch.equal(module.bias, expected[0]) and torch.equal(module.weight, expected[1])
    finally:
        dist.destroy_process_group()


def test_a_component_replaced_on_one_rank_is_refused_at_its_next_call_before_anything_changes(tmp_path: Path) -> None:
    # Enabling with share_host_masters is collective: one rank cannot enable again alone, as it does
    # for a component replaced without sharing (a world of one rank here).
    _join(0, 1, str(tmp_path / "store"))
    try:
        case = _pipeline()
        case.pipe.enable_pinned_offload("cpu", share_host_masters=True)
        state = pipeline_state(case.pipe)
        old = case.pipe.vae
        case.pipe.vae = build_pipeline("flux", "tiny").vae.eval()
        for _ in range(2):
            with pytest.raises(RuntimeError, match=r"\['vae'\] replaced since .* share_host_masters=True.* every rank"):
                case.run()
        assert pipeline_state(case.pipe) is state and isinstance(old._hf_hook, StagingHook)
        case.pipe.vae = old
        assert torch.equal(case.run(), case.reference)
    finally:
        dist.destroy_process_group()
