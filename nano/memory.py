"""Memory: how much a device has free, and whether a model fits before any of it is allocated.

Asking for more memory than there is does not fail at once. On a GPU, torch raises out-of-memory
halfway through loading; on the host, Linux hands out pages until it swaps or its OOM killer ends
the process, minutes later and with nothing printed. So the engine adds up what it is about to
allocate (the weights, counted from the config without allocating them, the request table and the
KV cache asked for, else room for one request of the full context) and compares that with the
memory free now: `torch.cuda.mem_get_info` on a GPU, the kernel's MemAvailable on the host (free
memory plus the page cache it can reclaim; where the host has no /proc, as macOS, all of its RAM),
or less where a memory cgroup (a container's `--memory`, a systemd slice) allows less: its OOM
killer ends the process at the cgroup's limit however much the host has free.
"""

import contextlib
import os
from pathlib import Path

import torch

PROC_MEMINFO, PROC_CGROUP, CGROUP_ROOT = "/proc/meminfo", "/proc/self/cgroup", Path("/sys/fs/cgroup")
# per cgroup version: the memory controller's folder under CGROUP_ROOT, the files of its limit and
# its usage, and memory.stat's key for the page cache in that usage the kernel can reclaim
CGROUP_MEMORY = {"v2": ("", "memory.max", "memory.current", "inactive_file"),
                 "v1": ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")}


class NotEnoughMemoryError(RuntimeError):
    """The model does not fit; the message gives the numbers and the ways out."""


def free_bytes(device: torch.device) -> int | None:
    """Bytes free on the device now; None where the host does not say."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    available = None
    with contextlib.suppress(OSError), open(PROC_MEMINFO) as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024  # the file counts kB
    if available is None:  # no /proc (macOS): all the RAM there is, which a model that never fits exceeds
        with contextlib.suppress(ValueError, OSError, AttributeError):  # (a platform without these names)
            available = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    cgroup = cgroup_free_bytes()  # a container's limit, which /proc/meminfo does not show
    return available if cgroup is None else cgroup if available is None else min(available, cgroup)


def cgroup_free_bytes() -> int | None:
    """What this process's memory cgroups (a container, a systemd slice, and the ones that hold
    them, each of whose limits counts) still let it allocate; None without a limit."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(PROC_CGROUP).read_text().splitlines():  # "0::/path" (v2), "4:memory:/path" (v1)
            _, controllers, path = line.split(":", 2)
            version = "v2" if controllers == "" else "v1" if "memory" in controllers.split(",") else None
            if version is None:
                continue
            mount, *files = CGROUP_MEMORY[version]
            root = CGROUP_ROOT / mount
            folder = root / path.lstrip("/")
            if not folder.is_dir():  # a container's own cgroup, mounted as the root
                folder = root
            rooms = [_cgroup_room(f, *files) for f in (folder, *folder.parents) if f.is_relative_to(root)]
            return min((room for room in rooms if room is not None), default=None)
    return None


def _cgroup_room(folder: Path, limit_file: str, usage_file: str, cache_key: str) -> int | None:
    """One cgroup's limit less what it uses, reclaimable page cache aside; None where it sets no limit."""
    if not (folder / limit_file).is_file():  # the host's root cgroup has no limit file
        return None
    limit = (folder / limit_file).read_text().strip()
    if limit == "max" or int(limit) >= 1 << 60:  # v2's and v1's "no limit"
        return None
    stat = dict(entry.split() for entry in (folder / "memory.stat").read_text().splitlines())
    used = int((folder / usage_file).read_text()) - int(stat.get(cache_key, 0))
    return max(int(limit) - used, 0)


def ensure_fits(device: torch.device, dtype: torch.dtype, needed: dict[str, int]):
    """Raise NotEnoughMemoryError unless the parts in `needed` (name -> bytes) fit in free memory."""
    free = free_bytes(device)
    total = sum(needed.values())
    if free is None or total <= free:
        return
    parts = " + ".join(f"{nbytes / 2**30:.1f} GiB {name}" for name, nbytes in needed.items() if nbytes >= 2**30 / 20)
    where = "the host (or its container's limit) has" if device.type == "cpu" else f"{device} has"
    # where the KV cache or the request table is the largest part, the flags that size it are the first way out
    largest = max(needed, key=needed.get)
    ways = {"KV cache": ["a smaller KV cache (--max-total-tokens)"],
            "request table": ["fewer --max-running-requests", "a shorter --context-length"]}.get(largest, [])
    ways += ["--dtype bfloat16"] if dtype.itemsize > 2 else []
    ways += ["a GPU" if device.type == "cpu" else "a larger GPU", "a smaller model"]
    raise NotEnoughMemoryError(f"the model needs {total / 2**30:.1f} GiB ({parts}) but {where} "
                               f"{free / 2**30:.1f} GiB free: try {', '.join(ways[:-1])} or {ways[-1]}")
