"""How the kernels launch: the CUDA driver, a cached Triton relaunch, PDL."""
