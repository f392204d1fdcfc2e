"""Linear layers for tensor parallelism: replicated, column-parallel, row-parallel.

Each keeps its weight whole (replicated) or as this rank's shard, BF16/FP32 or NVFP4 (ModelOpt's
four tensors, copied in unchanged by the loader), and declares ``tp_shard_dims`` so the loader
knows which dimension of each tensor is split:

======================  ====================  ======================  ============================
class                   weight (dense)        NVFP4 weight / scale    communication
======================  ====================  ======================  ============================
ReplicatedLinear        ``[out, in]``         ``[out, in/2]``, /16    none
ColumnParallelLinear    ``[out/tp, in]``      rows split              none (output stays split)
RowParallelLinear       ``[out, in/tp]``      K/2 and K/16 split      all-reduce (optional)
======================  ====================  ======================  ============================

A column-parallel layer followed by a row-parallel one needs exactly one all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn

from mla_spec.kernels.bf16_gemv import gemv_linear
from mla_spec.parallel import tp_all_reduce

__all__ = ["ReplicatedLinear", "ColumnParallelLinear", "RowParallelLinear"]


# ---------------------------------------------------------------------------------------------
class _TPLinear(nn.Module):
    """``y = x @ W^T (+ b)`` with W stored whole, or as one TP shard (``shard_dim``).

    BF16 / FP32: ``weight`` is an ``nn.Parameter`` ``[out_local, in_local]``.
    NVFP4 (``quantized=True``): buffers ``weight`` uint8 ``[out_local, in_local / 2]`` (low
    nibble = even element), ``weight_scale`` float8_e4m3fn ``[out_local, in_local / 16]``,
    ``weight_scale_2`` and ``input_scale`` fp32 scalars (the ModelOpt layout, so the loader
    copies checkpoint shards in unchanged). ``tp_shard_dims`` tells the loader which dimension of
    each tensor is split across ranks.
    """

    shard_dim: int | None = None

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False,
                 quantized: bool = False, tp_size: int = 1, dtype=torch.float32,
                 device=None, group_size: int = 16) -> None:
        super().__init__()
        split = (out_features, in_features)[self.shard_dim] if self.shard_dim is not None else 0
        if split % tp_size:
            raise ValueError(
                f"{type(self).__name__}: dimension {split} is not divisible by tp_size {tp_size}"
            )
        out_l = out_features // tp_size if self.shard_dim == 0 else out_features
        in_l = in_features // tp_size if self.shard_dim == 1 else in_features
        self.in_features, self.out_features, self.tp_size = in_l, out_l, tp_size
        self.quantized = quantized
        self.compute_dtype = dtype
        if quantized:
            if in_l % group_size:
                raise ValueError(
                    f"NVFP4 linear: local input size {in_l} must be a multiple of the group size "
                    f"{group_size} (in_features {in_features}, tp_size {tp_size})"
                )
            self.register_buffer("weight", torch.zeros(out_l, in_l // 2, dtype=torch.uint8,
                                                       device=device))
            self.register_buffer("weight_scale", torch.zeros(
                out_l, in_l // group_size, dtype=torch.float8_e4m3fn, device=device))
            self.register_buffer("weight_scale_2", torch.ones((), device=device))
            self.register_buffer("input_scale", torch.ones((), device=device))
        else:
            self.weight = nn.Parameter(torch.empty(out_l, in_l, dtype=dtype, device=device))
        self.bias = (
            nn.Parameter(torch.zeros(out_l, dtype=dtype, device=device)) if bias else None
        )
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
        from mla_spec.models.nvfp4_compat import dequantize_weight

        return dequantize_weight(self.weight, self.weight_scale, self.weight_scale_2, dtype)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized:
            from mla_spec.models.nvfp4_compat import nvfp4_linear

            return nvfp4_linear(x, self)
        return gemv_linear(x, self.weight)

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
    """Input features split across ranks; partial sums all-reduced when ``reduce_results``.

    The MoE sets ``reduce_results=False`` on its experts' and shared expert's ``down_proj`` and
    reduces their sum once.
    """

    shard_dim = 1

    def __init__(self, in_features, out_features, *, reduce_results: bool = True, **kw) -> None:
        super().__init__(in_features, out_features, **kw)
        self.reduce_results = reduce_results

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x)
        if self.reduce_results:
            y = tp_all_reduce(y, self.tp_size)
        return y if self.bias is None else y + self.bias
