"""Datasets: ``[data]`` into train and validation sets, the validation split, and the data's fingerprints.

A sample is an ``(x, y)`` pair (``x`` a tensor of ``DatasetInfo.input_shape``, ``y`` the target)
or a dict of tensors (``data.target`` names the target key; docs/design.md §13). Sources
(``runner.training.sources``):

* ``sklearn.digits``: the 1797 8x8 UCI digits shipped with scikit-learn, in memory. Pixels
  0..16 are scaled to [0, 1], resized once up front (``image_size``, bilinear), then
  normalised with the mean and std of the whole (resized) set; ``num_channels`` repeats the
  single channel. kwargs: ``normalize`` (default true). Labels are int64.
* ``sklearn.diabetes``: the 442 patients of scikit-learn's diabetes data, ten features in raw
  units, standardised per feature over the whole set (kwargs: ``standardize``, default true);
  the target is a float32 measure of disease progression one year later (25..346).
* ``torchvision.<Name>``: read from ``data.root`` (relative to the spec file), downloaded
  only with ``download = true``; the training split (``train = True`` or ``split = "train"``)
  is used and held-out validation is taken from it. Images become [0, 1] tensors.
* ``imagefolder``: ``root/train/<class>/*`` and, if present, ``root/val/<class>/*`` (else
  ``val_fraction`` of train) and ``root/test/<class>/*``; images are read as RGB, made grayscale
  for ``num_channels = 1`` (torchvision's ``rgb_to_grayscale``) and resized to ``image_size``.

``data.transforms`` and ``data.eval_transforms`` (``runner.training.sources.build_transforms``) are
torchvision ``transforms.v2`` classes by name (or ``pkg.module:Transform``) with kwargs, composed
once and checked before the run exists: an unknown name, kwargs the class rejects, or sample 0
that cannot go through them is a spec error at the entry. They wrap the datasets after the split
(``Transformed``): the training set takes ``transforms``, the validation and test sets
``eval_transforms``, so a split dataset's held-out samples are never augmented. v2 transforms take
the whole sample and change its image (the first plain tensor), leaving the target. A random
transform draws from each process's generator, so it is named with dropout as a cause of
differences between the modes (docs/design.md §3).
* ``synthetic``: ``num_samples`` standard-normal tensors of ``input_shape``, labelled by a
  fixed random linear teacher (argmax of ``x.flatten() @ W``), seeded by ``data.split_seed``.
* ``pkg.module:factory``: ``factory(**data.kwargs)`` returns a Dataset (split here) or a
  ``(train, val)`` tuple.

The validation split is a permutation from ``torch.Generator().manual_seed(data.split_seed)``,
apart from ``seed`` (docs/design.md §11): the same split seed and size always give the same split,
and runs that differ in ``seed`` score on the same validation samples. Its fingerprint
(``DatasetInfo.val_split_sha256``) is the SHA-256 of the sorted validation indices, or of
the sorted validation file list when the dataset brings its own validation files.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Callable, Sequence, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from runner.errors import did_you_mean, first_line, with_hint
from runner.training.models import spec_issue
from runner.training.sources import TensorPairDataset, Transformed, build_transforms, load_source, source_text

if TYPE_CHECKING:
    from runner.spec.schema import DataSpec, ExperimentSpec


@dataclass(frozen=True)
class DatasetInfo:
    """What the model and the loop need to know about the data.

    ``input_shape`` is one sample's (a dict sample's first input); ``num_classes`` 0 when unknown; ``val_split_sha256``
    hashes the sorted validation indices or file paths; ``normalization`` is the ``(mean, std)`` the samples were
    normalised with, put in front of a logged model.
    """

    input_shape: tuple[int, ...]
    num_classes: int
    num_train: int
    num_val: int
    name: str
    target_shape: tuple[int, ...] = ()
    keys: tuple[str, ...] = ()
    val_split_sha256: str | None = None
    train_digest: str = ""
    val_digest: str | None = None
    normalization: tuple[float, float] | None = None
    source: str = ""
    num_test: int = 0
    test_digest: str | None = None
    split: bool = True  # the held-out sets were drawn from the training set (val_fraction, test_fraction)


@dataclass(frozen=True)
class DatasetBundle:
    """Train, validation and test datasets plus their :class:`DatasetInfo`."""

    train: Dataset
    val: Dataset | None
    info: DatasetInfo
    test: Dataset | None = None


def dataset_len(ds: Dataset) -> int:
    """Number of samples of a map-style dataset (``torch.utils.data.Dataset`` declares no ``__len__``)."""
    return len(cast(Sized, ds))


def _split(
    ds: Dataset, val_fraction: float, seed: int, test_fraction: float
) -> tuple[Dataset, Dataset | None, Dataset | None, list[int], list[int]]:
    """``(train, val, test, train indices, val indices)``; ``val`` and ``test`` are ``None`` for fraction 0."""
    train_idx, val_idx, test_idx = split_indices(dataset_len(ds), val_fraction, seed, test_fraction)
    if not val_idx and not test_idx:
        return ds, None, None, train_idx, val_idx
    val = _subset(ds, val_idx) if val_idx else None
    test = _subset(ds, test_idx) if test_idx else None
    return _subset(ds, train_idx), val, test, train_idx, val_idx


def _subset(ds: Dataset, indices: list[int]) -> Dataset:
    """The samples of ``ds`` at ``indices``; an in-memory dataset is indexed at once."""
    return ds.subset(indices) if isinstance(ds, TensorPairDataset) else Subset(ds, indices)


def _first_sample(
    ds: Dataset, name: str, target: str | None
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[str, ...]]:
    """``(input shape, target shape, dict keys)`` of sample 0, checking that it is an ``(x, y)`` pair or a dict."""
    try:
        sample = ds[0]
    except ValueError as exc:  # e.g. a channel conversion that cannot work
        raise spec_issue("data.num_channels", f"{name}: {first_line(exc)}") from None
    if isinstance(sample, dict):
        keys = tuple(str(k) for k in sample)
        if target is not None and target not in sample:
            message = f"{name} yields dicts with keys {list(keys)}, none of them {target!r}"
            raise spec_issue("data.target", with_hint(message, did_you_mean(target, keys)))
        inputs = [v for k, v in sample.items() if k != target and isinstance(v, torch.Tensor)]
        shape = tuple(inputs[0].shape) if inputs else ()
        return shape, (_shape_of(sample[target]) if target is not None else ()), keys
    if not isinstance(sample, (tuple, list)) or len(sample) != 2 or not isinstance(sample[0], torch.Tensor):
        raise spec_issue(
            "data.dataset",
            f"{name} yields {type(sample).__name__} samples; a sample must be an (x: tensor, y: target) pair "
            "or a dict of tensors",
        )
    if target is not None:
        raise spec_issue(
            "data.target", f"{name} yields (x, y) pairs: data.target names a key of dict samples; remove it"
        )
    return tuple(sample[0].shape), _shape_of(sample[1]), ()


def _shape_of(value: Any) -> tuple[int, ...]:
    return tuple(torch.as_tensor(value).shape) if isinstance(value, (torch.Tensor, int, float, list)) else ()


def _label_count(ds: Dataset, target: str | None) -> int:
    """Number of classes of ``ds``: an attribute if it has one, else ``max(label) + 1`` (0 if not integral)."""
    base = ds
    indices = None
    while isinstance(base, Subset):
        indices = [base.indices[i] for i in indices] if indices is not None else list(base.indices)
        base = base.dataset
    num = getattr(base, "num_classes", None)
    if isinstance(num, int) and not isinstance(num, bool):
        return num
    classes = getattr(base, "classes", None)
    if isinstance(classes, (list, tuple)) and classes:
        return len(classes)
    labels: Any
    if isinstance(base, TensorPairDataset):
        labels = base.y
    elif getattr(base, "targets", None) is not None:
        labels = torch.as_tensor(base.targets)  # type: ignore[attr-defined]
    else:
        key: Any = 1 if target is None else target
        if target is None and isinstance(ds[0], dict):
            return 0
        labels = torch.stack([torch.as_tensor(ds[i][key]) for i in range(dataset_len(ds))])
        indices = None
    if indices is not None:
        labels = labels[torch.as_tensor(indices, dtype=torch.long)]
    if labels.numel() == 0 or labels.is_floating_point() or labels.is_complex() or labels.dim() != 1:
        return 0
    return int(labels.max()) + 1


def build_datasets(spec: ExperimentSpec, spec_dir: Path | str | None) -> DatasetBundle:
    """Build the train and validation datasets of ``spec.data`` (``val`` ``None`` without validation data).

    ``data.root`` and factory imports are relative to ``spec_dir``. Raises SpecError: An unknown dataset, missing files,
    rejected kwargs, options or a target that do not fit the samples, or an empty dataset; each at its key, with the
    fix."""
    data = spec.data
    name = data.dataset
    source = load_source(data, spec_dir)
    train = source.train
    val = source.val
    test = source.test
    if dataset_len(train) == 0:
        raise spec_issue("data.dataset", f"{name} has no training samples")
    augment = build_transforms(data.transforms, "data.transforms", spec_dir)
    evaluate = build_transforms(data.eval_transforms, "data.eval_transforms", spec_dir)
    for transform, key, part in ((augment, "data.transforms", train), (evaluate, "data.eval_transforms", val)):
        _probe_transform(part if part is not None else train, transform, key)
    input_shape, target_shape, keys = _first_sample(_through(train, augment), name, data.target)
    num_classes = _label_count(train, data.target)
    train_members: Sequence[int] | Sequence[str] | None
    val_members: Sequence[int] | Sequence[str] | None
    if not source.explicit:  # the test split comes from the source when it has one (imagefolder's test/)
        test_fraction = data.test_fraction if test is None else 0.0
        train, val, split_test, train_members, val_members = _split(
            train, data.val_fraction, data.split_seed, test_fraction
        )
        test = test if test is not None else split_test
    else:
        train_members, val_members = file_list(train), file_list(val) if val is not None else None
        if val is not None and dataset_len(val):
            num_classes = max(num_classes, _label_count(val, data.target))
    num_val = dataset_len(val) if val is not None else 0
    num_test = dataset_len(test) if test is not None else 0
    settings = data_settings(data)
    info = DatasetInfo(
        input_shape=tuple(int(d) for d in input_shape),
        num_classes=num_classes,
        num_train=dataset_len(train),
        num_val=num_val,
        name=name,
        target_shape=target_shape,
        keys=keys,
        val_split_sha256=sha256_of_members(val_members) if num_val and val_members is not None else None,
        train_digest=part_digest(settings, "train", train_members, dataset_len(train)),
        val_digest=part_digest(settings, "val", val_members, num_val) if num_val else None,
        normalization=source.normalization,
        source=source_text(data, spec_dir),
        num_test=num_test,
        test_digest=part_digest(settings, "test", file_list(test), num_test) if test is not None and num_test else None,
        split=not source.explicit,
    )
    return DatasetBundle(_through(train, augment), _through(val, evaluate), info, _through(test, evaluate))


def _through(dataset: Dataset | None, transform: Callable[[Any], Any] | None) -> Any:
    """``dataset`` with its samples through ``transform`` (as it is without one)."""
    return Transformed(dataset, transform) if transform is not None and dataset is not None else dataset


def _probe_transform(dataset: Dataset, transform: Callable[[Any], Any] | None, key: str) -> None:
    """Pass sample 0 through ``transform``: one that cannot take the samples is a SpecError at ``key``."""
    if transform is not None and dataset_len(dataset):
        try:
            transform(dataset[0])
        except Exception as exc:  # the user's transform or torchvision's on a sample it cannot take
            problem = f"{type(exc).__name__}: {first_line(exc)}"  # one line, as build_transforms words its errors
            raise spec_issue(key, f"sample 0 of the data cannot go through {key}: {problem}") from None


def split_indices(
    num_samples: int, val_fraction: float, seed: int, test_fraction: float = 0.0
) -> tuple[list[int], list[int], list[int]]:
    """Sorted ``(train, val, test)`` indices of ``range(num_samples)``: of ``torch.randperm`` under
    ``data.split_seed``, the first ``floor(n * val_fraction)`` (at least one) are validation samples and the next
    ``floor(n * test_fraction)`` (at least one) test samples, so a test split leaves the validation split as it was.
    Raises SpecError when no training sample would be left."""
    n_val, n_test = _share(num_samples, val_fraction), _share(num_samples, test_fraction)
    if num_samples - n_val - n_test < 1:
        fractions = f"val_fraction = {val_fraction}" + (f" and test_fraction = {test_fraction}" if n_test else "")
        raise spec_issue("data.val_fraction", f"{fractions} leave no training sample out of {num_samples}")
    perm = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(perm[n_val + n_test :]), sorted(perm[:n_val]), sorted(perm[n_val : n_val + n_test])


def _share(num_samples: int, fraction: float) -> int:
    """``floor(num_samples * fraction)``, at least one sample for a fraction above 0."""
    count = int(num_samples * fraction)
    return 1 if fraction > 0 and count == 0 else count


def sha256_of_members(members: Sequence[int] | Sequence[str]) -> str:
    """Hex SHA-256 of sorted indices (comma-joined decimals) or sorted file paths (one a line)."""
    items = sorted(members)
    sep = "," if items and isinstance(items[0], int) else "\n"
    return hashlib.sha256(sep.join(str(m) for m in items).encode("utf-8")).hexdigest()


def file_list(ds: Dataset) -> list[str] | None:
    """The files of an ImageFolder-like dataset (``samples`` of ``(path, class)``), relative to its root."""
    samples = getattr(ds, "samples", None)
    if not isinstance(samples, list) or not samples or not isinstance(samples[0], tuple):
        return None
    root = str(getattr(ds, "root", ""))
    return [os.path.relpath(str(path), root) if root else str(path) for path, *_ in samples]


def data_settings(data: DataSpec) -> str:
    """What fixes the samples of ``[data]`` besides the split: the dataset and its options (JSON)."""
    keys: tuple[str, ...] = ("dataset", "root", "kwargs", "image_size", "num_channels")
    if data.dataset == "synthetic":
        keys += ("num_samples", "input_shape", "num_classes", "split_seed")
    keys += tuple(key for key in ("transforms", "eval_transforms") if getattr(data, key))
    return json.dumps({k: getattr(data, k) for k in keys}, sort_keys=True, default=str)


def part_digest(settings: str, part: str, members: Sequence[int] | Sequence[str] | None, size: int) -> str:
    """A 12-digit digest of one part (``train``/``val``): the settings, the part and its members (or its size)."""
    body = sha256_of_members(members) if members is not None else f"size={size}"
    return hashlib.sha256(f"{settings}|{part}|{body}".encode()).hexdigest()[:12]


CUBLAS_WORKSPACE_CONFIG = ":4096:8"


def derive_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed, a pure function of non-negative ``parts`` (``numpy.random.SeedSequence``)."""
    state = np.random.SeedSequence([int(p) for p in parts]).generate_state(1, dtype=np.uint64)[0]
    return int(state) & ((1 << 63) - 1)


def loader_generator(seed: int, rank: int, epoch: int = 0) -> torch.Generator:
    """The CPU generator of a rank's DataLoader for ``epoch``, seeded ``derive_seed(seed, rank, epoch)``."""
    g = torch.Generator()
    g.manual_seed(derive_seed(seed, rank, epoch))
    return g


def worker_init_fn(worker_id: int) -> None:
    """Seed ``random`` and ``numpy.random`` in a DataLoader worker from its torch seed (which includes the worker
    id)."""
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


def seed_everything(seed: int, deterministic: bool = False) -> dict[str, str]:
    """Seed Python, NumPy, torch and every device (``torch.manual_seed``, lazily: CUDA is never initialised here);
    optionally force determinism. Returns the settings it set, by name (none unless ``deterministic``).

    ``deterministic`` sets ``torch.use_deterministic_algorithms``, cuDNN determinism and ``CUBLAS_WORKSPACE_CONFIG``;
    ``False`` turns deterministic algorithms off again.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    settings: dict[str, str] = {}
    if deterministic:
        if "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE_CONFIG
        settings["env.CUBLAS_WORKSPACE_CONFIG"] = os.environ["CUBLAS_WORKSPACE_CONFIG"]
        torch.use_deterministic_algorithms(True)
        settings["torch.use_deterministic_algorithms"] = "True"
        torch.backends.cudnn.deterministic = True
        settings["torch.backends.cudnn.deterministic"] = "True"
        torch.backends.cudnn.benchmark = False
        settings["torch.backends.cudnn.benchmark"] = "False"
    elif torch.are_deterministic_algorithms_enabled():
        torch.use_deterministic_algorithms(False)
    return settings


def capture_rng_state() -> dict[str, Any]:
    """Every RNG state needed to continue a run exactly, as plain types and tensors (``weights_only`` loads it)."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    cuda: list[torch.Tensor] = []
    if torch.cuda.is_available():
        cuda = [t.clone() for t in torch.cuda.get_rng_state_all()]
    return {
        "python": [version, list(internal), gauss],
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state().clone(),
        "cuda": cuda,
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`capture_rng_state`'s states; CUDA states of devices not visible now are skipped."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    npst = state["numpy"]
    key = npst["key"]
    key = key.numpy() if isinstance(key, torch.Tensor) else np.asarray(key)
    np.random.set_state(
        {
            "bit_generator": npst["bit_generator"],
            "state": {"key": key.astype(np.uint32), "pos": npst["pos"]},
            "has_gauss": npst["has_gauss"],
            "gauss": npst["gauss"],
        }
    )
    torch.set_rng_state(state["torch"].cpu())
    cuda = list(state.get("cuda") or [])
    if cuda and torch.cuda.is_available():
        for i, s in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s.cpu(), i)
