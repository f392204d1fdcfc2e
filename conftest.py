"""Root pytest configuration, shared by tests/ and notebooks/ (nbval).

On a machine without a CUDA GPU the Triton kernels run in Triton's interpreter; the variable
must be set before any ``@triton.jit`` decorator runs, so it is set here, before collection,
and inherited by the notebook kernels nbval starts.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
