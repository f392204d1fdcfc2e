"""MLA attention over the paged latent cache: :func:`mla_decode` (gather kernel),
:func:`mla_decode_paged` (Hopper fast path) and their torch reference :func:`mla_decode_ref`.
"""

from mla_spec.kernels.mla.choice import (
    PAGED_CONTEXT_DEFAULTS,
    PAGED_DEFAULTS,
    PAGED_VARIANTS,
    VARIANTS,
    PagedConfig,
    context_class,
    paged_choice,
    paged_config,
    parse_choice,
    pick_num_splits,
    pick_num_splits_paged,
    shape_class,
    splits_for,
    variant_name,
)
from mla_spec.kernels.mla.combine import combine_splits
from mla_spec.kernels.mla.paged import mla_decode_paged, paged_supported
from mla_spec.kernels.mla.reference import combine_splits_ref, mla_decode_ref
from mla_spec.kernels.mla.triton_gather import MLAKernelConfig, default_config, mla_decode

__all__ = ["MLAKernelConfig", "PAGED_CONTEXT_DEFAULTS", "PAGED_DEFAULTS", "PAGED_VARIANTS",
           "PagedConfig", "VARIANTS", "combine_splits", "combine_splits_ref", "context_class",
           "default_config", "mla_decode", "mla_decode_paged", "mla_decode_ref",
           "paged_choice", "paged_config", "paged_supported", "parse_choice", "pick_num_splits",
           "pick_num_splits_paged", "shape_class", "splits_for", "variant_name"]
