"""CUDA graphs for decode: record each decode step's hundreds of kernel launches once, replay them.

At small batches a decode step is short on the GPU but long on the host: Python and the CUDA
driver spend a few microseconds launching each of several hundred kernels, and the GPU waits.
A CUDA graph records the launches once, with their arguments (pointers, grid sizes), and replays
the whole sequence with one call. The price: every replay reuses the same memory and the same
shapes. So the runner
- captures one graph per batch bucket (forward_batch.py: 1, 2, 4, 8, 16, 24, ... up to max_bs), largest
  first, all sharing one memory pool (the graphs never run at once, so they reuse each other's
  memory). What a graph records is the attention backend's per-pass metadata *and* the model:
  both run on the device only (the `AttentionBackend` contract);
- keeps static input buffers sized for max_bs (input_ids, positions, req_pool_indices, seq_lens,
  out_cache_loc); a replay copies the real batch into their first rows and pads the rest with
  harmless values: sequence length 1, KV written to the reserved slot 0;
- replays the graph of the real batch's bucket and slices the outputs back.
Nothing inside the captured forward may synchronise with the host or depend on tensor values for
a shape: the attention backend computes its per-batch metadata on the device for that reason.
Prefill (extend) and batches above the largest bucket within max_bs run eagerly (a limit of 20
captures 1..16), as in SGLang and vLLM, whose captured sizes also stop at their batch limit.
"""

import sys
import time

import torch

from nano.forward_batch import AttentionBackend, ForwardBatch, batch_bucket


class GraphCaptureError(RuntimeError):
    """Capture failed (out of memory); the message says which knob to turn."""


def capture_batch_sizes(max_bs: int) -> list[int]:
    """Every bucket up to max_bs."""
    return sorted({batch_bucket(bs) for bs in range(1, max_bs + 1) if batch_bucket(bs) <= max_bs})


class StaticDecodeInputs:
    """The decode inputs every graph reads: one buffer each, sized for the largest batch."""
    FIELDS = {"input_ids": torch.int64, "positions": torch.int64, "out_cache_loc": torch.int32,
              "req_pool_indices": torch.int32, "seq_lens": torch.int32}

    def __init__(self, max_bs: int, device):
        for name, dtype in self.FIELDS.items():  # as padding fills them (below)
            setattr(self, name, torch.full((max_bs,), int(name == "seq_lens"), dtype=dtype, device=device))

    def batch(self, bs: int) -> ForwardBatch:
        """A decode batch over the first bs rows of the buffers."""
        return ForwardBatch(is_decode=True, **{name: getattr(self, name)[:bs] for name in self.FIELDS})

    def fill(self, batch: ForwardBatch) -> int:
        """Copy the real batch into the first rows and pad it to its bucket -> the padded size.
        Padded rows are harmless: length 1, position 0, K/V written to the reserved slot 0."""
        bs, padded_bs = batch.batch_size, batch_bucket(batch.batch_size)
        for name in self.FIELDS:
            static = getattr(self, name)
            static[:bs].copy_(getattr(batch, name))
            static[bs:padded_bs] = 1 if name == "seq_lens" else 0
        return padded_bs


class CudaGraphRunner:
    def __init__(self, model, attn: AttentionBackend, max_bs: int, device, log: bool = True):
        self.model, self.attn = model, attn
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        self.inputs = StaticDecodeInputs(self.max_bs, device)
        self.graphs, self.logits = {}, {}
        self.capture(log)

    def capture(self, log: bool):
        started, free_before = time.perf_counter(), torch.cuda.mem_get_info()[0]
        pool = torch.cuda.graph_pool_handle()
        for i, bs in enumerate(reversed(self.batch_sizes)):
            if log:
                print(f"\rcapturing CUDA graphs: batch size {bs:4d} ({i + 1}/{len(self.batch_sizes)})",
                      end="", file=sys.stderr)
            batch = self.inputs.batch(bs)
            try:
                for _ in range(2):  # warm-up: compiles Triton kernels, settles the allocator
                    self.model(batch, self.attn)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.logits[bs] = self.model(batch, self.attn)
            except torch.cuda.OutOfMemoryError:
                raise GraphCaptureError(
                    f"out of GPU memory while capturing the CUDA graph for batch size {bs}: lower "
                    "--cuda-graph-max-bs or --mem-fraction, or pass --disable-cuda-graph") from None
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        if log:
            used = (free_before - torch.cuda.mem_get_info()[0]) / 2**30
            print(f"\rcaptured {len(self.batch_sizes)} CUDA graphs (batch 1..{self.max_bs}) in "
                  f"{time.perf_counter() - started:.1f} s, using {used:.2f} GiB", file=sys.stderr)

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.is_decode and batch.batch_size <= self.max_bs

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        padded_bs = self.inputs.fill(batch)
        self.graphs[padded_bs].replay()
        return self.logits[padded_bs][: batch.batch_size]
