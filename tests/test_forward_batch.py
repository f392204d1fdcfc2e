"""ForwardBatch builders: SGLang's seq_lens conventions per mode, derived fields, validation."""

import pytest
import torch

from mla_spec import CaptureHiddenMode, ForwardBatch, ForwardMode


def test_decode():
    b = ForwardBatch.decode([5, 1, 17])
    assert b.forward_mode is ForwardMode.DECODE and b.batch_size == 3
    assert b.seq_lens_cpu == [5, 1, 17] and b.kv_lens_cpu == [5, 1, 17]
    assert b.qo_indptr.tolist() == [0, 1, 2, 3]
    assert b.positions.tolist() == [4, 0, 16]
    assert b.max_seq_len_q == 1 and b.total_q == 3


def test_extend_with_prefix_and_empty_request():
    b = ForwardBatch.extend([0, 4, 2], [3, 0, 2])
    assert b.seq_lens_cpu == [3, 4, 4]
    assert b.cu_seqlens_q.tolist() == [0, 3, 3, 5]
    assert b.positions.tolist() == [0, 1, 2, 2, 3]
    assert b.extend_prefix_lens.tolist() == [0, 4, 2]
    assert b.extend_seq_lens.tolist() == [3, 0, 2]
    assert ForwardBatch.extend([1], [2], mixed=True).forward_mode is ForwardMode.MIXED


def test_target_verify_seq_lens_exclude_drafts():
    b = ForwardBatch.target_verify([7, 3], num_draft_tokens=4)
    assert b.seq_lens_cpu == [7, 3]  # SGLang: prefix only
    assert b.kv_lens_cpu == [11, 7]  # what attention sees
    assert b.positions.tolist() == [7, 8, 9, 10, 3, 4, 5, 6]
    assert b.capture_hidden_mode is CaptureHiddenMode.FULL


def test_draft_extend_v1_ragged():
    b = ForwardBatch.draft_extend([9, 4, 6], [1, 4, 2], num_draft_tokens=4)
    assert b.seq_lens_q_cpu == [1, 4, 2] and b.max_seq_len_q == 4 and b.total_q == 7
    assert b.cu_seqlens_q.tolist() == [0, 1, 5, 7]
    assert b.kv_lens_cpu == [9, 4, 6]
    assert b.positions.tolist() == [8, 0, 1, 2, 3, 4, 5]
    assert b.accept_length.tolist() == [1, 4, 2]
    assert b.select_last_rows().tolist() == [0, 4, 6]


def test_draft_extend_v2_fixed_shape():
    b = ForwardBatch.draft_extend_v2([9, 4], num_draft_tokens=4, accept_lengths=[2, 4])
    assert b.seq_lens_cpu == [13, 8]  # SGLang adds num_draft_tokens
    assert b.seq_lens_q_cpu == [4, 4] and b.kv_lens_cpu == [13, 8]
    assert b.positions.tolist() == [9, 10, 11, 12, 4, 5, 6, 7]
    assert b.select_last_rows().tolist() == [1, 7]  # row accept_length - 1


def test_idle():
    b = ForwardBatch.idle()
    assert b.batch_size == 0 and b.total_q == 0 and b.qo_indptr.tolist() == [0]
    assert b.forward_mode.is_idle()


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: ForwardBatch.decode([3, -1]), r"seq_lens\[1\] = -1"),
        (lambda: ForwardBatch.decode([0]), r"seq_lens\[0\] = 0"),
        (lambda: ForwardBatch.decode([]), "at least one request"),
        (lambda: ForwardBatch.extend([1, 2], [3]), "one per request"),
        (lambda: ForwardBatch.extend([1], [0]), "at least one query row"),
        (lambda: ForwardBatch.target_verify([3], 0), "num_draft_tokens"),
        (lambda: ForwardBatch.draft_extend([5, 5], [0, 2], 4), "bonus token"),
        (lambda: ForwardBatch.draft_extend([5, 5], [1, 5], 4), r"1\.\.num_draft_tokens"),
        (lambda: ForwardBatch.draft_extend([1], [2], 4), "already includes"),
        (lambda: ForwardBatch.draft_extend([5], [1, 2], 4), "2 entries"),
        (lambda: ForwardBatch.draft_extend_v2([5], 4, [5]), "accept_lengths"),
        (lambda: ForwardBatch.decode([3], req_pool_indices=[0, 1]), "req_pool_indices"),
    ],
)
def test_validation(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_out_cache_loc_and_to():
    loc = torch.arange(10, 13)
    b = ForwardBatch.decode([4, 2, 8], out_cache_loc=loc, req_pool_indices=[2, 0, 1])
    assert b.out_cache_loc.tolist() == [10, 11, 12]
    c = b.to("cpu")
    assert c.req_pool_indices.tolist() == [2, 0, 1] and c.forward_mode is ForwardMode.DECODE
    with pytest.raises(ValueError, match="query rows"):
        ForwardBatch.decode([4], out_cache_loc=torch.arange(2))


def test_draft_extend_capacity_layout():
    """Spec v1's draft extend at its capacity (the round graph's static batch): bs requests of
    ndt rows, then bs padding requests of none on the scratch row 0."""
    b = ForwardBatch.draft_extend_capacity([9, 5, 7], 4, req_pool_indices=[3, 1, 2])
    assert b.forward_mode == ForwardMode.DRAFT_EXTEND and b.batch_size == 6 and b.total_q == 12
    assert b.qo_indptr.tolist() == [0, 4, 8, 12, 12, 12, 12]
    assert b.req_pool_indices.tolist() == [3, 1, 2, 0, 0, 0]
    assert b.positions[:4].tolist() == [5, 6, 7, 8] and b.kv_lens_cpu == [9, 5, 7, 0, 0, 0]
    with pytest.raises(ValueError, match="must be >= 4"):
        ForwardBatch.draft_extend_capacity([3], 4, req_pool_indices=[1])
