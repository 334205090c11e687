"""Tests for runner.training.data: seeds, determinism switches, worker seeds and RNG state round trips."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from runner.training.data import (
    CUBLAS_WORKSPACE_CONFIG,
    capture_rng_state,
    loader_generator,
    restore_rng_state,
    seed_everything,
    worker_init_fn,
)


@pytest.fixture(autouse=True)
def restore_global_settings(monkeypatch):
    """Undo process-wide switches that seed_everything(deterministic=True) flips."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    det = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(det)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn


def draw() -> tuple[float, float, torch.Tensor]:
    return random.random(), float(np.random.rand()), torch.rand(3)


def test_same_seed_same_numbers_different_seed_different():
    assert seed_everything(5) == {}  # no deterministic setting asked for: none set
    a = draw()
    seed_everything(5)  # every rank seeds alike: identical model init
    b = draw()
    seed_everything(6)
    c = draw()
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])
    assert a[0] != c[0] and a[1] != c[1] and not torch.equal(a[2], c[2])


def test_deterministic_mode_sets_and_reports_settings():
    settings = seed_everything(0, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic is True and torch.backends.cudnn.benchmark is False
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE_CONFIG
    assert settings == {
        "env.CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "torch.use_deterministic_algorithms": "True",
        "torch.backends.cudnn.deterministic": "True",
        "torch.backends.cudnn.benchmark": "False",
    }
    seed_everything(0, deterministic=False)
    assert not torch.are_deterministic_algorithms_enabled()


def test_loader_generator_differs_per_rank_and_epoch():
    def first(seed: int, rank: int, epoch: int = 0) -> int:
        return int(torch.randint(0, 2**62, (1,), generator=loader_generator(seed, rank, epoch)))

    assert first(0, 0) == first(0, 0)
    assert len({first(0, 0), first(0, 1), first(1, 0), first(0, 0, 1)}) == 4


class RandomDraws(Dataset):
    """Each item reports the Python, NumPy and torch random numbers drawn in the worker."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([random.random(), np.random.rand(), torch.rand(()).item()], dtype=torch.float64)


def worker_draws(seed: int, rank: int) -> torch.Tensor:
    loader = DataLoader(
        RandomDraws(),
        batch_size=1,
        num_workers=2,
        worker_init_fn=worker_init_fn,
        generator=loader_generator(seed, rank),
    )
    return torch.cat(list(loader))


def test_worker_seeds_are_reproducible_and_differ_per_worker_and_rank():
    a, b, other_rank = worker_draws(0, 0), worker_draws(0, 0), worker_draws(0, 1)
    assert torch.equal(a, b)
    # items 0 and 1 are the first draws of workers 0 and 1: every source differs between them
    assert (a[0] != a[1]).all()
    assert (a != other_rank).all()


def test_capture_restore_round_trip_through_torch_save(tmp_path):
    seed_everything(3)
    draw()
    state = capture_rng_state()
    expected = draw()
    path = tmp_path / "rng.pt"
    torch.save(state, path)
    seed_everything(99)
    restore_rng_state(torch.load(path, weights_only=True))
    got = draw()
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])
    restore_rng_state(state)  # the in-memory state works too, and is not consumed
    again = draw()
    assert again[0] == expected[0] and torch.equal(again[2], expected[2])


def test_restore_keeps_numpy_gaussian_cache():
    np.random.seed(1)
    np.random.standard_normal()  # leaves a cached second Gaussian
    state = capture_rng_state()
    expected = np.random.standard_normal()
    np.random.seed(2)
    restore_rng_state(state)
    assert np.random.standard_normal() == expected
