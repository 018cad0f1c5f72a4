"""How far the GPU's bfloat16 logits are from HF's float32 ones, per tiny Llama variant: the setup
of tests/test_llama_parity.py::test_bfloat16_on_gpu_matches_hf_float32, printing each variant's
worst and mean relative error in norm over the steps, where the test only holds them to a bound.
TREE is the folder whose nano/ runs (`.` for this checkout, or a copy of another commit's); DEVICE
cpu runs torch's bfloat16 path instead.
Usage: python scripts/parity_errors.py TREE [DEVICE]"""

import pathlib
import sys
import tempfile

sys.path[:0] = [sys.argv[1], str(pathlib.Path(__file__).resolve().parents[1])]
import torch  # noqa: E402

from nano import engine as engine_module  # noqa: E402
from nano.engine import Engine, EngineConfig  # noqa: E402
from nano.sampling import SamplingParams  # noqa: E402
from tests.helpers import LLAMA_TINY, LLAMA_VARIANTS, random_prompts, save_tiny_llama  # noqa: E402


def step_errors(variant: str, device: str) -> list[float]:
    path = pathlib.Path(tempfile.mkdtemp())
    hf_model = save_tiny_llama(path, variant)
    steps, real_sample = [], engine_module.sample
    engine_module.sample = lambda logits, *rest: (steps.append(logits.float().cpu()), real_sample(logits, *rest))[1]
    prompts = random_prompts([5, 17, 1, 60], LLAMA_TINY["vocab_size"])
    engine = Engine(path, EngineConfig(device=device, dtype=torch.bfloat16, max_total_tokens=512, log=False))
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
    engine_module.sample = real_sample
    errors = []
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        with torch.no_grad():
            ref = hf_model(torch.tensor([prompt + out])).logits[0]
        for k in range(len(out)):
            expected = ref[len(prompt) - 1 + k]
            errors.append(((steps[k][i] - expected).norm() / expected.norm()).item())
    return errors


def main():
    print("nano from", engine_module.__file__)
    for variant in LLAMA_VARIANTS:
        errors = step_errors(variant, sys.argv[2] if len(sys.argv) > 2 else "cuda")
        print(f"{variant:20s} worst {max(errors):.4f} mean {sum(errors) / len(errors):.4f}", flush=True)


if __name__ == "__main__":
    main()
