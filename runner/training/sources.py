"""Dataset sources, each ``data.dataset`` name into datasets: ``sklearn.digits``, ``sklearn.diabetes``, ``synthetic``,
``torchvision.<Name>``, ``imagefolder``, ``pkg.module:factory`` (split and info: :mod:`runner.training.data`).

Each source is one way data reaches a spec; they are apart from the split and its fingerprints so that a new
source is one function, and every source is split, transformed and fingerprinted alike.
"""

from __future__ import annotations

import gzip
import importlib.util
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from runner.errors import did_you_mean, first_line, user_code_error, with_hint
from runner.spec.names import NOT_DATASETS, unknown_dataset
from runner.training.models import installed_torchvision_names, resolve_factory, spec_issue, torchvision_package

if TYPE_CHECKING:
    from runner.spec.schema import DataSpec, Transforms

IN_MEMORY = ("sklearn.digits", "sklearn.diabetes", "synthetic")  # built without reading files


class TensorPairDataset(Dataset):
    """In-memory ``x[i], y[i]`` (``x`` float32 ``(N, *input_shape)``, ``y`` int64 classes or float32) fetched in
    batches."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x = x
        self.y = y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int | list[int]) -> Any:
        """``(x[i], y[i])``; for a list of indices the batch ``[x[idx], y[idx]]``, as ``default_collate`` stacks it."""
        if isinstance(i, list):
            idx = torch.as_tensor(i, dtype=torch.long)
            return [self.x[idx], self.y[idx]]
        return self.x[i], self.y[i]

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        x, y = self[indices]  # a plain DataLoader's batch, sample by sample
        return list(zip(x.unbind(0), y.unbind(0), strict=True))

    def subset(self, indices: Sequence[int]) -> TensorPairDataset:
        """Return the samples at ``indices`` as a new in-memory dataset."""
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        return TensorPairDataset(self.x[idx], self.y[idx])


class ImageTransform:
    """PIL image -> float32 tensor in [0, 1], optionally resized (bilinear), a 1-channel image repeated and an RGB one
    made grayscale for ``num_channels = 1``."""

    def __init__(self, image_size: int | None, num_channels: int | None):
        self.image_size = image_size
        self.num_channels = num_channels

    def __call__(self, image: Any) -> torch.Tensor:  # a PIL image, or an array torchvision reads as one
        from torchvision.transforms.v2 import functional as TF

        x = TF.to_dtype(TF.to_image(image), torch.float32, scale=True)
        if self.image_size is not None:
            x = TF.resize(x, [self.image_size, self.image_size], antialias=True)
        if self.num_channels == 1 and x.shape[0] == 3:
            x = TF.rgb_to_grayscale(x)
        x = x.as_subclass(torch.Tensor)
        if self.num_channels is not None and x.shape[0] != self.num_channels:
            if x.shape[0] != 1:
                raise ValueError(f"cannot turn {x.shape[0]}-channel images into {self.num_channels} channels")
            x = x.expand(self.num_channels, *x.shape[1:]).contiguous()
        return x


class Transformed(Dataset):
    """``dataset``'s samples through ``transform``: torchvision's v2 transforms take the whole sample (an ``(x, y)``
    pair or a dict) and change its image, the first plain tensor, leaving the target as it is."""

    def __init__(self, dataset: Dataset, transform: Callable[[Any], Any]):
        self.dataset = dataset
        self.transform = transform

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]  # map-style datasets have a length

    def __getitem__(self, i: int) -> Any:
        return self.transform(self.dataset[i])


def build_transforms(entries: Transforms, key: str, spec_dir: Path | str | None) -> Callable[[Any], Any] | None:
    """``data.transforms`` or ``data.eval_transforms`` as one v2 ``Compose`` (``None`` when empty); SpecError at
    the entry for an unknown name or kwargs its class rejects."""
    if not entries:
        return None
    from torchvision.transforms import v2

    made = []
    for index, entry in enumerate(entries):
        name, kwargs = (entry, {}) if isinstance(entry, str) else (entry.name, entry.kwargs)
        at = f"{key}[{index}]" if isinstance(entry, str) else f"{key}[{index}].name"
        cls = resolve_factory(name, spec_dir, at) if ":" in name else getattr(v2, name, None)
        if not callable(cls):
            known = [n for n, obj in vars(v2).items() if isinstance(obj, type) and issubclass(obj, v2.Transform)]
            problem = f"torchvision.transforms.v2 has no transform {name!r}"
            raise spec_issue(at, with_hint(problem, did_you_mean(name, known) or 'or give "pkg.module:Transform"'))
        try:
            made.append(cls(**kwargs))
        except (TypeError, ValueError) as exc:
            raise spec_issue(f"{key}[{index}].kwargs", f"{name} rejected {kwargs}: {first_line(exc)}") from None
    return v2.Compose(made)


def to_long(y: Any) -> torch.Tensor:
    """Return label ``y`` (an int, a NumPy scalar, a tensor: as the dataset gives it) as an int64 scalar tensor."""
    return torch.as_tensor(y, dtype=torch.long)


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
    if num_channels == 1 and x.shape[1] == 3:
        from torchvision.transforms.v2 import functional as TF

        x = TF.rgb_to_grayscale(x)
    if num_channels is not None and x.shape[1] != num_channels:
        if x.shape[1] != 1:
            raise spec_issue(
                "data.num_channels", f"can only repeat 1-channel images, but {dataset} has {x.shape[1]} channels"
            )
        x = x.expand(-1, num_channels, -1, -1)
    return x


def sklearn_table(file: str, delimiter: str | None = None) -> torch.Tensor:
    """A scikit-learn data file (``sklearn/datasets/data/<file>``) as float64 ``(rows, cols)``, read as its loaders
    read it, without importing scikit-learn (about 1.6 s a process). SpecError at ``data.dataset`` when missing."""
    import numpy as np

    found = importlib.util.find_spec("sklearn")
    folders = list(found.submodule_search_locations or []) if found is not None else []
    path = Path(folders[0], "datasets", "data", file) if folders else None
    if path is None or not path.is_file():
        raise spec_issue(
            "data.dataset", f"scikit-learn's data file {file} is missing: pip install scikit-learn (>= 1.3)"
        )
    with gzip.open(path, "rt") as f:
        return torch.from_numpy(np.loadtxt(f, delimiter=delimiter))


def _digits(data: DataSpec) -> tuple[TensorPairDataset, tuple[float, float] | None]:
    """The digits as ``(N, 1, 8, 8)`` pixels in [0, 1], resized, normalised; with the ``(mean, std)`` used."""
    _check_kwargs("sklearn.digits", data.kwargs, ["normalize"])
    normalize = data.kwargs.get("normalize", True)
    if not isinstance(normalize, bool):
        raise spec_issue("data.kwargs", f"normalize must be true or false, got {normalize!r}")
    table = sklearn_table("digits.csv.gz", delimiter=",")  # (1797, 65): 64 pixels 0..16, then the label
    x = table[:, :-1].reshape(-1, 1, 8, 8).to(torch.float32).div_(16.0)  # (1797, 1, 8, 8), [0, 1]
    y = table[:, -1].to(torch.long)
    x = _shape_images(x, data.dataset, data.image_size, None)
    stats = None
    if normalize:
        mean, std = x.mean(), x.std()
        x = (x - mean) / std
        stats = (float(mean), float(std))
    x = _shape_images(x, data.dataset, None, data.num_channels)
    return TensorPairDataset(x.contiguous(), y), stats


def _diabetes(data: DataSpec) -> TensorPairDataset:
    _check_kwargs("sklearn.diabetes", data.kwargs, ["standardize"])
    standardize = data.kwargs.get("standardize", True)
    if not isinstance(standardize, bool):
        raise spec_issue("data.kwargs", f"standardize must be true or false, got {standardize!r}")
    # raw units, as load_diabetes(scaled=False): age in years, sex 1/2, BMI, blood pressure, six serum values
    x = sklearn_table("diabetes_data_raw.csv.gz").to(torch.float32)  # (442, 10)
    if standardize:
        x = (x - x.mean(dim=0)) / x.std(dim=0)
    y = sklearn_table("diabetes_target.csv.gz").to(torch.float32)  # (442,): disease progression after one year
    return TensorPairDataset(x.contiguous(), y)


def _synthetic(data: DataSpec, seed: int) -> TensorPairDataset:
    _check_kwargs("synthetic", data.kwargs, [])
    g = torch.Generator().manual_seed(seed)
    shape = tuple(data.input_shape)
    x = torch.randn(data.num_samples, *shape, generator=g)
    teacher = torch.randn(math.prod(shape), data.num_classes, generator=g)
    y = (x.flatten(1) @ teacher).argmax(dim=1)
    x = _shape_images(x, data.dataset, data.image_size, data.num_channels)
    return TensorPairDataset(x.contiguous(), y)


def _root(data: DataSpec, spec_dir: Path | str | None) -> Path:
    assert data.root is not None  # DataSpec.check: file datasets name their root
    root = Path(data.root).expanduser()
    if not root.is_absolute() and spec_dir is not None:
        root = Path(spec_dir) / root
    return root.resolve()


def _unknown_dataset(name: str) -> Exception:
    return spec_issue("data.dataset", unknown_dataset(name, installed_torchvision_names("data.dataset")[1]))


def _expected_path(cls: type, root: Path) -> Path:
    if isinstance(getattr(cls, "raw_folder", None), property):  # MNIST family
        return root / cls.__name__ / "raw"
    base = getattr(cls, "base_folder", None)
    return root / base if isinstance(base, str) else root


def _torchvision(data: DataSpec, spec_dir: Path | str | None) -> Dataset:
    cls = dataset_source(data.dataset, spec_dir)
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
            f"{data.dataset} rejected kwargs {data.kwargs}: {first_line(exc)}; "
            f"signature: {cls.__name__}{inspect.signature(cls)}",
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


def _imagefolder(data: DataSpec, spec_dir: Path | str | None) -> Source:
    """``root``/train, and ``root``/val and ``root``/test where they exist, each with the classes of train/."""
    from torchvision.datasets import ImageFolder

    root = _root(data, spec_dir)
    train_dir = root / "train"
    if not train_dir.is_dir():
        raise spec_issue(
            "data.root",
            f"imagefolder expects {train_dir}/<class>/<image> (and optionally val/ and test/ beside it), "
            f"but {train_dir} is not a folder: point data.root at the folder that holds train/",
        )
    transform = ImageTransform(data.image_size, data.num_channels)

    def load(folder: Path) -> ImageFolder:
        try:
            return ImageFolder(str(folder), transform=transform, target_transform=to_long, **data.kwargs)
        except TypeError as exc:
            raise spec_issue("data.kwargs", f"imagefolder rejected kwargs {data.kwargs}: {first_line(exc)}") from None
        except (FileNotFoundError, OSError) as exc:
            raise spec_issue("data.root", f"imagefolder cannot read {folder}: {exc}") from None

    train = load(train_dir)
    held_out = {part: load(root / part) for part in ("val", "test") if (root / part).is_dir()}
    for part, held in held_out.items():
        if held.class_to_idx != train.class_to_idx:
            raise spec_issue(
                "data.root",
                f"{root / part} has classes {sorted(held.class_to_idx)} but {train_dir} has "
                f"{sorted(train.class_to_idx)}: use the same class folders",
            )
    return Source(train, held_out.get("val"), held_out.get("test"), explicit="val" in held_out)


def _factory(data: DataSpec, spec_dir: Path | str | None) -> Source:
    factory = resolve_factory(data.dataset, spec_dir, "data.dataset")
    signature: inspect.Signature | str = "(...)"  # when even the signature cannot be read
    try:
        signature = inspect.signature(factory)
        signature.bind(**data.kwargs)
    except TypeError as exc:
        called = f"{getattr(factory, '__name__', 'factory')}{signature}"
        message = f"{data.dataset!r} rejected kwargs {data.kwargs}: {first_line(exc)}; signature: {called}"
        raise spec_issue("data.kwargs", message) from None
    except ValueError:  # no signature (a builtin or C callable): the call decides
        pass
    try:
        result = factory(**data.kwargs)
    except Exception as exc:  # the factory's own failure, not the spec's
        located = user_code_error(exc, "data.dataset")
        if located is None:
            raise
        raise located from exc
    if isinstance(result, (tuple, list)) and len(result) in (2, 3):
        train, *held_out = result
        if not _is_dataset(train) or not all(part is None or _is_dataset(part) for part in held_out):
            kind = "(Dataset, Dataset | None)" if len(result) == 2 else "(Dataset, Dataset | None, Dataset | None)"
            raise spec_issue("data.dataset", f"{data.dataset!r} returned a tuple that is not {kind}")
        val, test = (*held_out, None)[:2]
        return Source(train, val, test, explicit=True)
    if not _is_dataset(result):
        raise spec_issue(
            "data.dataset",
            f"{data.dataset!r} returned a {type(result).__name__}, not a Dataset or a (train, val[, test]) tuple",
        )
    return Source(result)


def _is_dataset(obj: object) -> bool:
    if isinstance(obj, Dataset):
        return True
    return hasattr(obj, "__getitem__") and hasattr(obj, "__len__") and not isinstance(obj, (str, bytes, dict))


@dataclass(frozen=True)
class Source:
    """What ``data.dataset`` gives before any split: the training set, and the source's own validation and test sets
    where it has them. ``explicit``: its validation set is the one used (none is split off the training set);
    ``normalization`` is the inputs' ``(mean, std)`` or ``None``."""

    train: Dataset
    val: Dataset | None = None
    test: Dataset | None = None
    explicit: bool = False
    normalization: tuple[float, float] | None = None


def load_source(data: DataSpec, spec_dir: Path | str | None) -> Source:
    """The samples of ``data.dataset`` (:class:`Source`). Raises SpecError as
    :func:`runner.training.data.build_datasets`."""
    name = data.dataset
    if name == "sklearn.digits":
        digits, stats = _digits(data)
        return Source(digits, normalization=stats)
    if name == "sklearn.diabetes":
        return Source(_diabetes(data))
    if name == "synthetic":
        return Source(_synthetic(data, data.split_seed))
    if name == "imagefolder":
        return _imagefolder(data, spec_dir)
    if ":" in name:
        return _factory(data, spec_dir)
    if name.startswith("torchvision."):
        return Source(_torchvision(data, spec_dir))
    raise _unknown_dataset(name)


def source_text(data: DataSpec, spec_dir: Path | str | None) -> str:
    """Where the samples are read from, for the run's dataset inputs."""
    if data.dataset == "sklearn.digits":
        return "sklearn.datasets.load_digits"
    if data.dataset == "sklearn.diabetes":
        return "sklearn.datasets.load_diabetes"
    if data.root is not None and (data.dataset == "imagefolder" or data.dataset.startswith("torchvision.")):
        return str(_root(data, spec_dir))
    return str(data.dataset)


def dataset_source(name: str, spec_dir: Path | str | None) -> Any:
    """The class or factory that builds ``data.dataset`` from files, found without calling it (``None`` for the
    in-memory built-ins); SpecError with a did-you-mean for an unknown name or a factory that does not import."""
    if name in IN_MEMORY:
        return None
    if ":" in name:
        return resolve_factory(name, spec_dir, "data.dataset")
    tvd = torchvision_package("data.dataset").datasets

    if name == "imagefolder":
        return tvd.ImageFolder
    cls_name = name.removeprefix("torchvision.")
    cls = getattr(tvd, cls_name, None) if name.startswith("torchvision.") else None
    if cls_name in NOT_DATASETS or not inspect.isclass(cls) or not issubclass(cls, Dataset):
        raise _unknown_dataset(name)
    return cls
