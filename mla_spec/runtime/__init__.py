"""The runtime layer: rank processes, their failure handling, plan transport and CUDA graphs.

==============  =================================================================================
module          what it holds
==============  =================================================================================
workers         ``spawn_workers`` (the caller is rank 0), ``Workers``, ``RankFailedError``
launch          ``launch(fn, world_size)``: every rank a child process, results returned
nccl_abort      unblock a rank stuck in an NCCL collective whose peer died
tp_worker       rank 0 sends step plans to ranks 1..N-1, which execute them (``serve_plans``)
cuda_graph      ``CudaGraphRunner``: captured fixed-shape forwards, ``attach_graphs``
==============  =================================================================================

It sits above the models (which only import :mod:`mla_spec.distributed` for their collectives)
and below the model runner, scheduler, speculative worker and engine, which use it. Nothing here
imports a model, a runner or the engine: what runs on a rank is passed in.
"""
