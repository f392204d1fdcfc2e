"""Root pytest configuration, shared by tests/ and notebooks/ (nbval).

On a machine without a CUDA GPU the Triton kernels run in Triton's interpreter; the variable
must be set before any ``@triton.jit`` decorator runs, so it is set here, before collection,
and inherited by the notebook kernels nbval starts. Tests use one intra-op thread on CPU: the
test shapes are tiny, CI has 2 cores, and multi-rank tests start several processes.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
