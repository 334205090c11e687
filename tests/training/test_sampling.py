"""Tests for runner.training.sampling: epoch permutation, rank shares, step layout with grad accumulation."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from runner.training.sampling import (
    EpochSampler,
    EvalSampler,
    epoch_permutation,
    global_batch_sizes,
    micro_batch_sizes,
    rank_batch_size,
)


def samplers(
    n: int, world: int, batch: int, *, seed: int = 0, shuffle: bool = True, drop_last: bool = False
) -> list[EpochSampler]:
    return [EpochSampler(n, world, r, seed, shuffle, batch, drop_last) for r in range(world)]


@pytest.mark.parametrize(
    ("n", "batch", "drop_last", "world", "expected"),
    [
        (40, 8, False, 1, [8] * 5),
        (43, 12, False, 1, [12, 12, 12, 7]),
        (43, 12, True, 1, [12, 12, 12]),
        (38, 12, False, 3, [12, 12, 12]),  # final batch of 2 < world 3: dropped
        (39, 12, False, 3, [12, 12, 12, 3]),
        (5, 8, False, 2, [5]),
        (5, 8, True, 2, []),
    ],
)
def test_global_batch_sizes(n, batch, drop_last, world, expected):
    assert global_batch_sizes(n, batch, drop_last, world) == expected


def test_rank_batch_sizes_sum_to_global_and_differ_by_at_most_one():
    for world in (1, 2, 3, 4):
        for size in range(world, 20):
            shares = [rank_batch_size(size, world, r) for r in range(world)]
            assert sum(shares) == size
            assert max(shares) - min(shares) <= 1


def test_micro_batch_sizes():
    assert micro_batch_sizes(12, 2, 0, 3) == [3, 3]
    assert micro_batch_sizes(7, 2, 0, 3) == [3, 1]  # rank 0 gets 4 of 7
    assert micro_batch_sizes(7, 2, 1, 3) == [3]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_are_disjoint_and_cover_the_used_samples(world, drop_last):
    n, batch = 53, 12
    ss = samplers(n, world, batch, seed=3, drop_last=drop_last)
    lists = [list(s) for s in ss]
    flat = [i for lst in lists for i in lst]
    assert len(flat) == len(set(flat)), "duplicates across or within ranks"
    used = sum(global_batch_sizes(n, batch, drop_last, world))
    assert len(flat) == used
    assert [len(s) for s in ss] == [len(lst) for lst in lists]
    if not drop_last and (n % batch == 0 or n % batch >= world):
        assert sorted(flat) == list(range(n))


def test_order_differs_between_epochs_and_is_reproducible():
    s = EpochSampler(100, 2, 1, seed=7, shuffle=True, global_batch=10, drop_last=False)
    s.set_epoch(0)
    e0 = list(s)
    s.set_epoch(1)
    e1 = list(s)
    assert e0 != e1 and len(e0) == len(e1) == 50
    s.set_epoch(0)
    assert list(s) == e0
    other = EpochSampler(100, 2, 1, seed=7, shuffle=True, global_batch=10, drop_last=False)
    assert list(other) == e0


def test_no_shuffle_is_natural_order():
    s = EpochSampler(10, 2, 1, seed=0, shuffle=False, global_batch=4, drop_last=False)
    assert list(s) == [1, 3, 5, 7, 9]
    assert epoch_permutation(5, 0, 3, shuffle=False) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("batch", [8, 12])
@pytest.mark.parametrize("seed", [0, 5])
def test_equals_distributed_sampler_when_n_divisible_by_world(world, batch, seed):
    n = 40
    dataset = list(range(n))
    for rank in range(world):
        ours = EpochSampler(n, world, rank, seed, True, batch, False)
        theirs = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed)
        for epoch in (0, 1, 2):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)
            assert len(ours) == len(theirs)


def steps_of(loader: DataLoader, sizes: list[int], world: int, rank: int) -> list[list[int]]:
    """Group a rank's micro-batches into optimizer steps, exactly as the training loop does."""
    it = iter(loader)
    steps = []
    for size in sizes:
        share, got = rank_batch_size(size, world, rank), []
        while len(got) < share:
            got += next(it)[0].tolist()
        assert len(got) == share
        steps.append(got)
    assert next(it, None) is None, "loader has batches beyond the last step"
    return steps


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize(("n", "drop_last"), [(43, False), (43, True), (38, False), (50, False)])
def test_union_over_ranks_and_micro_steps_equals_single_process_batch(world, accum, n, drop_last):
    batch, seed = 12, 11
    data = TensorDataset(torch.arange(n))
    sizes = global_batch_sizes(n, batch, drop_last, world)
    for epoch in (0, 1):
        ref_sampler = EpochSampler(n, 1, 0, seed, True, batch, drop_last)
        ref_sampler.set_epoch(epoch)
        reference = [b[0].tolist() for b in DataLoader(data, batch_size=batch, sampler=ref_sampler)]
        ref_sizes = global_batch_sizes(n, batch, drop_last, 1)
        # a final batch smaller than the world is dropped by the ddp run only
        assert sizes == ref_sizes[: len(sizes)]
        micro = batch // (world * accum)
        per_rank = []
        for rank in range(world):
            s = EpochSampler(n, world, rank, seed, True, batch, drop_last)
            s.set_epoch(epoch)
            loader = DataLoader(data, batch_size=micro, sampler=s)
            per_rank.append(steps_of(loader, sizes, world, rank))
        for k, size in enumerate(sizes):
            union = [i for rank in range(world) for i in per_rank[rank][k]]
            assert len(union) == size
            assert sorted(union) == sorted(reference[k])


def test_micro_batches_match_micro_batch_sizes():
    n, batch, world, accum = 43, 12, 2, 2
    micro = batch // (world * accum)
    sizes = global_batch_sizes(n, batch, False, world)
    data = TensorDataset(torch.arange(n))
    for rank in range(world):
        loader = DataLoader(data, batch_size=micro, sampler=EpochSampler(n, world, rank, 0, True, batch, False))
        got = [len(b[0]) for b in loader]
        expected = [m for size in sizes for m in micro_batch_sizes(size, world, rank, micro)]
        assert got == expected


@pytest.mark.parametrize("world", [2, 3])
def test_start_batch_resumes_where_an_uninterrupted_epoch_would_be(world):
    n, batch = 43, 6
    for rank in range(world):
        full = EpochSampler(n, world, rank, 4, True, batch, False)
        full.set_epoch(2)
        everything = list(full)
        resumed = EpochSampler(n, world, rank, 4, True, batch, False)
        resumed.set_epoch(2)
        resumed.set_start_batch(3)
        assert list(resumed) == everything[3 * batch // world :]
        assert len(resumed) == len(everything) - 3 * batch // world


def test_set_epoch_reseeds_the_attached_generator():
    g = torch.Generator()
    s = EpochSampler(10, 1, 0, 3, True, 2, False, generator=g)
    s.set_epoch(4)
    a = torch.randint(0, 2**30, (3,), generator=g)
    s.set_epoch(4)
    b = torch.randint(0, 2**30, (3,), generator=g)
    s.set_epoch(5)
    c = torch.randint(0, 2**30, (3,), generator=g)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_sharded_gradients_equal_single_process_gradients():
    """With the loss normalisation of the loop, W ranks x A micro-steps give the W=1 gradient."""
    n, batch, dim = 43, 12, 5
    torch.manual_seed(0)
    x, y = torch.randn(n, dim), torch.randint(0, 3, (n,))
    weight = torch.randn(dim, 3)

    def grad(idx: list[int], denom: float) -> torch.Tensor:
        w = weight.clone().requires_grad_(True)
        loss = torch.nn.functional.cross_entropy(x[idx] @ w, y[idx], reduction="sum") / denom
        loss.backward()
        return w.grad

    for world in (1, 2, 3):
        for accum in (1, 2):
            sizes = global_batch_sizes(n, batch, False, world)
            micro = batch // (world * accum)
            ref = EpochSampler(n, 1, 0, 0, True, batch, False).indices()
            data = TensorDataset(torch.arange(n))
            per_rank = [
                steps_of(
                    DataLoader(data, batch_size=micro, sampler=EpochSampler(n, world, r, 0, True, batch, False)),
                    sizes,
                    world,
                    r,
                )
                for r in range(world)
            ]
            start = 0
            for k, size in enumerate(sizes):
                expected = grad(ref[start : start + size], size)
                start += size
                rank_grads = []
                for r in range(world):
                    chunks = [per_rank[r][k][i : i + micro] for i in range(0, len(per_rank[r][k]), micro)]
                    rank_grads.append(sum(grad(c, size / world) for c in chunks))
                averaged = sum(rank_grads) / world  # what DDP's all-reduce average produces
                torch.testing.assert_close(averaged, expected)


@pytest.mark.parametrize(("n", "world"), [(10, 3), (7, 2), (2, 4), (0, 2)])
def test_eval_sampler_counts_every_sample_exactly_once(n, world):
    parts = [list(EvalSampler(n, world, r)) for r in range(world)]
    flat = [i for p in parts for i in p]
    assert sorted(flat) == list(range(n))
    assert [len(EvalSampler(n, world, r)) for r in range(world)] == [len(p) for p in parts]


def test_in_memory_loaders_give_each_batch_in_one_indexing_equal_to_stacked_samples(monkeypatch) -> None:
    """runner's loaders never fetch an in-memory dataset sample by sample (a plain DataLoader's ``__getitems__``, then
    ``default_collate``'s stack): the same tensors, about four times faster. Two ranks, two micro-batches a step."""
    from torch.utils.data import default_collate

    from runner.spec.loading import spec_from_dict
    from runner.training.data import build_datasets
    from runner.training.sampling import build_loaders
    from runner.training.sources import TensorPairDataset

    data = {"dataset": "synthetic", "batch_size": 8, "num_samples": 43, "input_shape": [4], "num_classes": 3}
    tables = {"name": "t", "model": {"name": "mlp"}, "data": data, "devices": {"accelerator": "cpu"}}
    spec = spec_from_dict({**tables, "optim": {"lr": 0.1}, "train": {"grad_accum_steps": 2}})
    bundle = build_datasets(spec, None)
    assert isinstance(bundle.train, TensorPairDataset) and bundle.val is not None

    def one_by_one(self, indices):
        raise AssertionError("fetched sample by sample")

    for rank in range(2):
        loaders = build_loaders(spec, bundle, rank, 2)
        loaders.train_sampler.set_epoch(1)
        order = loaders.train_sampler.indices()
        chunks = [order[i : i + loaders.micro_batch] for i in range(0, len(order), loaders.micro_batch)]
        val_order = list(range(rank, len(bundle.val), 2))
        expected = [default_collate([bundle.train[i] for i in c]) for c in chunks]
        expected_val = [default_collate([bundle.val[i] for i in val_order])]  # one evaluation batch
        with monkeypatch.context() as patch:
            patch.setattr(TensorPairDataset, "__getitems__", one_by_one)
            got, got_val = list(loaders.train), list(loaders.val or [])
        assert len(got) == len(chunks) > 2 and len(got_val) == 1
        for batch, want in zip([*got, *got_val], [*expected, *expected_val], strict=True):
            assert type(batch) is list and [t.dtype for t in batch] == [t.dtype for t in want]
            assert all(torch.equal(a, b) for a, b in zip(batch, want, strict=True))
