"""Model registry: turn ``[model]`` (a torchvision builder, a built-in or ``pkg.module:factory``) into an nn.Module.

Names:

* ``torchvision.<builder>`` (also ``torchvision.models.<builder>``): any name of
  ``torchvision.models.list_models()``, built with ``weights=None`` (and
  ``weights_backbone=None`` where the builder has it) unless the kwargs say otherwise, so
  nothing is downloaded by default.
* ``mlp``: Flatten -> (Linear -> ReLU [-> Dropout]) per hidden size -> Linear. No
  batch-statistics layers, so ``none`` and ``ddp`` runs agree step by step.
* ``cnn``: three 3x3 conv blocks (widths ``width``, ``2*width``, ``4*width``; strides 1, 2, 2),
  optional BatchNorm, global average pooling, Linear.
* ``pkg.module:factory``: ``factory(**kwargs)`` must return an ``nn.Module``; the spec's
  folder and the working directory are importable.

Parameters are initialised from torch's global RNG, so a model is a pure function of the
torch seed set just before building it. ``runner validate`` checks names without this module
(``runner.spec.names``, from the list ``write_torchvision_names`` generates:
``python -m runner.training.models``); the checks here ask the installed torchvision.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import math
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from runner.errors import (
    SpecError,
    SpecIssue,
    UserCodeError,
    did_you_mean,
    first_line,
    user_code_error,
    with_hint,
)
from runner.spec.names import (
    BUILTIN_MODELS,
    GENERATED,
    NOT_DATASETS,
    factory_problem,
    import_path_problem,
    torchvision_bare,
    unknown_model,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from runner.spec.schema import ModelSpec


def spec_issue(key: str, message: str) -> SpecError:
    """Return a :class:`SpecError` for ``key`` without a file position (the caller locates it)."""
    return SpecError(SpecIssue(file=None, line=None, key=key, message=message))


def make_importable(spec_dir: Path | str | None) -> None:
    """Put the spec's folder (first) and the working directory on ``sys.path`` if missing."""
    for folder in (os.getcwd(), spec_dir):
        if folder is None:
            continue
        path = str(Path(folder).resolve())
        if path not in sys.path:
            sys.path.insert(0, path)


def resolve_factory(target: str, spec_dir: Path | str | None, key: str) -> Callable[..., Any]:
    """Import ``"pkg.module:attr"`` (``attr`` may be dotted) with ``spec_dir`` importable, and return the callable.

    Raises SpecError at ``key`` for a malformed path, a module that does not import, or a missing or uncallable
    attribute.
    """
    malformed = import_path_problem(target)
    if malformed is not None:
        raise spec_issue(key, malformed)
    module_name, _, attr = target.partition(":")
    make_importable(spec_dir)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name and (module_name == exc.name or module_name.startswith(exc.name + "."))
        problem = factory_problem(target, Path(spec_dir or os.getcwd())) if missing else None  # where it looked
        raise spec_issue(key, problem or f"importing module {module_name!r} of {target!r} failed: {exc}") from None
    except Exception as exc:  # a user module that fails on import: report, never a traceback
        raise spec_issue(
            key, f"importing module {module_name!r} of {target!r} failed: {type(exc).__name__}: {exc}"
        ) from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            hint = did_you_mean(part, names, n=3)
            if not hint:  # nothing close: the callables it does define, and where it was read from
                callables = ", ".join([n for n in names if callable(getattr(obj, n, None))][:10]) or "no callable"
                hint = f"{getattr(module, '__file__', module_name)} defines {callables}"
            raise spec_issue(key, with_hint(f"module {module_name!r} has no attribute {attr!r}", hint)) from None
        obj = getattr(obj, part)
    if not callable(obj):
        raise spec_issue(key, f"{target!r} is a {type(obj).__name__}, not a callable factory")
    return obj


def torchvision_package(key: str = "model.name") -> Any:
    """``torchvision`` with its models and datasets imported; SpecError at ``key`` when missing or broken."""
    try:
        import torchvision
        import torchvision.datasets
        import torchvision.models
    except Exception as exc:  # a mismatched build fails with RuntimeError ("operator torchvision::nms does not exist")
        import torch

        raise spec_issue(
            key,
            f"torchvision cannot be imported ({type(exc).__name__}: {first_line(exc)}): install the torchvision "
            f"built for torch {torch.__version__}, from the index torch came from "
            "(pip install --force-reinstall torchvision==<the matching version>)",
        ) from None
    return torchvision


def installed_torchvision_names(key: str = "model.name") -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The installed torchvision's model builder names and dataset class names, sorted (imports torchvision)."""
    torchvision = torchvision_package(key)
    datasets = (n for n in torchvision.datasets.__all__ if n not in NOT_DATASETS)
    return (
        tuple(sorted(torchvision.models.list_models())),
        tuple(sorted(n for n in datasets if inspect.isclass(getattr(torchvision.datasets, n, None)))),
    )


def write_torchvision_names(path: Path = GENERATED) -> Path:
    """Write ``runner/spec/torchvision_names.json`` from the installed torchvision (``python -m
    runner.training.models``)."""
    models, datasets = installed_torchvision_names()

    data = {"version": version("torchvision").partition("+")[0], "models": models, "datasets": datasets}
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return path


def _unknown_model(name: str) -> SpecError:
    return spec_issue("model.name", unknown_model(name, installed_torchvision_names()[0]))


def check_model_name(name: str, spec_dir: Path | str | None = None) -> None:
    """Check ``model.name`` names a buildable model without building it; SpecError with a did-you-mean otherwise."""
    if name in BUILTIN_MODELS:
        return
    if ":" in name:
        resolve_factory(name, spec_dir, "model.name")
        return
    bare = torchvision_bare(name)
    if bare is not None and bare in installed_torchvision_names()[0]:
        return
    raise _unknown_model(name)


def _plain_signature(fn: Callable[..., Any], drop: Sequence[str] = ()) -> str | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    params = [p.replace(annotation=p.empty) for n, p in sig.parameters.items() if n not in drop]
    return str(sig.replace(parameters=params, return_annotation=sig.empty))


def _signature(fn: Callable[..., Any]) -> str:
    """``name(params)`` without annotations; for ``**kwargs`` builders also the class they feed."""
    text = f"{getattr(fn, '__name__', 'factory')}{_plain_signature(fn) or '(...)'}"
    try:
        sig = inspect.signature(fn, eval_str=True)
    except Exception:  # unresolvable annotations: show what we have
        return text
    takes_var_kw = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    target = sig.return_annotation
    if takes_var_kw and inspect.isclass(target):
        inner = _plain_signature(target.__init__, drop=("self",))
        if inner:
            text += f"; its **kwargs go to {target.__name__}{inner}"
    return text


def build_mlp(
    *, in_features: int, num_classes: int = 10, hidden: Sequence[int] = (128, 64), dropout: float = 0.0
) -> torch.nn.Module:
    """An ``nn.Sequential`` MLP from flattened ``(N, *shape)`` to ``(N, num_classes)``; ``hidden = []`` is linear.

    Raises ValueError for a size that is not a positive integer or a ``dropout`` outside ``[0, 1)``.
    """
    from torch import nn

    _positive("in_features", in_features)
    _positive("num_classes", num_classes)
    if isinstance(hidden, (str, bytes)) or not isinstance(hidden, Sequence):
        raise ValueError(f"hidden must be a list of layer widths, got {hidden!r}")
    for h in hidden:
        _positive("hidden", h)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
    layers: list[nn.Module] = [nn.Flatten(1)]
    width = in_features
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        if dropout:
            layers.append(nn.Dropout(dropout))
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def build_cnn(
    *, in_channels: int = 1, num_classes: int = 10, width: int = 32, batch_norm: bool = False
) -> torch.nn.Module:
    """A small convolutional classifier ``(N, C, H, W)`` -> ``(N, num_classes)``; channels ``width``, ``2*width``,
    ``4*width``. Raises ValueError for a bad size or a ``batch_norm`` that is no bool."""
    from torch import nn

    _positive("in_channels", in_channels)
    _positive("num_classes", num_classes)
    _positive("width", width)
    if not isinstance(batch_norm, bool):
        raise ValueError(f"batch_norm must be true or false, got {batch_norm!r}")
    layers: list[nn.Module] = []
    channels = in_channels
    for i, out in enumerate((width, 2 * width, 4 * width)):
        layers.append(nn.Conv2d(channels, out, 3, stride=1 if i == 0 else 2, padding=1, bias=not batch_norm))
        if batch_norm:
            layers.append(nn.BatchNorm2d(out))
        layers.append(nn.ReLU())
        channels = out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Linear(channels, num_classes)]
    return nn.Sequential(*layers)


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if value >= 2**31:
        raise ValueError(f"{name} must be below 2**31 (a layer that wide does not fit in any memory), got {value}")


DATA_REF = re.compile(r"^\$\{data\.([A-Za-z_]\w*)\}$")  # a model.kwargs value "${data.num_classes}"


def resolve_data_refs(kwargs: dict[str, Any], info: object, train: object) -> dict[str, Any]:
    """``kwargs`` with each ``"${data.NAME}"`` replaced by what the data knows, so no number is copied by hand from
    data to model: a field of :class:`~runner.training.data.DatasetInfo` (``num_classes``, ``input_shape``,
    ``num_train``, ...), else an attribute of the training set's own dataset (a vocabulary's size). SpecError at
    ``model.kwargs.<key>`` for a name the data does not know."""
    source = train
    while hasattr(source, "dataset") and hasattr(source, "indices"):  # a Subset of the split: its dataset's own
        source = source.dataset
    resolved = dict(kwargs)
    for key, value in kwargs.items():
        match = DATA_REF.match(value) if isinstance(value, str) else None
        if match is None:
            continue
        name = match.group(1)
        found = getattr(info, name, getattr(source, name, None))
        if found is None:
            known = "num_classes, input_shape, num_train, num_val, num_test"
            raise spec_issue(
                f"model.kwargs.{key}",
                f"{value}: the data has no {name!r}; known: {known} and the attributes of {type(source).__name__}",
            )
        resolved[key] = list(found) if isinstance(found, tuple) else found
    return resolved


def with_data(model_spec: ModelSpec, info: object, train: object) -> ModelSpec:
    """``[model]`` with its ``"${data.NAME}"`` kwargs resolved (:func:`resolve_data_refs`)."""
    return model_spec.model_copy(update={"kwargs": resolve_data_refs(model_spec.kwargs, info, train)})


def build_model(
    model_spec: ModelSpec,
    spec_dir: Path | str | None,
    *,
    input_shape: Sequence[int] | None = None,
    num_classes: int | None = None,
) -> torch.nn.Module:
    """Build the model of ``[model]`` on CPU, initialised from torch's global RNG.

    The data fills kwargs left out: ``mlp`` gets ``in_features`` and ``num_classes``, ``cnn`` ``in_channels`` and
    ``num_classes``, torchvision classifiers ``num_classes`` without pretrained weights; factories get their kwargs
    only. Raises SpecError: An unknown name (did-you-mean), a factory that fails or returns no ``nn.Module``, kwargs the
    builder rejects (with its signature), or sizes that cannot be inferred."""
    import torch

    name: str = model_spec.name
    shape = tuple(int(d) for d in input_shape) if input_shape is not None else None
    builder, kwargs = _builder_and_kwargs(name, dict(model_spec.kwargs), spec_dir, shape, num_classes or None)
    try:
        inspect.signature(builder).bind(**kwargs)
    except TypeError as exc:
        raise _bad_kwargs(name, builder, kwargs, exc) from None
    except ValueError:  # no signature available (builtins, C callables): let the call decide
        pass
    try:
        with _exits_refused():
            model = builder(**kwargs)
    except _ProcessExit as exc:
        raise UserCodeError(
            f"model.name: {name!r} called {exc.call} at {exc.where}: a factory returns a torch.nn.Module; ending the "
            "process there leaves no word of why (`runner plan` exited with its code and said nothing)"
        ) from None
    except Exception as exc:
        located = user_code_error(exc, "model.name") if ":" in name else None  # the factory's own failure
        if located is not None:
            raise located from exc
        if not isinstance(exc, (TypeError, ValueError, RuntimeError)):  # RuntimeError: sizes torch cannot allocate
            raise
        raise _bad_kwargs(name, builder, kwargs, exc) from None
    if not isinstance(model, torch.nn.Module):
        raise spec_issue("model.name", f"{name!r} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


class _ProcessExit(Exception):
    """A factory asked to end the process: ``call`` (``os._exit(3)``, ``sys.exit(3)``) at ``where`` (file:line)."""

    def __init__(self, call: str, where: str) -> None:
        super().__init__(call, where)
        self.call = call
        self.where = where


@contextlib.contextmanager
def _exits_refused() -> Iterator[None]:
    """``os._exit`` and ``sys.exit`` inside the block raise :class:`_ProcessExit` instead of ending the process."""
    real = os._exit

    def refuse(status: int) -> NoReturn:
        caller = sys._getframe(1)
        raise _ProcessExit(f"os._exit({status})", f"{caller.f_code.co_filename}:{caller.f_lineno}")

    os._exit = refuse
    try:
        yield
    except SystemExit as exc:
        *_, (frame, line) = traceback.walk_tb(exc.__traceback__)
        raise _ProcessExit(f"sys.exit({exc.code})", f"{frame.f_code.co_filename}:{line}") from None
    finally:
        os._exit = real


def _builder_and_kwargs(
    name: str,
    kwargs: dict[str, Any],
    spec_dir: Path | str | None,
    shape: tuple[int, ...] | None,
    classes: int | None,
) -> tuple[Callable[..., Any], dict[str, Any]]:
    """The builder ``name`` refers to, and its kwargs with the dataset's hints filled in."""
    if name == "mlp":
        if "in_features" not in kwargs:
            if shape is None:
                raise spec_issue(
                    "model.kwargs", "mlp needs in_features (features of one flattened sample): set kwargs.in_features"
                )
            kwargs["in_features"] = math.prod(shape)
        return build_mlp, _with_classes(kwargs, classes)
    if name == "cnn":
        if "in_channels" not in kwargs and shape is not None:
            if len(shape) != 3:
                raise spec_issue(
                    "model.name",
                    f"cnn needs image samples of shape (C, H, W) but the dataset gives {list(shape)}: "
                    "use mlp, or an image dataset",
                )
            kwargs["in_channels"] = shape[0]
        return build_cnn, _with_classes(kwargs, classes)
    if ":" in name:
        return resolve_factory(name, spec_dir, "model.name"), kwargs
    return _torchvision_builder(name, kwargs, classes)


def _with_classes(kwargs: dict[str, Any], classes: int | None) -> dict[str, Any]:
    if classes and "num_classes" not in kwargs:
        kwargs["num_classes"] = classes
    return kwargs


def _torchvision_builder(
    name: str, kwargs: dict[str, Any], classes: int | None
) -> tuple[Callable[..., Any], dict[str, Any]]:
    """A torchvision builder with ``weights=None`` (nothing downloaded) unless the kwargs say otherwise."""
    bare = torchvision_bare(name)
    if bare is None or bare not in installed_torchvision_names()[0]:
        raise _unknown_model(name)
    models = torchvision_package().models
    builder = models.get_model_builder(bare)
    kwargs.setdefault("weights", None)
    if "weights_backbone" in parameter_names(builder):
        kwargs.setdefault("weights_backbone", None)
    classifier = bare in models.list_models(module=models)
    if classifier and kwargs["weights"] is None:
        _with_classes(kwargs, classes)
    return builder, kwargs


def parameter_names(fn: Callable[..., Any]) -> set[str]:
    """The parameter names of ``fn``; none for a callable without a signature (a builtin or C function)."""
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _bad_kwargs(name: str, builder: Callable[..., Any], kwargs: dict[str, Any], exc: Exception) -> SpecError:
    given = ", ".join(f"{k} = {v!r}" for k, v in kwargs.items()) or "none"
    return spec_issue(
        "model.kwargs",
        f"{name!r} rejected the kwargs ({given}): {first_line(exc)}; signature: {_signature(builder)}",
    )


if __name__ == "__main__":  # pragma: no cover
    print(f"wrote {write_torchvision_names()}")
