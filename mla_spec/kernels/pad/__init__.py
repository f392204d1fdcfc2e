"""Draft-extend pad / unpad for the fixed-q_len MLA kernels (``draft_extend``)."""

from mla_spec.kernels.pad.draft_extend import (
    compile_count,
    pad_draft_extend_query,
    pad_draft_extend_query_ref,
    unpad_draft_extend_output,
    unpad_draft_extend_output_ref,
)

__all__ = ["pad_draft_extend_query", "unpad_draft_extend_output", "pad_draft_extend_query_ref",
           "unpad_draft_extend_output_ref", "compile_count"]
