"""The host allocator settings every worker starts with (glibc's malloc, read once at process start).

torch's CPU tensors come straight from malloc (no caching allocator on the host). glibc serves a request above its
mmap threshold (128 KiB at start) with a fresh mapping that free() returns to the system, but it raises that
threshold to the size of every mapped block it frees (up to 32 MiB). After a training step has freed one gathered
layer, the next layers' gathered parameters, unsharded gradients and communication buffers all come from the heap
instead, whose freed holes stay resident and fragment as blocks of other sizes and lifetimes fill them. Measured
with bench/memory.py (20.7M parameters, 2 gloo ranks): FSDP2 peaked at 1037-1243 MB of RSS per rank for 157 MB of
sharded state and a peak of 276 MB of live tensors, DDP at 830-900 MB for 433 MB (docs/performance.md, "Memory").

A fixed threshold (``glibc.malloc.mmap_threshold``) stops the rise: every tensor of 1 MiB or more is mapped and
unmapped by itself, and RSS follows the live tensors (FSDP2 about 600 MB, DDP about 750 MB there). Mapping afresh
costs page faults on every allocation (the same FSDP2 run took 1.5-1.8x as long); ``glibc.malloc.hugetlb=1``
(glibc 2.35 or later; older ones ignore it) backs the mappings with transparent huge pages, 512 times fewer faults,
which took it back to the time without either setting. Other allocators (musl, jemalloc preloaded) ignore both.
"""
from __future__ import annotations

MMAP_THRESHOLD = 1 << 20  # bytes: blocks from here on are mapped by themselves
TUNABLES = {"glibc.malloc.mmap_threshold": str(MMAP_THRESHOLD), "glibc.malloc.hugetlb": "1"}
# the older environment variable of the same tunable: a user who set it keeps it
ALIASES = {"glibc.malloc.mmap_threshold": "MALLOC_MMAP_THRESHOLD_"}


def worker_env(env: dict) -> dict:
    """``env`` with our malloc tunables added to ``GLIBC_TUNABLES``; each one the user already set (there or
    through its ``MALLOC_*_`` variable) is left as it is. Returns a new dict."""
    env = dict(env)
    current = env.get("GLIBC_TUNABLES", "")
    have = {item.split("=", 1)[0] for item in current.split(":") if item}
    extra = [f"{name}={value}" for name, value in TUNABLES.items()
             if name not in have and ALIASES.get(name) not in env]
    if extra:
        env["GLIBC_TUNABLES"] = ":".join(([current] if current else []) + extra)
    return env
