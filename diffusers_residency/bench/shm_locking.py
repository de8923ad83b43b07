"""Page-locking the mappings of a file of ``/dev/shm`` (CUDA only): which mapping the kernel copies
for the process that locks it, what the device reads after a write through it, the copy rate from
each against pageable memory, and two processes' Pss of one file locked by both.

    python3 -m diffusers_residency.bench.shm_locking

Why shared_masters locks a shared mapping and binds tensors to a private one: docs/measurements.md."""
import mmap
import os
import time

import torch
import torch.multiprocessing as mp

SIZE = 1 << 30
PATH = "/dev/shm/diag-shm-pin"


def anon_and_pss(address):
    out = {}
    with open("/proc/self/smaps") as smaps:
        current = False
        for line in smaps:
            fields = line.split()
            if not fields[0].endswith(":"):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                current = lo <= address < hi
            elif current and fields[0] in ("Anonymous:", "Pss:", "Rss:", "Locked:"):
                out[fields[0][:-1]] = int(fields[1]) // 1024
    return out


def whole_pss():
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) // 1024


def register(addr, n, flags):
    err = torch.cuda.cudart().cudaHostRegister(addr, n, flags)
    return int(err)


def mapped(flags):
    fd = os.open(PATH, os.O_RDWR)
    m = mmap.mmap(fd, SIZE, flags=flags)
    os.close(fd)
    t = torch.frombuffer(memoryview(m), dtype=torch.uint8)
    return m, t


def h2d_rate(src, dev):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        dev.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 3 * SIZE / (time.perf_counter() - t0) / 1e9


def single(kind):
    dev = torch.empty(SIZE, dtype=torch.uint8, device="cuda")
    flags = {"private": mmap.MAP_PRIVATE, "private_ro": mmap.MAP_PRIVATE, "shared": mmap.MAP_SHARED}[kind]
    m, t = mapped(flags)
    before = anon_and_pss(t.data_ptr())
    reg = {"private": 1, "private_ro": 1 | 8, "shared": 1}[kind]
    t0 = time.perf_counter()
    err = register(t.data_ptr(), SIZE, reg)
    took = time.perf_counter() - t0
    after = anon_and_pss(t.data_ptr())
    print(f"[{kind}] register err={err} in {took:.3f}s before={before} after={after}", flush=True)
    if err:
        torch.cuda.cudart().cudaGetLastError()
        return
    print(f"[{kind}] H2D {h2d_rate(t, dev):.1f} GB/s pinned? {t.is_pinned()}", flush=True)
    dev.copy_(t)
    print(f"[{kind}] device equal to host: {torch.equal(dev.cpu(), t)}", flush=True)
    t[:4096].fill_(7)  # a write through the mapping
    dev.copy_(t)
    torch.cuda.synchronize()
    print(f"[{kind}] after a write: device sees it: {int(dev[0])==7}; anon now {anon_and_pss(t.data_ptr())}", flush=True)
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def child(rank, kind, barrier, results):
    torch.cuda.init()
    dev = torch.empty(SIZE, dtype=torch.uint8, device="cuda")
    base = whole_pss()
    maps = []
    if kind in ("shared", "dual"):
        m, t = mapped(mmap.MAP_SHARED)
        err = register(t.data_ptr(), SIZE, 1 | 8)
        maps.append((m, t))
        rate = h2d_rate(t, dev)
    if kind == "dual":
        m2, t2 = mapped(mmap.MAP_PRIVATE)
        t2.sum()  # read every page
        maps.append((m2, t2))
    barrier.wait()
    results[rank] = (err, rate, whole_pss() - base, anon_and_pss(maps[0][1].data_ptr()))
    barrier.wait()


def two(kind):
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    manager = ctx.Manager()
    results = manager.dict()
    procs = [ctx.Process(target=child, args=(r, kind, barrier, results)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    print(f"[two {kind}] " + "; ".join(f"rank {r}: err {v[0]} H2D {v[1]:.1f} GB/s Pss growth {v[2]} MB mapping {v[3]}" for r, v in sorted(results.items())), flush=True)


if __name__ == "__main__":
    with open(PATH, "wb") as f:
        f.truncate(SIZE)
    fd = os.open(PATH, os.O_RDWR)
    m = mmap.mmap(fd, SIZE, flags=mmap.MAP_SHARED)
    torch.frombuffer(memoryview(m), dtype=torch.uint8).random_(0, 255)
    os.close(fd)
    try:
        for kind in ("private", "private_ro", "shared"):
            single(kind)
        pageable = torch.empty(SIZE, dtype=torch.uint8).random_(0, 255)
        print(f"[pageable anon] H2D {h2d_rate(pageable, torch.empty(SIZE, dtype=torch.uint8, device='cuda')):.1f} GB/s", flush=True)
        del pageable
        for kind in ("shared", "dual"):
            two(kind)
    finally:
        os.unlink(PATH)
