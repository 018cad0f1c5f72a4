"""The KV cache: a pool of token slots, a table that maps requests to slots, and a slot allocator.

During decoding every layer needs the keys and values of all earlier tokens of a request. Instead of
one contiguous buffer per request (which wastes memory on requests that stop early), we keep one
big pool of token *slots* per layer and hand out slots one token at a time ("page size 1"):
- `KVPool`: per layer, K `[num_slots, num_kv_heads, k_dim]` and V `[num_slots, num_kv_heads, v_dim]`.
  With DeepSeek's multi-head latent attention (MLA) a token is one 576-wide latent row
  `[c | k_pe]` shared by all heads, and the "value" is a view of its first 512 channels.
- `ReqToTokenPool`: `req_to_token[row, position]` is the slot holding that position of the request
  that owns `row`. Attention kernels gather a request's K/V through it.
- `SlotAllocator`: a free list of slots kept on the device, so handing out slots never syncs.
  Slot 0 is reserved: padded rows of a CUDA-graph batch write their junk K/V there.

The pool is sized from the memory left after the weights are loaded (`mem_fraction`), or from an
explicit token count; the engine prints the resulting capacity. On CPU the fraction is taken of the
host's available memory and capped at `CPU_KV_CACHE_MAX_BYTES`: the host is shared with everything
else the user runs, the pool is zeroed up front (about a second per GiB), and at CPU decode speeds
a larger pool would never fill. 1 GiB holds 8,191 tokens of Llama-3-8B in bfloat16 (slot 0 takes
the 8,192nd), or 23k of SmolLM2-135M in float32; `--max-total-tokens` asks for more.
"""

import torch

from nano.config import ModelConfig
from nano.memory import free_bytes

CPU_KV_CACHE_MAX_BYTES = 1 << 30


class KVPool:
    def __init__(self, cfg: ModelConfig, capacity: int, dtype: torch.dtype, device, use_mla: bool):
        """capacity: the tokens it holds; it has one slot more, the reserved slot 0."""
        (kv_heads, k_dim), (_, v_dim) = kv_shapes(cfg, use_mla)
        self.capacity, self.use_mla = capacity, use_mla
        num_slots, layers = capacity + 1, range(cfg.num_layers)
        self.k_buffers = [torch.zeros(num_slots, kv_heads, k_dim, dtype=dtype, device=device) for _ in layers]
        if use_mla:  # the value is the latent c: the first v_dim channels of the cached row
            self.v_buffers = [k[..., :v_dim] for k in self.k_buffers]
        else:
            self.v_buffers = [torch.zeros(num_slots, kv_heads, v_dim, dtype=dtype, device=device) for _ in layers]

    def store(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None):
        """Write new tokens' k [T, Hkv, k_dim] (and v) into slots loc [T]."""
        self.k_buffers[layer_id][loc] = k
        if not self.use_mla:
            self.v_buffers[layer_id][loc] = v


def kv_shapes(cfg: ModelConfig, use_mla: bool) -> tuple[tuple[int, int], tuple[int, int]]:
    """((kv_heads, k_dim), (kv_heads, v_dim)) of one cached token in one layer."""
    if cfg.is_deepseek and use_mla:
        return (1, cfg.kv_lora_rank + cfg.qk_rope_head_dim), (1, cfg.kv_lora_rank)
    if cfg.is_deepseek:  # MLA expanded to plain multi-head attention: every head caches its K and V
        return (cfg.num_heads, cfg.head_dim), (cfg.num_heads, cfg.v_head_dim)
    return (cfg.num_kv_heads, cfg.head_dim), (cfg.num_kv_heads, cfg.head_dim)


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, use_mla: bool) -> int:
    (kv_heads, k_dim), (_, v_dim) = kv_shapes(cfg, use_mla)
    per_layer = kv_heads * (k_dim if use_mla and cfg.is_deepseek else k_dim + v_dim)
    return cfg.num_layers * per_layer * dtype.itemsize


def tokens_for_memory(cfg, dtype, device: torch.device, use_mla: bool, mem_fraction: float) -> int:
    """How many tokens' K/V (and the reserved slot) fit in `mem_fraction` of the device memory that is free now (on CPU,
    in at most CPU_KV_CACHE_MAX_BYTES)."""
    free = free_bytes(device)
    budget = CPU_KV_CACHE_MAX_BYTES if free is None else int(free * mem_fraction)
    if device.type == "cpu":
        budget = min(budget, CPU_KV_CACHE_MAX_BYTES)
    return max(budget // kv_bytes_per_token(cfg, dtype, use_mla) - 1, 1)


class ReqToTokenPool:
    def __init__(self, max_requests: int, max_context: int, device):
        self.req_to_token = torch.zeros(max_requests, max_context, dtype=torch.int32, device=device)
        self.free_rows = list(range(max_requests))

    def alloc(self) -> int | None:
        return self.free_rows.pop() if self.free_rows else None

    def free(self, row: int):
        self.free_rows.append(row)


class SlotAllocator:
    def __init__(self, capacity: int, device):
        # Slot 0 is never handed out (see the module lesson): slots 1..capacity are.
        self.free_slots = torch.arange(1, capacity + 1, dtype=torch.int32, device=device)

    @property
    def available(self) -> int:
        return self.free_slots.numel()  # a shape, known on the host: no sync

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > self.available:
            return None
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return out

    def free(self, slots: torch.Tensor):
        self.free_slots = torch.cat([self.free_slots, slots.to(torch.int32)])
