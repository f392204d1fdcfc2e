"""Shared tiny checkpoints for the model tests (session-scoped: written once)."""

from __future__ import annotations

import pytest
import torch

from mla_spec.checkpoint_writer import random_state_dict, save_checkpoint, tiny_config


@pytest.fixture(scope="session")
def tiny_cfg():
    # mscale != mscale_all_dim so the YaRN cos/sin attention factor is not 1 (stricter than V3)
    return tiny_config(rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.8, "mscale_all_dim": 1.0})


@pytest.fixture(scope="session")
def tiny_sd(tiny_cfg):
    return random_state_dict(tiny_cfg, seed=1)


@pytest.fixture(scope="session")
def fp32_ckpt(tiny_cfg, tiny_sd, tmp_path_factory):
    return save_checkpoint(tiny_sd, tiny_cfg, tmp_path_factory.mktemp("ckpt") / "fp32",
                           quantize=False, dtype=torch.float32, shards=3)


@pytest.fixture(scope="session")
def fp4_ckpt(tiny_cfg, tiny_sd, tmp_path_factory):
    return save_checkpoint(tiny_sd, tiny_cfg, tmp_path_factory.mktemp("ckpt") / "fp4",
                           quantize=True, dtype=torch.float32, shards=2)
