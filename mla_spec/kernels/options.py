"""Every switch of the kernels: environment variables read once, at first import, defaulting to the
measured configuration. Set one before importing ``mla_spec`` to compare against the alternative;
tests may assign the attribute (``options.PDL = False``).

| variable | attribute | default | what it turns on |
|---|---|---|---|
| ``MLA_SPEC_PDL`` | ``PDL`` | on | programmatic dependent launch on sm_90+ (``launch.pdl``) |
| ``MLA_SPEC_L2PF`` | ``L2_PREFETCH`` | on | attention: first KV tiles into L2 before the PDL wait |
| ``MLA_SPEC_EARLY_KV`` | ``EARLY_KV`` | off | wgmma attention: the first KV tile before the wait |
| ``MLA_SPEC_NVFP4_CUDA`` | ``NVFP4_CUDA`` | on | the ``mma.sync`` NVFP4 GEMM (pinned; 2-8 tokens) |
| ``MLA_SPEC_BF16_GEMV`` | ``BF16_GEMV`` | on | the BF16 GEMV on measured attention shapes |

``EARLY_KV`` is sound only under the contract of ``mla.sm90_wgmma.launch_wgmma_mla``.
"""

from mla_spec.device import env_flag

PDL = env_flag("MLA_SPEC_PDL", True)
L2_PREFETCH = env_flag("MLA_SPEC_L2PF", True)
EARLY_KV = env_flag("MLA_SPEC_EARLY_KV", False)
NVFP4_CUDA = env_flag("MLA_SPEC_NVFP4_CUDA", True)
BF16_GEMV = env_flag("MLA_SPEC_BF16_GEMV", True)
