"""The ``[model]`` and ``[data]`` tables: which network is built and what it trains on (``batch_size`` is global).

Their cross-key rule is :func:`runner.spec.rules.check_data`; the datasets and loaders they describe are
built by :mod:`runner.training.data` and :mod:`runner.training.loaders`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, ValidationInfo, field_validator

from runner.spec import names, rules
from runner.spec.table import INT64_LIMIT, SpecTable

TorchSize = Annotated[int, Field(lt=INT64_LIMIT)]  # a tensor dimension: torch takes a C int64


class ModelSpec(SpecTable):
    """``[model]``: which network to build."""

    name: str = Field(
        min_length=1,
        description=(
            "Model to build: a torchvision builder (`torchvision.resnet18`), a built-in "
            "(`mlp`, `cnn`) or an import path `pkg.module:factory` returning an nn.Module."
        ),
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments passed to the builder, e.g. `{ num_classes = 10 }`. Default: none.",
    )
    output: str | int | None = Field(
        default=None, description="The prediction in a dict, dataclass or tuple output: a key, attribute or index."
    )

    @field_validator("name")
    @classmethod
    def _known_model(cls, name: str, info: ValidationInfo) -> str:
        return _known(names.model_problem, name, info)


class DataSpec(SpecTable):
    """``[data]``: dataset, split and loader settings. ``batch_size`` is global."""

    dataset: str = Field(
        min_length=1,
        description=(
            "Dataset: `sklearn.digits` or `sklearn.diabetes` (shipped with scikit-learn), `torchvision.<Name>` (e.g. "
            "`torchvision.MNIST`, read from `root`), `imagefolder` (`root`/train and `root`/val), `synthetic` "
            "(seeded random tensors) or `pkg.module:factory` (samples `(x, y)` or dicts of tensors)."
        ),
    )
    root: str | None = Field(
        default=None,
        description=(
            "Folder holding the data for torchvision and imagefolder datasets; a relative path is relative to "
            "the file that writes it, or to the current directory when given with --set. Default: none."
        ),
    )
    download: bool = Field(
        default=False,
        description=(
            "Let torchvision download missing files into `root`. Default: false (runs never touch the network)."
        ),
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra keyword arguments for the dataset builder or factory. Default: none.",
    )
    target: str | None = Field(default=None, min_length=1, description='Dict samples: the target key, e.g. "labels".')
    image_size: int | None = Field(
        default=None,
        ge=1,
        lt=INT64_LIMIT,
        description=(
            "Resize images to `image_size` x `image_size` pixels (e.g. 32 for ResNet on digits). Default: native size."
        ),
    )
    num_channels: int | None = Field(
        default=None,
        ge=1,
        lt=INT64_LIMIT,
        description="Repeat grayscale images to this many channels (3 for ImageNet-style models). Default: native.",
    )
    batch_size: int = Field(
        ge=1,
        description=(
            "GLOBAL batch size: samples per optimizer step across all devices and processes. "
            "dp scatters it; ddp loads batch_size / world_size per rank (must divide)."
        ),
    )
    eval_batch_size: int | None = Field(
        default=None, ge=1, description="Global batch size for evaluation. Default: `batch_size`."
    )
    val_fraction: float = Field(
        default=0.2,
        ge=0.0,
        lt=1.0,
        description=(
            "Fraction of the training set held out for validation (drawn with `split_seed`); 0 disables. Default: 0.2."
        ),
    )
    split_seed: int = Field(
        default=0,
        ge=0,
        lt=INT64_LIMIT,
        description=(
            "Seeds the validation split (and the samples of `synthetic`), apart from `seed`: runs that change "
            "`seed` score on the same validation samples; 0 <= split_seed < 2**63 (a torch.Generator seed). "
            "Default: 0."
        ),
    )
    shuffle: bool = Field(default=True, description="Reshuffle training samples every epoch. Default: true.")
    drop_last: bool = Field(
        default=False, description="Drop the last incomplete training batch of each epoch. Default: false."
    )
    num_workers: int = Field(default=0, ge=0, description="DataLoader worker processes per rank. Default: 0.")
    pin_memory: bool = Field(
        default=False, description="Pin host memory for faster host-to-GPU copies. Default: false."
    )
    persistent_workers: bool = Field(
        default=False,
        description="Keep DataLoader workers alive between epochs (needs num_workers > 0). Default: false.",
    )
    num_samples: int = Field(
        default=1024, ge=1, lt=INT64_LIMIT, description="`synthetic` only: number of samples. Default: 1024."
    )
    input_shape: list[TorchSize] = Field(
        default_factory=lambda: [64],
        min_length=1,
        description="`synthetic` only: shape of one sample, e.g. [3, 32, 32]. Default: [64].",
    )
    num_classes: int = Field(
        default=10, ge=2, lt=INT64_LIMIT, description="`synthetic` only: number of classes. Default: 10."
    )

    rule = rules.check_data

    @field_validator("dataset")
    @classmethod
    def _known_dataset(cls, name: str, info: ValidationInfo) -> str:
        return _known(names.dataset_problem, name, info)


def _known(problem_of: Callable[[str, Path | None], str | None], name: str, info: ValidationInfo) -> str:
    """Check a model or dataset name (:mod:`runner.spec.names`) when validating a spec file.

    A spec file is validated with ``context={"spec_dir": its folder}`` (:func:`runner.spec.loading.load_spec`);
    a spec validated without one (a dict, a run's stored spec) has its names checked when built.
    """
    if not isinstance(info.context, dict) or "spec_dir" not in info.context:
        return name
    problem = problem_of(name, info.context["spec_dir"])
    if problem is not None:
        raise ValueError(problem)
    return name
