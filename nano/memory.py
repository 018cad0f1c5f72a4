"""Memory: how much a device has free, and whether a model fits before any of it is allocated.

Asking for more memory than there is does not fail at once. On a GPU, torch raises out-of-memory
halfway through loading; on the host, Linux hands out pages until it swaps or its OOM killer ends
the process, minutes later and with nothing printed. So the engine adds up what it is about to
allocate (the weights, counted from the config without allocating them, and the smallest KV cache
it can run with) and compares that with the memory free now: `torch.cuda.mem_get_info` on a GPU,
the kernel's MemAvailable on the host (free memory plus the page cache it can reclaim).
"""

import contextlib

import torch


class NotEnoughMemoryError(RuntimeError):
    """The model does not fit; the message gives the numbers and the ways out."""


def free_bytes(device: torch.device) -> int | None:
    """Bytes free on the device now; None where the host does not say (no /proc/meminfo)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with contextlib.suppress(OSError), open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the file counts kB
    return None


def ensure_fits(device: torch.device, dtype: torch.dtype, needed: dict[str, int]):
    """Raise NotEnoughMemoryError unless the parts in `needed` (name -> bytes) fit in free memory."""
    free = free_bytes(device)
    total = sum(needed.values())
    if free is None or total <= free:
        return
    parts = " + ".join(f"{nbytes / 2**30:.1f} GiB {name}" for name, nbytes in needed.items() if nbytes >= 2**30 / 20)
    where = "the host has" if device.type == "cpu" else f"{device} has"
    ways = ["--dtype bfloat16"] if dtype.itemsize > 2 else []
    ways += ["a GPU" if device.type == "cpu" else "a larger GPU", "a smaller model"]
    raise NotEnoughMemoryError(f"the model needs {total / 2**30:.1f} GiB ({parts}) but {where} "
                               f"{free / 2**30:.1f} GiB free: try {', '.join(ways[:-1])} or {ways[-1]}")
