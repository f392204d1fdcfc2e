"""How the package's kernels are launched: the CUDA driver for the ``csrc/`` kernels
(:mod:`.cuda_driver`), a cached direct relaunch of compiled Triton kernels
(:mod:`.triton_launcher`), programmatic dependent launch (:mod:`.pdl`) and the arrival counters of
kernels whose last CTA finishes a piece of work (:mod:`.arrival`)."""
