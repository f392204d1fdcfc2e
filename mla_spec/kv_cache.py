"""The paged MLA latent KV cache, the request -> slot table, and the page tables backends need.

Each layer owns ``kv_buffer[layer] [num_pages, page_size, 576]``: one ``[ckv 512 | kpe 64]`` row
per token, the key (all 576 columns) and the value (the first 512). A token's slot is ``page *
page_size + offset``; ``ReqToTokenPool.req_to_token[req, pos]`` holds it. FP8: the row is stored
once as ``s = sat(x / k_scale)``; kernels fold the scales out: ``score = sm_scale * k_scale *
(q . s)``, ``out = v_scale * (softmax(score) @ s[:512])`` (non-FP8 pools read scale 1.0).
Page tables: ``block_tables`` (-1 fill) and FlashInfer's ``kv_indptr`` / ``kv_indices`` /
``kv_last_page_len``.
"""

import math
import re
from collections.abc import Mapping, Sequence
from itertools import accumulate

import torch

from mla_spec.kernels.ops import store_kv
from mla_spec.quant.fp8 import FP8_DTYPE

__all__ = ["KVCacheFullError", "PageAllocator", "ReqToTokenPool", "MLATokenToKVPool",
           "build_block_tables", "build_kv_indices", "assign_request_slots"]

_KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32, FP8_DTYPE)


class KVCacheFullError(RuntimeError):
    """Raised when the page allocator (or the request table) cannot satisfy a request."""


class PageAllocator:
    """Free list of page ids ``0 .. num_pages - 1`` (lowest ids first)."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages {num_pages}: must be >= 1")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        """``n`` page ids; raises :class:`KVCacheFullError` if fewer than ``n`` are free."""
        if n < 0:
            raise ValueError(f"alloc({n}): n must be >= 0")
        if n > len(self._free):
            raise KVCacheFullError(f"KV cache full: asked for {n} pages, {len(self._free)} of "
                                   f"{self.num_pages} free")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: Sequence[int]) -> None:
        for p in pages:
            p = int(p)
            if p not in self._used:
                raise ValueError(f"free({p}): page {p} is not allocated")
            self._used.remove(p)
            self._free.append(p)


class ReqToTokenPool:
    """``req_to_token [max_reqs, max_context_len]`` int32: slot of each position of a request."""

    def __init__(self, max_reqs: int, max_context_len: int, device=None):
        if max_reqs < 1 or max_context_len < 1:
            raise ValueError(f"max_reqs {max_reqs}, max_context_len {max_context_len}: "
                             "must be >= 1")
        self.max_reqs, self.max_context_len = max_reqs, max_context_len
        self.device = torch.device(device or "cpu")
        self.req_to_token = torch.zeros((max_reqs, max_context_len), dtype=torch.int32,
                                        device=self.device)
        self._free = list(range(max_reqs - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise KVCacheFullError(f"request table full: all {self.max_reqs} rows in use")
        return self._free.pop()

    def free(self, idx: int) -> None:
        idx = int(idx)
        if not 0 <= idx < self.max_reqs or idx in self._free:
            raise ValueError(f"free({idx}): row {idx} is not allocated")
        self._free.append(idx)


def _per_layer(name: str, value, num_layers: int) -> list[float]:
    vals = ([float(value)] * num_layers if isinstance(value, (int, float))
            else [float(v) for v in value])
    if len(vals) != num_layers:
        raise ValueError(f"{name} has {len(vals)} entries; the pool has {num_layers} layers")
    for v in vals:
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"{name} = {v}: must be positive and finite")
    return vals


class MLATokenToKVPool:
    """Per-layer paged latent KV rows (bf16, fp16, fp32 or e4m3); ``k_scale`` / ``v_scale``: one
    float, or one per layer (read by FP8 pools only)."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, dtype: torch.dtype,
                 device=None, k_scale: float | Sequence[float] = 1.0,
                 v_scale: float | Sequence[float] = 1.0, *, kv_lora_rank: int = 512,
                 qk_rope_head_dim: int = 64):
        if dtype not in _KV_DTYPES:
            raise ValueError(f"kv dtype {dtype}: supported {', '.join(map(str, _KV_DTYPES))}")
        if num_layers < 1 or num_pages < 1 or page_size < 1:
            raise ValueError("num_layers, num_pages and page_size must be >= 1")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.dtype = dtype
        self.device = torch.device(device or "cpu")
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.kv_cache_dim = kv_lora_rank + qk_rope_head_dim
        self.k_scales = _per_layer("k_scale", k_scale, num_layers)
        self.v_scales = _per_layer("v_scale", v_scale, num_layers)
        shape = (num_pages, page_size, self.kv_cache_dim)
        self.kv_buffer = [torch.zeros(shape, dtype=dtype, device=self.device)
                          for _ in range(num_layers)]

    @property
    def is_fp8(self) -> bool:
        return self.dtype == FP8_DTYPE

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def k_scale(self) -> float | list[float]:
        """The k scale (a float when every layer has the same, else the per-layer list)."""
        return self.k_scales[0] if len(set(self.k_scales)) == 1 else list(self.k_scales)

    @property
    def v_scale(self) -> float | list[float]:
        return self.v_scales[0] if len(set(self.v_scales)) == 1 else list(self.v_scales)

    def read_scales(self, layer_id: int) -> tuple[float, float]:
        """``(k_scale, v_scale)`` a kernel applies when reading ``layer_id`` (1.0 unless FP8)."""
        return (self.k_scales[layer_id], self.v_scales[layer_id]) if self.is_fp8 else (1.0, 1.0)

    def bytes_per_token(self) -> int:
        """KV bytes one token occupies across all layers."""
        return self.num_layers * self.kv_cache_dim * self.kv_buffer[0].element_size()

    def set_scales(self, layer_id: int, k_scale: float, v_scale: float | None = None) -> None:
        """Set one layer's scales (``v_scale`` defaults to ``k_scale``). Set before writing rows."""
        v_scale = k_scale if v_scale is None else v_scale
        self.k_scales[layer_id] = _per_layer("k_scale", [k_scale], 1)[0]
        self.v_scales[layer_id] = _per_layer("v_scale", [v_scale], 1)[0]

    def load_scales(self, tensors: Mapping[str, torch.Tensor | float],
                    layer_offset: int = 0) -> int:
        """Read ``...layers.{i}....k_scale`` / ``v_scale`` entries (checkpoint layer ``i`` is
        pool layer ``i - layer_offset``); return how many scales were set."""
        pat = re.compile(r"(?:^|\.)layers\.(\d+)\..*\b([kv])_scale$")
        n = 0
        for key, val in tensors.items():
            m = pat.search(key)
            if not m:
                continue
            layer = int(m.group(1)) - layer_offset
            if not 0 <= layer < self.num_layers:
                continue
            v = float(val.float().reshape(-1)[0]) if isinstance(val, torch.Tensor) else float(val)
            target = self.k_scales if m.group(2) == "k" else self.v_scales
            target[layer] = _per_layer(m.group(2) + "_scale", [v], 1)[0]
            n += 1
        return n

    def get_kv(self, layer_id: int) -> torch.Tensor:
        """``[num_pages, page_size, 576]`` buffer of ``layer_id`` (the stored dtype)."""
        return self.kv_buffer[layer_id]

    def store(self, layer_id: int, loc: torch.Tensor, ckv: torch.Tensor,
              kpe: torch.Tensor) -> None:
        """Write ``[ckv | kpe]`` rows (``[N, 512]``, ``[N, 64]``; a singleton head axis is
        accepted) at slots ``loc [N]`` (negative = skip); FP8 stores ``x / k_scale``."""
        if not 0 <= layer_id < self.num_layers:
            raise ValueError(f"layer_id {layer_id}: the pool has layers 0..{self.num_layers - 1}")
        if loc.numel() and (ckv.shape[-1] != self.kv_lora_rank
                            or kpe.shape[-1] != self.qk_rope_head_dim):
            raise ValueError(f"ckv {tuple(ckv.shape)} / kpe {tuple(kpe.shape)}: expected last dims "
                             f"{self.kv_lora_rank} / {self.qk_rope_head_dim}")
        flat = self.kv_buffer[layer_id].view(self.num_slots, self.kv_cache_dim)
        scale = self.k_scales[layer_id] if self.is_fp8 else 1.0
        store_kv(flat, loc.to(self.device), ckv, kpe, scale)

    def read_rows(self, layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized ``(K [n, 576], V [n, 512])`` rows at ``slots`` in fp32 (for references)."""
        flat = self.kv_buffer[layer_id].view(self.num_slots, self.kv_cache_dim)
        rows = flat.index_select(0, slots.to(self.device, torch.int64)).to(torch.float32)
        ks, vs = self.read_scales(layer_id)
        return rows * ks, rows[:, : self.kv_lora_rank] * vs


def assign_request_slots(req_to_token: torch.Tensor, req_idx: int, pages: Sequence[int],
                         page_size: int, start: int = 0, length: int | None = None) -> None:
    """Fill ``req_to_token[req_idx, start:start+length]`` with the slots of ``pages`` in order:
    position ``p`` maps to ``pages[p // page_size] * page_size + p % page_size``."""
    total = len(pages) * page_size
    length = total - start if length is None else length
    if start + length > total:
        raise ValueError(f"positions {start}..{start + length} need more than {len(pages)} pages")
    pos = torch.arange(start, start + length)
    pg = torch.tensor(list(pages), dtype=torch.int64)[pos // page_size] if length else pos
    req_to_token[req_idx, start : start + length] = (pg * page_size + pos % page_size).to(
        req_to_token.device, torch.int32)


def build_block_tables(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                       kv_lens: Sequence[int], page_size: int, *, pad_multiple: int = 1,
                       min_pages: int = 0) -> torch.Tensor:
    """``block_tables [bs, max_pages]`` int32: page id of each request's page, -1 beyond its end.
    ``max_pages = ceil(max(kv_lens) / page_size)``, at least ``min_pages``, rounded up to
    ``pad_multiple`` (TRT-LLM-gen: ``128 // page_size``). Slots must be page-aligned."""
    bs = len(kv_lens)
    pages = [-(-int(n) // page_size) for n in kv_lens]
    max_pages = max(max(pages, default=0), min_pages, 1)
    max_pages = -(-max_pages // pad_multiple) * pad_multiple
    dev = req_to_token.device
    table = torch.full((bs, max_pages), -1, dtype=torch.int32, device=dev)
    if bs == 0:
        return table
    cols = torch.arange(max_pages, device=dev) * page_size
    cols_c = cols.clamp(max=req_to_token.shape[1] - 1)
    rows = req_to_token[req_pool_indices.to(dev, torch.int64)][:, cols_c] // page_size
    valid = torch.arange(max_pages, device=dev)[None, :] < torch.tensor(pages, device=dev)[:, None]
    return torch.where(valid, rows.to(torch.int32), table)


def build_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     kv_lens: Sequence[int], page_size: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's paged form: ``kv_indptr [bs+1]``, ``kv_indices [total_pages]`` (page ids),
    ``kv_last_page_len [bs]`` (rows used in each request's last page; 0 for an empty request),
    all int32 on ``req_to_token``'s device."""
    dev = req_to_token.device
    pages = [-(-int(n) // page_size) for n in kv_lens]
    indptr = [0, *accumulate(pages)]
    table = build_block_tables(req_to_token, req_pool_indices, kv_lens, page_size)
    indices = table[table >= 0]
    last = [(int(n) - 1) % page_size + 1 if n else 0 for n in kv_lens]
    as_i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)
    return as_i32(indptr), indices.to(torch.int32), as_i32(last)
