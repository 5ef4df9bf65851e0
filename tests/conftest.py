"""Shared fixtures: every test starts with a fresh nxd_ckpt manager and no model-parallel configuration."""

from __future__ import annotations

import pytest

import nxd_ckpt


@pytest.fixture(autouse=True)
def _fresh_nxd_ckpt_state():
    nxd_ckpt.reset_manager()
    nxd_ckpt.destroy_model_parallel()
    yield
    nxd_ckpt.reset_manager()
    nxd_ckpt.destroy_model_parallel()
