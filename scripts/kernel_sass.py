"""Decode stage 1 (triton_attn._decode_split_kernel) compiled for an H100/H200 (sm90) on any machine,
a CPU one too: no GPU is needed to compile, only to run. Prints what the compiled kernel asks of a
multiprocessor (registers, shared memory), its length in instructions, and every cp.async
instruction and wait in it. Inside the token loop, `DEPBAR.LE SB0, N` waits until at most N groups
of copies are still in flight: N = 0 there means each tile waits for every copy issued before it,
the next tile's too (BENCHMARKS.md, nineteenth round). Llama-3-8B's shape, bf16, one split:
    python scripts/kernel_sass.py [BLOCK_N WARPS STAGES]     # default: triton_attn.SHORT_TILE"""

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, ".")
import nano.triton_attn as triton_attn  # noqa: E402

POINTERS = {"q": "*bf16", "k_cache": "*bf16", "v_cache": "*bf16", "partial_out": "*fp32", "partial_lse": "*fp32",
            "out": "*bf16", "req_to_token": "*i32", "req_pool_indices": "*i32", "seq_lens": "*i32",
            "num_kv_splits": "*i32"}


def compile_stage1(block_n: int, num_warps: int, num_stages: int):
    """The kernel as a launch at batch 160 would specialise it: pointers and strides divisible by 16."""
    fn = triton_attn._decode_split_kernel
    constants = dict(GROUP=4, BLOCK_H=16, BLOCK_N=block_n, K_MAIN=128, K_ROPE=0, BLOCK_DR=0, V_DIM=128,
                     BLOCK_DV=128, DOT_PRECISION="tf32", ONE_SPLIT=True)
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        signature[name] = ("constexpr" if name in constants else POINTERS.get(name)
                           or ("fp32" if name == "scale_log2" else "i32"))
        if name in POINTERS or (name.startswith("stride") and name != "stride_req"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def main():
    tile = tuple(int(a) for a in sys.argv[1:4]) or triton_attn.SHORT_TILE
    kernel = compile_stage1(*tile)
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([f"{tools}/nvdisasm", "-c", cubin.name], capture_output=True, text=True).stdout
        usage = subprocess.run([f"{tools}/cuobjdump", "--dump-resource-usage", cubin.name],
                               capture_output=True, text=True).stdout
    lines = [line.strip() for line in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", line)]
    registers = re.search(r"REG:(\d+)", usage).group(1)
    print(f"tile {tile}: {registers} registers a thread, {kernel.metadata.shared} bytes of shared memory, "
          f"{len(lines)} instructions")
    for line in lines:
        if re.search(r"DEPBAR|LDGSTS|BRA|EXIT", line):
            print("   ", line)


if __name__ == "__main__":
    main()
