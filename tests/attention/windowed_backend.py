"""A backend from outside the package, as a researcher writes one: sliding-window attention (each
query row sees only the last ``window`` of its causal KV positions), built on the torch oracle by
making every query row a one-row request over its own window of slots."""

from __future__ import annotations

import torch

from mla_spec import register_backend
from mla_spec.attention.base import write_output
from mla_spec.attention.torch_ref import TorchMLABackend, mla_attention_ref


@register_backend("windowed")
class WindowedBackend(TorchMLABackend):
    window = 8

    def __init__(self, *args, window: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.window = self.window if window is None else window

    def forward(self, q_nope, q_pe, layer_id, batch, *, out=None):
        plan = self.checked_plan(q_nope, q_pe, layer_id, batch)
        if plan is None:
            return self.empty_output(q_nope, out)
        slots, lens = [], []
        for r, ql, kl in zip(plan.req_pool_indices.tolist(), plan.seq_lens_q_cpu,
                             plan.kv_lens_cpu):
            for i in range(ql):
                end = kl - ql + i + 1  # row i's causal end
                start = max(0, end - self.window)
                slots.append(self.req_to_token[r, start:end])
                lens.append(end - start)
        table = torch.nn.utils.rnn.pad_sequence(slots, batch_first=True)
        pool = self.kv_pool
        kv = pool.get_kv(layer_id).view(pool.num_slots, pool.kv_cache_dim)
        res = mla_attention_ref(q_nope, q_pe, kv, table, range(len(lens)), [1] * len(lens), lens,
                                self.softmax_scale, *pool.read_scales(layer_id))
        return write_output(res, out)
