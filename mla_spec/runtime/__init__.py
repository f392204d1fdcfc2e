"""The runtime layer: rank processes, their failure handling, plan transport and CUDA graphs.

Modules: ``workers`` (``spawn_workers``, ``Workers``, ``RankFailedError``), ``launch``,
``nccl_abort``, ``tp_worker`` (plans from rank 0 to ranks 1..N-1), ``cuda_graph``. Above the
models, below runner / scheduler / spec / engine; nothing here imports a model or the engine.
"""
