"""The trtllm backend pads ragged draft-extend queries without zero-filling the padded rows: their
contents (stale rows, NaN bit patterns) must never reach a result, and the buffer is reused."""

from __future__ import annotations

import pytest
import torch

from mla_spec.attention import create_backend
from mla_spec.attention.synthetic import make_scene
from mla_spec.attention.trtllm_mla import reference_trtllm_kernel
from mla_spec.forward_mode import ForwardMode
from mla_spec.quant.fp8 import FP8_DTYPE


@pytest.mark.parametrize("kvd", [torch.bfloat16, FP8_DTYPE])
def test_padded_rows_never_reach_the_output(kvd):
    # irregular lengths: one request with a single row, max padding for the others
    sc = make_scene(ForwardMode.DRAFT_EXTEND, [0, 37, 5, 70], [1, 4, 2, 1], num_heads=3,
                    num_draft_tokens=4, kv_dtype=kvd, q_dtype=torch.bfloat16, page_size=32,
                    kv_lora_rank=32, qk_rope_head_dim=16, k_scale=0.5, v_scale=0.5)
    be = create_backend("trtllm", num_heads=3, softmax_scale=0.25, kv_pool=sc.pool,
                        req_to_token=sc.req_pool, kernel=reference_trtllm_kernel)
    be.plan(sc.batch)
    clean = be.forward(sc.q_nope, sc.q_pe, 0, sc.batch).clone()
    (buf,) = be._pad_buffers.values()
    assert buf.shape[:2] == (4, 4)
    if buf.dtype == torch.bfloat16:
        buf.fill_(float("nan"))  # every row, padded ones included
    else:
        buf.view(torch.uint8).fill_(0x7F)  # e4m3 NaN bits
    again = be.forward(sc.q_nope, sc.q_pe, 0, sc.batch)
    assert torch.equal(again, clean)
    assert len(be._pad_buffers) == 1  # reused, not reallocated per call
