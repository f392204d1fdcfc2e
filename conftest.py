"""Root pytest configuration, shared by tests/ and notebooks/ (nbval).

On a machine without a CUDA GPU, ``import mla_spec`` switches Triton to its CPU interpreter by
itself but keeps the torch twins in the dispatching entry points (``mla_spec.device``). The tests
want the Triton kernels themselves on CPU, so this file asks for them before anything imports
mla_spec: ``TRITON_INTERPRET=1`` (read when ``@triton.jit`` runs) and ``MLA_SPEC_TRITON_ON_CPU=1``
(read at each dispatch). The notebook kernels nbval starts inherit both. A value already in the
environment wins. Tests use one intra-op thread on CPU: the test shapes are tiny, CI has 2 cores,
and multi-rank tests start several processes.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("MLA_SPEC_TRITON_ON_CPU", "1")
    torch.set_num_threads(1)
