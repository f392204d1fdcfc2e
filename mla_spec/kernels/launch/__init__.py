"""How the kernels launch: the CUDA driver (:mod:`.cuda_driver`), a cached Triton relaunch
(:mod:`.triton_launcher`), PDL (:mod:`.pdl`).
"""
