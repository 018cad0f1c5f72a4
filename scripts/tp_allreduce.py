"""What tensor parallelism's all-reduces cost a decode step: NCCL all-reduce latency between the
GPUs of this host, eager and replayed from a CUDA graph, at the sizes a decode step reduces
(one [batch, hidden] bf16 activation, twice per layer).
Usage: python scripts/tp_allreduce.py [N_GPUS]"""

import socket
import sys

import torch
import torch.distributed as dist

HIDDEN_SIZES = {"llama-3-8b": 4096, "deepseek-v2-lite": 2048, "llama-3-70b": 8192}
REDUCES_PER_GRAPH = 64  # Llama-3-8B: 32 layers x 2


def time_ms(fn, repeat=20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeat


def run(rank: int, size: int, port: int):
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            device_id=device)
    for shape, hidden in HIDDEN_SIZES.items():
        for bs in (1, 32):
            x = torch.randn(bs, hidden, dtype=torch.bfloat16, device=device)

            def reduce_all():
                for _ in range(REDUCES_PER_GRAPH):
                    dist.all_reduce(x)

            eager = time_ms(reduce_all) / REDUCES_PER_GRAPH
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                reduce_all()
            replayed = time_ms(graph.replay) / REDUCES_PER_GRAPH
            if rank == 0:
                print(f"{size} GPUs, {shape} activation [{bs}, {hidden}] bf16 ({x.nbytes / 1024:.0f} KiB): "
                      f"all-reduce {eager * 1e3:.1f} us eager, {replayed * 1e3:.1f} us in a CUDA graph")
    dist.destroy_process_group()


if __name__ == "__main__":
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(run, args=(size, port), nprocs=size)
