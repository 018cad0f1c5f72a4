"""The ops the models and the sampler call, attention apart, and the one place that decides how each runs.

model.py, rope.py and deepseek.py call `ops.linear`, `ops.fused_add_rms_norm` (and `ops.rms_norm`,
the same with nothing to add), `ops.silu_and_mul` (and `ops.linear_silu_and_mul`, the two in a
row), `ops.apply_rope_` and `ops.route`, and sampling.py calls `ops.argmax`, without asking where
they run. Each has two implementations: the Triton kernel of the same name for CUDA tensors
(triton_ops.py, the router's moe_kernels.py, say what each gains: fewer launches, or faster reads
than torch's kernels), and the plain torch below for any other. The torch version is what a CPU run
computes and the truth the kernel tests compare against (`op.reference`). The device of the op's
first tensor decides, here for every op. triton is imported on the first call with a CUDA tensor: it
is not a runtime dependency (the CUDA build of torch brings its own), and a CPU run never imports
it. `kernels()` hands out the kernel modules the same way to code that runs a kernel itself: MoE's
"matvec" and "fused" forms (deepseek.py), which only a CUDA run picks.
"""

import functools
import importlib

import torch
import torch.nn.functional as F


def kernels(module: str = "triton_ops"):
    """nano.triton_ops or nano.moe_kernels, imported (and triton with it) on first use."""
    return importlib.import_module(f"nano.{module}")


def _triton_on_cuda(module: str = "triton_ops"):
    """Makes an op of the torch function below it (`reference`): `module`'s kernel of the same name
    runs when the op's first tensor is on CUDA, the reference otherwise."""

    def make_op(reference):
        @functools.wraps(reference)
        def op(x, *args, **kwargs):
            return (getattr(kernels(module), reference.__name__) if x.is_cuda else reference)(x, *args, **kwargs)

        op.reference = reference
        return op

    return make_op


@_triton_on_cuda()
def linear(x, weight, bias=None, split_k=False):
    """x [T, in] -> x weight^T + bias [T, out]. split_k: the caller hands the output to
    fused_add_rms_norm, so the kernel side may return partial products to add up there."""
    return F.linear(x, weight, bias)


@_triton_on_cuda()
def fused_add_rms_norm(x, residual, weight, eps):
    """residual += x, then normalise it -> (normed, residual); residual None: the stream starts at x.
    x may be partial products [S, T, hidden] (linear): their sum is added to the residual in float32,
    rounded once, as the kernel does."""
    if x.dim() == 3:
        residual = (x.float().sum(0) + residual).to(residual.dtype)
    else:
        residual = x if residual is None else x + residual
    return F.rms_norm(residual, weight.shape, weight, eps), residual


def rms_norm(x, weight, eps):
    """x [T, hidden] -> rms_norm(x) * weight, in x's dtype."""
    return fused_add_rms_norm(x, None, weight, eps)[0]


@_triton_on_cuda()
def silu_and_mul(gate_up):
    """gate_up [T, 2I] (gate in the first I columns, up in the rest) -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@_triton_on_cuda()
def linear_silu_and_mul(x, gate_up_weight):
    """x [T, in], gate_up_weight [2I, in] (gate rows, then up rows) -> silu_and_mul(linear) [T, I]."""
    return silu_and_mul.reference(linear.reference(x, gate_up_weight))


@_triton_on_cuda()
def apply_rope_(q, k, cos_sin, positions, q_out=None, norm=None):
    """Rotate q [T, H, d] and k [T, Hkv, d] in place by their tokens' positions [T] (rope.py); q
    into q_out instead when given. norm (x [T, width], weight [width], eps): also rms_norm x's rows
    in place (one launch for both on the GPU)."""
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, d/2] each
    for x, out in ((q, q if q_out is None else q_out), (k, k)):
        x1, x2 = x.float().chunk(2, dim=-1)
        out.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))
    if norm is not None:
        norm[0].copy_(fused_add_rms_norm.reference(norm[0], None, *norm[1:])[0])


@_triton_on_cuda()
def argmax(x):
    """x [B, V] -> the index of each row's largest value (the first of equal ones) [B], int64."""
    return x.argmax(dim=-1)


@_triton_on_cuda("moe_kernels")
def route(x, gate_weight, top_k, renormalize, routed_scaling, num_shared=0):
    """A MoE router: x [T, hidden] -> logits over E experts in float32 (as DeepSeek does: bf16
    rounding would flip the choice between close experts) -> softmax, the top k (weights float32,
    expert ids, best first), then DeepSeek-V2's rule: renormalise the chosen weights *or* scale
    them. The `num_shared` shared experts follow as experts E, E+1, ... of weight 1 -> [T, k + num_shared] each."""
    logits = F.linear(x.float(), gate_weight.float())  # [T, E]
    weights, ids = logits.softmax(dim=-1).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        weights = weights * routed_scaling
    shared = torch.arange(logits.shape[1], logits.shape[1] + num_shared, device=ids.device).expand(len(ids), -1)
    return torch.cat([weights, torch.ones_like(shared, dtype=weights.dtype)], dim=1), torch.cat([ids, shared], dim=1)
