"""``mla_spec.device.env_flag``: the kernels' on / off switches read from the environment."""

from __future__ import annotations

import pytest

from mla_spec.device import env_flag


@pytest.mark.parametrize("value,want", [("0", False), ("", False), ("false", False),
                                        ("False", False), ("1", True), ("yes", True),
                                        ("true", True)])
def test_env_flag_values(monkeypatch, value, want):
    monkeypatch.setenv("MLA_SPEC_TEST_FLAG", value)
    assert env_flag("MLA_SPEC_TEST_FLAG", not want) is want


def test_env_flag_unset_gives_the_default(monkeypatch):
    monkeypatch.delenv("MLA_SPEC_TEST_FLAG", raising=False)
    assert env_flag("MLA_SPEC_TEST_FLAG", True) is True
    assert env_flag("MLA_SPEC_TEST_FLAG", False) is False
