"""Test set-up. Without a GPU, Triton kernels run in its interpreter on CPU tensors; that switch
must be set before anything imports triton, which is why it lives here."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
