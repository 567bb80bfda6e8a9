"""Tiny HF checkpoints for the engine's unit tests, written once per session."""

from __future__ import annotations

import pytest
import torch

from tests.unit.engine.hf_models import save_checkpoint

torch.set_num_threads(1)  # the CI machine is shared: OpenMP barriers under contention cost 25x


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """hf_checkpoint(arch) -> (checkpoint dir, HF model in float32)."""
    made = {}

    def get(arch: str):
        if arch not in made:
            path = tmp_path_factory.mktemp(f"ckpt-{arch}")
            made[arch] = (path, save_checkpoint(arch, path))
        return made[arch]

    return get
