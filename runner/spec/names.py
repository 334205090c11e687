"""Model and dataset names a spec may use, checked without importing torch: built-ins, torchvision, factories.

Built-in names are the tables below. torchvision's builder and dataset names come from
``torchvision_names.json`` beside this module, generated from the installed torchvision by
``python -m runner.training.models`` (a test checks that it matches); when another torchvision
version is installed, a name missing from that list is left to ``runner exec``, which asks torchvision.
A ``pkg.module:factory`` name is checked for a module that can be found where ``runner exec`` looks
(the spec's folder, the working directory, installed packages) without importing it; the attribute is
checked when the module is imported (:func:`runner.training.models.resolve_factory`).
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from runner.errors import did_you_mean, with_hint

BUILTIN_MODELS = ("mlp", "cnn")
BUILTIN_DATASETS = ("sklearn.digits", "sklearn.diabetes", "synthetic", "imagefolder")
NOT_DATASETS = frozenset({"VisionDataset", "DatasetFolder", "ImageFolder", "wrap_dataset_for_transforms_v2"})
_TV_PREFIXES = ("torchvision.models.", "torchvision.")
GENERATED = Path(__file__).with_name("torchvision_names.json")


def torchvision_bare(name: str) -> str | None:
    """``resnet18`` of ``torchvision.resnet18`` or ``torchvision.models.resnet18``; ``None`` for other names."""
    for prefix in _TV_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return None


@functools.cache
def generated() -> dict[str, Any]:
    """``{"version", "models", "datasets"}`` of :data:`GENERATED`."""
    data: dict[str, Any] = json.loads(GENERATED.read_text(encoding="utf-8"))
    return data


def torchvision_names() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """torchvision's model builder names and dataset class names, sorted, as generated."""
    return tuple(generated()["models"]), tuple(generated()["datasets"])


def _installed_differs() -> bool:
    """Whether the installed torchvision is not the version the generated list was made from."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchvision").partition("+")[0] != generated()["version"]
    except PackageNotFoundError:
        return False


def _torchvision_knows(bare: str | None, models: bool) -> bool:
    """Whether torchvision has ``bare``: in the generated list, or maybe in another installed version."""
    return bare is not None and (bare in torchvision_names()[0 if models else 1] or _installed_differs())


def model_problem(name: str, spec_dir: Path | None) -> str | None:
    """What is wrong with ``model.name``, or ``None``; a factory's module is only looked for with ``spec_dir``."""
    if name in BUILTIN_MODELS:
        return None
    if ":" in name:
        return factory_problem(name, spec_dir)
    if _torchvision_knows(torchvision_bare(name), models=True):
        return None
    return unknown_model(name, torchvision_names()[0])


def dataset_problem(name: str, spec_dir: Path | None) -> str | None:
    """What is wrong with ``data.dataset``, or ``None``; a factory's module is only looked for with ``spec_dir``."""
    if name in BUILTIN_DATASETS:
        return None
    if ":" in name:
        return factory_problem(name, spec_dir)
    if name.startswith("torchvision.") and _torchvision_knows(name.removeprefix("torchvision."), models=False):
        return None
    return unknown_dataset(name, torchvision_names()[1])


def unknown_model(name: str, models: tuple[str, ...]) -> str:
    """The message for an unknown ``model.name``, with the closest names (``models``: torchvision's builders)."""
    choices = list(BUILTIN_MODELS) + [f"torchvision.{n}" for n in models]
    hint = did_you_mean(name, choices, n=3)
    if not hint:  # e.g. "resnet18" or "torchvision.resnet_18": match the bare builder name
        bare = torchvision_bare(name) or name.rpartition(".")[2]
        hint = did_you_mean(bare, {n: f"torchvision.{n}" for n in models}, n=3)
    return (
        with_hint(f"unknown model {name!r}", hint) + f"; use a built-in ({', '.join(BUILTIN_MODELS)}), "
        '"torchvision.<builder>" (a name from torchvision.models.list_models(), e.g. torchvision.resnet18) '
        'or "pkg.module:factory"'
    )


def unknown_dataset(name: str, datasets: tuple[str, ...]) -> str:
    """The message for an unknown ``data.dataset``, with the closest names (``datasets``: torchvision's classes)."""
    choices = list(BUILTIN_DATASETS) + [f"torchvision.{n}" for n in datasets]
    hint = did_you_mean(name, choices, n=3)  # ignoring case, suggesting the real spelling
    if name.lower().startswith("torchvision.") or not hint:  # compare class names, not the shared prefix
        hint = did_you_mean(name.lower().removeprefix("torchvision."), {n: f"torchvision.{n}" for n in datasets}, n=3)
    return (
        with_hint(f"unknown dataset {name!r}", hint) + f'; use {", ".join(BUILTIN_DATASETS)}, "torchvision.<Name>" '
        '(a class of torchvision.datasets, e.g. torchvision.MNIST) or "pkg.module:factory"'
    )


def import_path_problem(target: str) -> str | None:
    """Why ``target`` is not of the form ``pkg.module:attr`` (``attr`` may be dotted), or ``None``."""
    module_name, _, attr = target.partition(":")
    parts = module_name.split(".") + attr.split(".")
    if not module_name or not attr or not all(p.isidentifier() for p in parts):
        return f'{target!r} is not an import path: write "pkg.module:factory"'
    return None


def factory_problem(target: str, spec_dir: Path | None) -> str | None:
    """Why ``pkg.module:factory`` cannot be imported, found without importing anything; ``None`` when it can.

    The top package is looked for in ``spec_dir`` and the working directory (which ``runner exec``
    puts first on ``sys.path``), then as an installed package; each submodule in its package's folders.
    Without ``spec_dir`` only the form of ``target`` is checked.
    """
    problem = import_path_problem(target)
    if problem is not None or spec_dir is None:
        return problem
    module_name = target.partition(":")[0]
    top, *subs = module_name.split(".")
    folders = [str(Path(spec_dir).resolve()), os.getcwd()]
    found = importlib.machinery.PathFinder.find_spec(top, folders)
    if found is None:
        try:
            found = importlib.util.find_spec(top)
        except (ImportError, ValueError):  # a module already imported without a spec
            found = None
    for depth in range(len(subs)):
        locations = found.submodule_search_locations if found is not None else None
        if not locations:
            break
        found = importlib.machinery.PathFinder.find_spec(".".join([top, *subs[: depth + 1]]), list(locations))
    if found is not None:
        return None
    import pkgutil

    nearby = [m.name for m in pkgutil.iter_modules(folders)]
    return (
        with_hint(
            f"cannot import module {module_name!r} of {target!r}: not found in the spec folder {folders[0]}, "
            f"working directory {folders[1]} or installed packages",
            did_you_mean(top, nearby),
        )
        + f" (check the spelling, or put {top} next to the spec file)"
    )
