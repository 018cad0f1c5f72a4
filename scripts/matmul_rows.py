"""Does a row of a decode matmul depend on how many rows share the call? A CUDA graph pads a
batch to its captured size, so a request computed in a graph of 16 rows shares the matmul with
padding where, run eagerly, it would have shared it with 12 other requests. cuBLAS chooses its
kernel (tile shape, split-K) by the row count, and two kernels may round a row differently.
For each weight of one rank of Llama-3-8B (tp 1 and tp 2) this prints the row counts whose rows
differ from the same rows computed at their graph size. Usage: python scripts/matmul_rows.py"""

import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from nano.config import load_config  # noqa: E402
from nano.forward_batch import batch_bucket  # noqa: E402
from nano.cli import SHIPPED_CONFIGS  # noqa: E402
from nano.tp import shard_config  # noqa: E402

if __name__ == "__main__":
    torch.manual_seed(0)
    for tp in (1, 2):
        cfg = shard_config(load_config(SHIPPED_CONFIGS / "llama-3-8b"), tp)
        heads = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        weights = {"qkv_proj": (heads, cfg.hidden_size), "o_proj": (cfg.hidden_size, cfg.num_heads * cfg.head_dim),
                   "gate_up_proj": (2 * cfg.intermediate_size, cfg.hidden_size),
                   "down_proj": (cfg.hidden_size, cfg.intermediate_size), "lm_head": (cfg.vocab_size, cfg.hidden_size)}
        for name, (n_out, n_in) in weights.items():
            w = torch.randn(n_out, n_in, device="cuda", dtype=torch.bfloat16) * 0.02
            x = torch.randn(256, n_in, device="cuda", dtype=torch.bfloat16)
            differ = [m for m in range(1, 257)
                      if not torch.equal(F.linear(x[:m], w), F.linear(x[: batch_bucket(m)], w)[:m])]
            print(f"tp {tp} {name} [{n_out}, {n_in}]: rows differ from their graph size's at M = {differ or 'none'}")
