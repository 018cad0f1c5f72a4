"""A few eager launches for Nsight Compute (ncu) to profile: one of Llama-3-8B's decode-attention
layers on bench_attention.py's pool (every token in a random slot, or in order with `seq`), or
one of its matmuls at ROWS rows over three copies of the weight. ncu picks the launch:
    ncu --clock-control none --set full -k regex:_decode_split_kernel --launch-skip 3 --launch-count 1 \\
        python scripts/ncu_decode.py attention 160 136      # layer 1's short requests' launch
    ncu --clock-control none --set full -k regex:nvjet --launch-skip 1 --launch-count 1 \\
        python scripts/ncu_decode.py gate_up 160
Like attention_cases.py it uses the nano/ of the directory it runs in (BENCHMARKS.md, nineteenth
round). `--clock-control none` leaves the GPU's clocks as they run, rather than locking them for
the profile: a kernel is measured at the clocks a decode step sees."""

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.getcwd())
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from scripts.bench_attention import LLAMA_3_8B  # noqa: E402
from scripts.matmul_probe import LLAMA_SHAPES  # noqa: E402

from nano.config import parse_config  # noqa: E402
from nano.forward_batch import ForwardBatch  # noqa: E402
from nano.kv_cache import KVPool  # noqa: E402
from nano.triton_attn import TritonAttnBackend  # noqa: E402

LAYERS = 4


def attention(batch_size: int, context: int, in_order: bool):
    cfg = parse_config(dict(LLAMA_3_8B, num_hidden_layers=LAYERS))
    pool = KVPool(cfg, batch_size * context + 1, torch.bfloat16, "cuda", False)
    for buf in pool.k_buffers + pool.v_buffers:
        buf.normal_()
    order = torch.arange if in_order else torch.randperm
    slots = (order(batch_size * context, device="cuda") + 1).to(torch.int32).split([context] * batch_size)
    batch = ForwardBatch.decode([0] * batch_size, [context] * batch_size, list(range(batch_size)),
                                torch.stack([s[-1] for s in slots]), "cuda")
    backend = TritonAttnBackend(pool, torch.stack(slots), batch_size, cfg.num_heads)
    q = torch.randn(batch_size, cfg.num_heads, 128, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(batch_size, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    backend.init_forward_metadata(batch)
    for layer in range(LAYERS):
        backend.forward(q, k, v, layer, batch, 128 ** -0.5)


def main():
    what, size = sys.argv[1], int(sys.argv[2])
    if what == "attention":
        attention(size, int(sys.argv[3]), sys.argv[4:] == ["seq"])
    else:
        n, k = LLAMA_SHAPES[what]  # [out, in]
        x = torch.randn(size, k, dtype=torch.bfloat16, device="cuda")
        for weight in [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(3)]:
            F.linear(x, weight)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
