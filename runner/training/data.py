"""Datasets: build ``[data]`` into train and validation datasets (per-rank loaders: :mod:`runner.training.loaders`).

Every dataset yields ``(x, y)`` with ``x`` a float32 tensor of ``DatasetInfo.input_shape``
and ``y`` an int64 scalar tensor. Sources:

* ``sklearn.digits``: the 1797 8x8 UCI digits shipped with scikit-learn, in memory. Pixels
  0..16 are scaled to [0, 1], resized once up front (``image_size``, bilinear), then
  normalised with the mean and std of the whole (resized) set; ``num_channels`` repeats the
  single channel. kwargs: ``normalize`` (default true).
* ``torchvision.<Name>``: read from ``data.root`` (relative to the spec file), downloaded
  only with ``download = true``; the training split (``train = True`` or ``split = "train"``)
  is used and held-out validation is taken from it. Images become [0, 1] tensors.
* ``imagefolder``: ``root/train/<class>/*`` and, if present, ``root/val/<class>/*`` (else
  ``val_fraction`` of train); images are read as RGB.
* ``synthetic``: ``num_samples`` standard-normal tensors of ``input_shape``, labelled by a
  fixed random linear teacher (argmax of ``x.flatten() @ W``), seeded by ``spec.seed``.
* ``pkg.module:factory``: ``factory(**data.kwargs)`` returns a Dataset (split here) or a
  ``(train, val)`` tuple.

The validation split is a permutation from ``torch.Generator().manual_seed(spec.seed)``:
the same seed and size always give the same split.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, Subset

from runner.spec.suggest import did_you_mean
from runner.spec.wording import with_hint
from runner.training.models import resolve_factory, spec_issue

BUILTIN_DATASETS = ("sklearn.digits", "synthetic", "imagefolder")
_NOT_DATASETS = {"VisionDataset", "DatasetFolder", "ImageFolder", "wrap_dataset_for_transforms_v2"}


@dataclass(frozen=True)
class DatasetInfo:
    """What the model and the loop need to know about the data.

    Attributes:
        input_shape: Shape of one sample ``x``, e.g. ``(1, 8, 8)``.
        num_classes: Number of classes (labels are ``0 .. num_classes - 1``); 0 if unknown.
        num_train: Training samples.
        num_val: Validation samples (0 without validation).
        name: ``data.dataset``.
    """

    input_shape: tuple[int, ...]
    num_classes: int
    num_train: int
    num_val: int
    name: str


@dataclass(frozen=True)
class DatasetBundle:
    """Train and validation datasets plus their :class:`DatasetInfo`."""

    train: Dataset
    val: Dataset | None
    info: DatasetInfo


class TensorPairDataset(Dataset):
    """In-memory dataset of ``x[i], y[i]`` with batched fetching (``__getitems__``).

    Args:
        x: Samples, shape ``(N, *input_shape)``, float32.
        y: Labels, shape ``(N,)``, int64.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        if len(x) != len(y):
            raise ValueError(f"x has {len(x)} samples but y has {len(y)}")
        self.x = x
        self.y = y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        idx = torch.as_tensor(indices, dtype=torch.long)
        return list(zip(self.x[idx].unbind(0), self.y[idx].unbind(0), strict=False))

    def subset(self, indices: Sequence[int]) -> TensorPairDataset:
        """Return the samples at ``indices`` as a new in-memory dataset."""
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        return TensorPairDataset(self.x[idx], self.y[idx])


class ImageTransform:
    """PIL image -> float32 tensor in [0, 1], optionally resized and channel-repeated.

    Args:
        image_size: Resize to ``image_size x image_size`` (bilinear, antialiased), or ``None``.
        num_channels: Repeat a 1-channel image to this many channels, or ``None``.
    """

    def __init__(self, image_size: int | None, num_channels: int | None):
        self.image_size = image_size
        self.num_channels = num_channels

    def __call__(self, image: Any) -> torch.Tensor:
        from torchvision.transforms.v2 import functional as TF

        x = TF.to_dtype(TF.to_image(image), torch.float32, scale=True)
        if self.image_size is not None:
            x = TF.resize(x, [self.image_size, self.image_size], antialias=True)
        x = x.as_subclass(torch.Tensor)
        if self.num_channels is not None and x.shape[0] != self.num_channels:
            if x.shape[0] != 1:
                raise ValueError(f"cannot turn {x.shape[0]}-channel images into {self.num_channels} channels")
            x = x.expand(self.num_channels, *x.shape[1:]).contiguous()
        return x


def to_long(y: Any) -> torch.Tensor:
    """Return label ``y`` as an int64 scalar tensor."""
    return torch.as_tensor(y, dtype=torch.long)


def dataset_len(ds: Dataset) -> int:
    """Number of samples of a map-style dataset (``torch.utils.data.Dataset`` declares no ``__len__``)."""
    return len(cast(Sized, ds))


def split_indices(num_samples: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Split ``range(num_samples)`` into sorted train and validation indices.

    ``floor(num_samples * val_fraction)`` samples (at least one when ``val_fraction > 0``) are
    the first entries of ``torch.randperm(num_samples)`` under ``torch.Generator().manual_seed(seed)``.

    Args:
        num_samples: Samples to split.
        val_fraction: Fraction held out, in ``[0, 1)``.
        seed: Seed of the permutation (``spec.seed``).

    Returns:
        ``(train_indices, val_indices)``, each sorted; ``val_indices`` is empty for fraction 0.

    Raises:
        SpecError: (``data.val_fraction``) if no training sample would be left.
    """
    n_val = int(num_samples * val_fraction)
    if val_fraction > 0 and n_val == 0:
        n_val = 1
    if num_samples - n_val < 1:
        raise spec_issue(
            "data.val_fraction", f"val_fraction = {val_fraction} leaves no training sample out of {num_samples}"
        )
    perm = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(perm[n_val:]), sorted(perm[:n_val])


def _split(ds: Dataset, val_fraction: float, seed: int) -> tuple[Dataset, Dataset | None]:
    train_idx, val_idx = split_indices(dataset_len(ds), val_fraction, seed)
    if not val_idx:
        return ds, None
    if isinstance(ds, TensorPairDataset):
        return ds.subset(train_idx), ds.subset(val_idx)
    return Subset(ds, train_idx), Subset(ds, val_idx)


def _check_kwargs(dataset: str, kwargs: dict[str, Any], allowed: Sequence[str]) -> None:
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        choices = ", ".join(allowed) or "none"
        raise spec_issue("data.kwargs", f"{dataset} does not take {unknown} (accepted: {choices})")


def _shape_images(x: torch.Tensor, dataset: str, image_size: int | None, num_channels: int | None) -> torch.Tensor:
    """Resize ``(N, C, H, W)`` tensors once (bilinear) and repeat a single channel ``num_channels`` times."""
    if (image_size is not None or num_channels is not None) and x.dim() != 4:
        raise spec_issue(
            "data.image_size" if image_size is not None else "data.num_channels",
            f"{dataset} samples have shape {list(x.shape[1:])}, not images (C, H, W): remove the option",
        )
    if image_size is not None and tuple(x.shape[2:]) != (image_size, image_size):
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    if num_channels is not None and x.shape[1] != num_channels:
        if x.shape[1] != 1:
            raise spec_issue(
                "data.num_channels", f"can only repeat 1-channel images, but {dataset} has {x.shape[1]} channels"
            )
        x = x.expand(-1, num_channels, -1, -1)
    return x


def _digits(data: Any) -> TensorPairDataset:
    from sklearn.datasets import load_digits

    _check_kwargs("sklearn.digits", data.kwargs, ["normalize"])
    normalize = data.kwargs.get("normalize", True)
    if not isinstance(normalize, bool):
        raise spec_issue("data.kwargs", f"normalize must be true or false, got {normalize!r}")
    bunch = load_digits()
    x = torch.as_tensor(bunch.images, dtype=torch.float32).div_(16.0).unsqueeze(1)  # (1797, 1, 8, 8), [0, 1]
    y = torch.as_tensor(bunch.target, dtype=torch.long)
    x = _shape_images(x, data.dataset, data.image_size, None)
    if normalize:
        x = (x - x.mean()) / x.std()
    x = _shape_images(x, data.dataset, None, data.num_channels)
    return TensorPairDataset(x.contiguous(), y)


def _synthetic(data: Any, seed: int) -> TensorPairDataset:
    _check_kwargs("synthetic", data.kwargs, [])
    g = torch.Generator().manual_seed(seed)
    shape = tuple(data.input_shape)
    x = torch.randn(data.num_samples, *shape, generator=g)
    teacher = torch.randn(math.prod(shape), data.num_classes, generator=g)
    y = (x.flatten(1) @ teacher).argmax(dim=1)
    x = _shape_images(x, data.dataset, data.image_size, data.num_channels)
    return TensorPairDataset(x.contiguous(), y)


def _root(data: Any, spec_dir: Path | str | None) -> Path:
    root = Path(data.root).expanduser()
    if not root.is_absolute() and spec_dir is not None:
        root = Path(spec_dir) / root
    return root.resolve()


def torchvision_dataset_names() -> list[str]:
    """Return ``torchvision.<Name>`` for every dataset class in ``torchvision.datasets``."""
    import torchvision.datasets as tvd

    return [
        f"torchvision.{n}" for n in tvd.__all__ if n not in _NOT_DATASETS and inspect.isclass(getattr(tvd, n, None))
    ]


def _unknown_dataset(name: str) -> Exception:
    choices = list(BUILTIN_DATASETS) + torchvision_dataset_names()
    hint = did_you_mean(name, choices, n=3)  # ignoring case, suggesting the real spelling
    if name.lower().startswith("torchvision.") or not hint:  # compare class names, not the shared prefix
        bare = {c.removeprefix("torchvision."): c for c in choices if c.startswith("torchvision.")}
        hint = did_you_mean(name.lower().removeprefix("torchvision."), bare, n=3)
    return spec_issue(
        "data.dataset",
        with_hint(f"unknown dataset {name!r}", hint) + f'; use {", ".join(BUILTIN_DATASETS)}, "torchvision.<Name>" '
        '(a class of torchvision.datasets, e.g. torchvision.MNIST) or "pkg.module:factory"',
    )


def _expected_path(cls: type, root: Path) -> Path:
    if isinstance(getattr(cls, "raw_folder", None), property):  # MNIST family
        return root / cls.__name__ / "raw"
    base = getattr(cls, "base_folder", None)
    return root / base if isinstance(base, str) else root


def _torchvision(data: Any, spec_dir: Path | str | None) -> Dataset:
    import torchvision.datasets as tvd

    cls_name = data.dataset[len("torchvision.") :]
    cls: Any = getattr(tvd, cls_name, None)
    if cls_name in _NOT_DATASETS or not inspect.isclass(cls) or not issubclass(cls, Dataset):
        raise _unknown_dataset(data.dataset)
    root = _root(data, spec_dir)
    kwargs = dict(data.kwargs)
    params = inspect.signature(cls).parameters
    if "train" in params:
        kwargs.setdefault("train", True)
    elif "split" in params:
        kwargs.setdefault("split", "train")
    if "download" in params:
        kwargs["download"] = data.download
    transform = ImageTransform(data.image_size, data.num_channels)
    try:
        dataset_class: Any = cls  # a VisionDataset subclass: takes root, transform, target_transform
        return dataset_class(str(root), transform=transform, target_transform=to_long, **kwargs)
    except TypeError as exc:
        raise spec_issue(
            "data.kwargs",
            f"{data.dataset} rejected kwargs {data.kwargs}: {exc}; signature: {cls_name}{inspect.signature(cls)}",
        ) from None
    except (RuntimeError, OSError) as exc:
        expected = _expected_path(cls, root)
        if data.download:
            raise spec_issue(
                "data.root",
                f"{data.dataset} could not be downloaded into {root}: {exc}; "
                f"copy the files to {expected} and set download = false",
            ) from None
        raise spec_issue(
            "data.root",
            f"{data.dataset} files not found under {root} (expected {expected}; {exc}): set data.download = true once "
            f"to fetch them, or copy the files to {expected}",
        ) from None


def _imagefolder(data: Any, spec_dir: Path | str | None) -> tuple[Dataset, Dataset | None]:
    from torchvision.datasets import ImageFolder

    root = _root(data, spec_dir)
    train_dir, val_dir = root / "train", root / "val"
    if not train_dir.is_dir():
        raise spec_issue(
            "data.root",
            f"imagefolder expects {train_dir}/<class>/<image> (and optionally {val_dir}/<class>/<image>), "
            f"but {train_dir} is not a folder: point data.root at the folder that holds train/",
        )
    transform = ImageTransform(data.image_size, data.num_channels)

    def load(folder: Path) -> ImageFolder:
        try:
            return ImageFolder(str(folder), transform=transform, target_transform=to_long, **data.kwargs)
        except TypeError as exc:
            raise spec_issue("data.kwargs", f"imagefolder rejected kwargs {data.kwargs}: {exc}") from None
        except (FileNotFoundError, OSError) as exc:
            raise spec_issue("data.root", f"imagefolder cannot read {folder}: {exc}") from None

    train = load(train_dir)
    if not val_dir.is_dir():
        return train, None
    val = load(val_dir)
    if val.class_to_idx != train.class_to_idx:
        raise spec_issue(
            "data.root",
            f"{val_dir} has classes {sorted(val.class_to_idx)} but {train_dir} has "
            f"{sorted(train.class_to_idx)}: use the same class folders",
        )
    return train, val


def _factory(data: Any, spec_dir: Path | str | None) -> tuple[Dataset, Dataset | None, bool]:
    factory = resolve_factory(data.dataset, spec_dir, "data.dataset")
    try:
        result = factory(**data.kwargs)
    except TypeError as exc:
        raise spec_issue(
            "data.kwargs", f"{data.dataset!r} rejected kwargs {data.kwargs}: {exc}; signature: {_sig(factory)}"
        ) from None
    if isinstance(result, (tuple, list)) and len(result) == 2:
        train, val = result
        if not _is_dataset(train) or not (val is None or _is_dataset(val)):
            raise spec_issue("data.dataset", f"{data.dataset!r} returned a pair that is not (Dataset, Dataset | None)")
        return train, val, True
    if not _is_dataset(result):
        raise spec_issue(
            "data.dataset",
            f"{data.dataset!r} returned a {type(result).__name__}, not a Dataset or a (train, val) tuple",
        )
    return result, None, False


def _sig(fn: Any) -> str:
    try:
        return f"{getattr(fn, '__name__', 'factory')}{inspect.signature(fn)}"
    except (TypeError, ValueError):
        return "(...)"


def _is_dataset(obj: Any) -> bool:
    if isinstance(obj, Dataset):
        return True
    return hasattr(obj, "__getitem__") and hasattr(obj, "__len__") and not isinstance(obj, (str, bytes, dict))


def _first_sample(ds: Dataset, name: str) -> torch.Tensor:
    """Return ``x`` of sample 0, checking that samples are ``(tensor, label)`` pairs."""
    try:
        sample = ds[0]
    except ValueError as exc:  # e.g. a channel conversion that cannot work
        raise spec_issue("data.num_channels", f"{name}: {exc}") from None
    if not isinstance(sample, (tuple, list)) or len(sample) != 2 or not isinstance(sample[0], torch.Tensor):
        raise spec_issue(
            "data.dataset",
            f"{name} yields {type(sample).__name__} samples; a sample must be an (x: tensor, y: label) pair",
        )
    return sample[0]


def _label_count(ds: Dataset) -> int:
    """Number of classes of ``ds``: an attribute if it has one, else ``max(label) + 1`` (0 if not integral)."""
    base, indices = ds, None
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
        labels = torch.stack([torch.as_tensor(ds[i][1]) for i in range(dataset_len(ds))])
        indices = None
    if indices is not None:
        labels = labels[torch.as_tensor(indices, dtype=torch.long)]
    if labels.numel() == 0 or labels.is_floating_point() or labels.is_complex() or labels.dim() != 1:
        return 0
    return int(labels.max()) + 1


def build_datasets(spec: Any, spec_dir: Path | str | None) -> DatasetBundle:
    """Build the train and validation datasets of ``spec.data``.

    Args:
        spec: The :class:`~runner.spec.schema.ExperimentSpec`.
        spec_dir: Folder of the spec file: ``data.root`` and factory imports are relative to it.

    Returns:
        A :class:`DatasetBundle`; ``val`` is ``None`` when there is no validation data
        (``val_fraction = 0`` and no explicit validation set).

    Raises:
        SpecError: Unknown dataset (``data.dataset``, with a did-you-mean), missing files
            (``data.root``, naming the path expected and the fix), kwargs the source rejects
            (``data.kwargs``), options that do not fit the samples, or an empty dataset.
    """
    data = spec.data
    name = data.dataset
    val: Dataset | None = None
    explicit = False
    if name == "sklearn.digits":
        train: Dataset = _digits(data)
    elif name == "synthetic":
        train = _synthetic(data, spec.seed)
    elif name == "imagefolder":
        train, val = _imagefolder(data, spec_dir)
        explicit = val is not None
    elif ":" in name:
        train, val, explicit = _factory(data, spec_dir)
    elif name.startswith("torchvision."):
        train = _torchvision(data, spec_dir)
    else:
        raise _unknown_dataset(name)
    if dataset_len(train) == 0:
        raise spec_issue("data.dataset", f"{name} has no training samples")
    x = _first_sample(train, name)
    num_classes = _label_count(train)
    if not explicit:
        train, val = _split(train, data.val_fraction, spec.seed)
    elif val is not None and dataset_len(val):
        num_classes = max(num_classes, _label_count(val))
    info = DatasetInfo(
        input_shape=tuple(int(d) for d in x.shape),
        num_classes=num_classes,
        num_train=dataset_len(train),
        num_val=dataset_len(val) if val is not None else 0,
        name=name,
    )
    return DatasetBundle(train=train, val=val, info=info)


def dataset_source(name: str, spec_dir: Path | str | None) -> Any:
    """The class or factory that builds ``data.dataset`` from files, found without calling it.

    Args:
        name: ``data.dataset``.
        spec_dir: Folder of the spec file (factory imports are relative to it).

    Returns:
        A ``torchvision.datasets`` class, a ``pkg.module:factory`` callable, ``ImageFolder`` for
        ``imagefolder``, or ``None`` for the in-memory built-ins.

    Raises:
        SpecError: (``data.dataset``) the name is unknown, with a did-you-mean, or the factory cannot be imported.
    """
    if name in ("sklearn.digits", "synthetic"):
        return None
    if ":" in name:
        return resolve_factory(name, spec_dir, "data.dataset")
    import torchvision.datasets as tvd

    if name == "imagefolder":
        return tvd.ImageFolder
    cls_name = name.removeprefix("torchvision.")
    cls = getattr(tvd, cls_name, None) if name.startswith("torchvision.") else None
    if cls_name in _NOT_DATASETS or not inspect.isclass(cls) or not issubclass(cls, Dataset):
        raise _unknown_dataset(name)
    return cls
