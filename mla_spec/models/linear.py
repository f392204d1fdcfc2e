"""The model's linear layers: replicated, column-parallel, row-parallel; dense or NVFP4.

Each holds its weight whole or as this rank's shard (dense, or ModelOpt's four NVFP4 tensors)
and declares ``tp_shard_dims`` for the loader. Column-parallel splits the output (no
communication), row-parallel the input (an all-reduce). :func:`nvfp4_linear` is the one NVFP4
matmul: the W4A16 kernel on CUDA; on CPU ``F.linear`` on a dequantized weight cached on the
layer and keyed on its buffers' identity, storage and version, so any write invalidates it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mla_spec.distributed import tp_all_reduce
from mla_spec.kernels.nvfp4 import nvfp4_gemm
from mla_spec.kernels.ops import gemv_linear
from mla_spec.models.batch_invariant import per_row
from mla_spec.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4

__all__ = ["ReplicatedLinear", "ColumnParallelLinear", "RowParallelLinear", "NVFP4Linear",
           "cached_dense_weight", "dequantize_weight", "nvfp4_linear", "quantize_weight"]


class _TPLinear(nn.Module):
    """``y = x @ W^T (+ b)`` with W stored whole, or as one TP shard (``shard_dim``); dense
    ``weight [out_local, in_local]`` or NVFP4 buffers in ModelOpt's layout (``quant.nvfp4``)."""

    shard_dim: int | None = None

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False,
                 quantized: bool = False, tp_size: int = 1, dtype=torch.float32,
                 device=None, group_size: int = 16) -> None:
        super().__init__()
        split = (out_features, in_features)[self.shard_dim] if self.shard_dim is not None else 0
        if split % tp_size:
            raise ValueError(f"{type(self).__name__}: dimension {split} is not divisible by "
                             f"tp_size {tp_size}")
        out_l = out_features // tp_size if self.shard_dim == 0 else out_features
        in_l = in_features // tp_size if self.shard_dim == 1 else in_features
        self.in_features, self.out_features, self.tp_size = in_l, out_l, tp_size
        self.quantized = quantized
        self.compute_dtype = dtype
        if quantized:
            if in_l % group_size:
                raise ValueError(f"NVFP4 linear: local input size {in_l} must be a multiple of the "
                                 f"group size {group_size} (in_features {in_features}, tp_size "
                                 f"{tp_size})")
            self.register_buffer("weight", torch.zeros(out_l, in_l // 2, dtype=torch.uint8,
                                                       device=device))
            self.register_buffer("weight_scale", torch.zeros(
                out_l, in_l // group_size, dtype=torch.float8_e4m3fn, device=device))
            self.register_buffer("weight_scale_2", torch.ones((), device=device))
            self.register_buffer("input_scale", torch.ones((), device=device))
        else:
            self.weight = nn.Parameter(torch.empty(out_l, in_l, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(out_l, dtype=dtype, device=device)) if bias else None
        dims = {} if self.shard_dim is None else {"weight": self.shard_dim}
        if quantized and self.shard_dim is not None:
            dims["weight_scale"] = self.shard_dim
        if bias and self.shard_dim == 0:
            dims["bias"] = 0
        self.tp_shard_dims = dims

    def dense_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The local weight ``[out_local, in_local]`` (dequantized when NVFP4)."""
        dtype = dtype or self.compute_dtype
        if not self.quantized:
            return self.weight if self.weight.dtype == dtype else self.weight.to(dtype)
        return dequantize_weight(self.weight, self.weight_scale, self.weight_scale_2, dtype)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized:
            return per_row(lambda r: nvfp4_linear(r, self), x)
        return per_row(lambda r: gemv_linear(r, self.weight), x)

    def extra_repr(self) -> str:
        q = ", nvfp4" if self.quantized else ""
        return f"in={self.in_features}, out={self.out_features}, tp={self.tp_size}{q}"


class ReplicatedLinear(_TPLinear):
    """Every rank holds the whole weight (``q_a_proj``, ``kv_a_proj_with_mqa``, ``eh_proj``)."""

    shard_dim = None

    def __init__(self, in_features, out_features, **kw) -> None:
        kw.pop("tp_size", None)
        super().__init__(in_features, out_features, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x)
        return y if self.bias is None else y + self.bias


class ColumnParallelLinear(_TPLinear):
    """Output features split across ranks: rank r owns rows ``[r*out/tp, (r+1)*out/tp)``."""

    shard_dim = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x)
        return y if self.bias is None else y + self.bias


class RowParallelLinear(_TPLinear):
    """Input features split across ranks; partial sums all-reduced when ``reduce_results``
    (the MoE turns it off on its ``down_proj``s and reduces their sum once)."""

    shard_dim = 1

    def __init__(self, in_features, out_features, *, reduce_results: bool = True, **kw) -> None:
        super().__init__(in_features, out_features, **kw)
        self.reduce_results = reduce_results

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x)
        if self.reduce_results:
            y = tp_all_reduce(y, self.tp_size)
        return y if self.bias is None else y + self.bias


class NVFP4Linear(ReplicatedLinear):
    """A whole (replicated) linear whose weight is NVFP4: ``y = x @ dequant(W)^T (+ bias)``. The
    buffers carry the checkpoint's names, so ``load_state_dict`` on an NVIDIA FP4 shard fills them
    unchanged (``[1]`` scalars load too). ``dtype``: of the bias and :meth:`dense_weight`."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False,
                 dtype=torch.float32, device=None) -> None:
        super().__init__(in_features, out_features, bias=bias, quantized=True, dtype=dtype,
                         device=device)

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None,
                   input_amax: float | None = None) -> NVFP4Linear:
        """Quantize a float weight ``[out, in]`` (ModelOpt conventions) into a new layer."""
        dtype = w.dtype if w.is_floating_point() else torch.float32
        mod = cls(w.shape[1], w.shape[0], bias=bias is not None, dtype=dtype, device=w.device)
        for name, t in quantize_weight(w, input_amax).items():
            getattr(mod, name).copy_(t)
        if bias is not None:
            mod.bias.data.copy_(bias)
        return mod

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name in ("weight_scale_2", "input_scale"):  # checkpoints store [] or [1]
            t = state_dict.get(prefix + name)
            if t is not None and t.numel() == 1:
                state_dict[prefix + name] = t.reshape(())
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"NVFP4Linear: x must be [..., {self.in_features}], "
                             f"got {tuple(x.shape)}")
        return super().forward(x)


_CACHE_ATTR = "_nvfp4_dense_cache"  # (key, dense weight) in the layer's __dict__
_NAMES = ("weight", "weight_scale", "weight_scale_2")


def dequantize_weight(weight: torch.Tensor, weight_scale: torch.Tensor,
                      weight_scale_2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[N, K]`` dense weight in ``dtype`` from uint8 ``[N, K/2]`` + e4m3 ``[N, K/16]`` + fp32."""
    return dequantize_nvfp4(weight, weight_scale, weight_scale_2.float(), dtype)


def _cache_key(lin, dtype: torch.dtype) -> tuple | None:
    """What the dense weight depends on; None when it cannot be tracked (inference tensors)."""
    try:
        return (dtype, *((id(t), t.data_ptr(), t._version)
                         for t in (getattr(lin, n) for n in _NAMES)))
    except RuntimeError:  # tensors made under torch.inference_mode() have no version counter
        return None


def cached_dense_weight(lin, dtype: torch.dtype) -> torch.Tensor:
    """The dequantized weight ``[out, in]`` of an NVFP4 layer ``lin`` in ``dtype``, cached on it
    (one dtype a layer) until a buffer is replaced or written in place. Read-only: it is shared.
    """
    key = _cache_key(lin, dtype)
    hit = lin.__dict__.get(_CACHE_ATTR)
    if key is not None and hit is not None and hit[0] == key:
        return hit[1]
    w = dequantize_weight(lin.weight, lin.weight_scale, lin.weight_scale_2, dtype)
    if key is not None:
        lin.__dict__[_CACHE_ATTR] = (key, w)
    return w


def nvfp4_linear(x: torch.Tensor, lin) -> torch.Tensor:
    """``x [..., K] @ dequant(W)^T -> [..., N]`` in ``x``'s dtype for an NVFP4 linear ``lin``:
    the W4A16 GEMM on CUDA, the cached dense weight and ``F.linear`` on CPU."""
    if x.is_cuda and not (torch.is_grad_enabled() and x.requires_grad):
        return nvfp4_gemm(x, lin.weight, lin.weight_scale, lin.weight_scale_2.reshape(()))
    if x.is_cuda:  # autograd on a GPU: dequantize per call, keep no dense copy in GPU memory
        return F.linear(x, dequantize_weight(lin.weight, lin.weight_scale, lin.weight_scale_2,
                                             x.dtype))
    return F.linear(x, cached_dense_weight(lin, x.dtype))


def quantize_weight(w: torch.Tensor, input_amax: float | None = None) -> dict[str, torch.Tensor]:
    """Quantize ``w [N, K]`` to the four checkpoint tensors (``input_scale`` from ``input_amax``,
    default 1.0 * 2688 so that ``input_scale`` = 1.0: the W4A16 path never reads it)."""
    q = quantize_nvfp4(w.float(), input_amax=2688.0 if input_amax is None else input_amax)
    return {"weight": q.weight, "weight_scale": q.weight_scale,
            "weight_scale_2": q.weight_scale_2.reshape(()).float(),
            "input_scale": q.input_scale.reshape(()).float()}
