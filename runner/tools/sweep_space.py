"""What a sweep is, without running it: definition (``[sweep]`` + ``--grid``/``--random``), trials, results, report."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from runner.errors import SpecError, SpecIssue, UsageError
from runner.spec.schema import SweepParam, SweepSpec

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

# Swept keys may not change where or how a trial is recorded: every trial must be a
# child of the parent run, in the parent's store and experiment.
FORBIDDEN_PREFIXES = ("sweep", "tracking")
_RANDOM_KINDS = {
    "": "uniform",
    "uniform": "uniform",
    "log": "log_uniform",
    "log_uniform": "log_uniform",
    "int": "int_uniform",
    "int_uniform": "int_uniform",
}


@dataclass(frozen=True)
class SweepDefinition:
    """What a sweep tries, after the spec's ``[sweep]`` and the command line are merged.

    Attributes:
        method: ``"grid"`` (cartesian product, first ``num_trials``) or ``"random"``.
        params: Swept dotted keys in a stable order (spec order, then command line), each
            with explicit values or a range.
        num_trials: Trial budget (required for random; a cap for grid), or ``None``.
        seed: Seed of random sampling.
        metric: Metric that ranks trials, e.g. ``val/accuracy``.
        goal: ``"max"`` or ``"min"``.
    """

    method: str
    params: tuple[tuple[str, SweepParam], ...]
    num_trials: int | None
    seed: int
    metric: str
    goal: str

    def describe(self, key: str) -> str:
        """Return the definition of one swept key, e.g. ``[0.1, 0.01]`` or ``log_uniform(1e-05, 0.01)``."""
        param = dict(self.params)[key]
        if param.values is not None:
            return json.dumps(param.values, default=str)
        return f"{param.distribution}({param.low!r}, {param.high!r})"

    def to_json(self) -> dict[str, Any]:
        """JSON-able form; :meth:`from_json` reads it back."""
        return {
            "method": self.method,
            "num_trials": self.num_trials,
            "seed": self.seed,
            "metric": self.metric,
            "goal": self.goal,
            "params": {k: p.model_dump(exclude_none=True, exclude_defaults=True) for k, p in self.params},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SweepDefinition:
        """Rebuild a definition written by :meth:`to_json`.

        Raises:
            ValueError: ``data`` is not a sweep definition.
        """
        try:
            params = tuple((k, SweepParam.model_validate(v)) for k, v in data["params"].items())
            return cls(data["method"], params, data["num_trials"], data["seed"], data["metric"], data["goal"])
        except (KeyError, TypeError, AttributeError, ValidationError) as exc:
            raise ValueError(f"not a sweep definition: {exc}") from None

    def same_trials(self, other: SweepDefinition) -> bool:
        """Whether both definitions expand to the same trials (metric and goal may differ)."""
        return (self.method, self.params, self.num_trials, self.seed) == (
            other.method,
            other.params,
            other.num_trials,
            other.seed,
        )


@dataclass(frozen=True)
class Trial:
    """One point of a sweep.

    Attributes:
        index: 0-based position in the sweep (tag ``runner.sweep.trial``).
        values: Dotted key -> value, in the definition's key order.
    """

    index: int
    values: dict[str, Any]

    def overrides(self) -> list[str]:
        """The ``--set`` strings that make the base spec this trial, e.g. ``["optim.lr=0.1"]``."""
        return [f"{key}={toml_value(value)}" for key, value in self.values.items()]

    def label(self) -> str:
        """Short text for messages: ``trial 3 (optim.lr=0.01, seed=2)``."""
        inner = ", ".join(f"{k}={toml_value(v)}" for k, v in self.values.items())
        return f"trial {self.index} ({inner})"


@dataclass
class TrialResult:
    """Outcome of one trial.

    Attributes:
        index: Trial number (0-based), as in the tag ``runner.sweep.trial``.
        values: Dotted key -> value of this trial.
        run_id: Its child MLflow run, or ``None`` when it failed before the run existed.
        status: ``FINISHED``, ``FAILED`` or ``KILLED``.
        metric_value: Last value of the sweep's metric, or ``None`` (failed, or not logged).
        error: What went wrong, for trials that did not finish.
        reused: Taken from an earlier run of this sweep (``--resume``), not run again.
    """

    index: int
    values: dict[str, Any]
    run_id: str | None
    status: str
    metric_value: float | None = None
    error: str | None = None
    reused: bool = False

    def to_json(self) -> dict[str, Any]:
        """JSON-able form."""
        return dataclasses.asdict(self)


def toml_value(value: Any) -> str:
    """Write one value as TOML value text (what ``--set key=<text>`` reads back to ``value``).

    Args:
        value: A bool, int, float, str, list or dict (dates are written by tomllib's rules).

    Raises:
        TypeError: The value has no TOML form (e.g. ``None``).
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(str(k))} = {toml_value(v)}" for k, v in value.items()) + " }"
    if hasattr(value, "isoformat"):
        return value.isoformat()
    raise TypeError(f"{value!r} ({type(value).__name__}) has no TOML form")


def parse_grid(entry: str) -> tuple[str, SweepParam]:
    """Read ``--grid KEY=V1,V2,...``; values are TOML values (bare words are strings).

    ``optim.lr=0.1,0.01`` -> floats, ``model.kwargs.hidden=[16],[32,32]`` -> lists,
    ``optim.name=adam,sgd`` -> strings.

    Raises:
        UsageError: No ``=``, an empty key, or no values.
    """
    key, text = _split(entry, "--grid", "KEY=V1,V2,...", "optim.lr=0.1,0.01")
    try:
        values = tomllib.loads(f"v = [{text}]")["v"]
    except tomllib.TOMLDecodeError:
        values = [_scalar(part.strip()) for part in text.split(",") if part.strip()]
    if not values:
        raise UsageError(f"--grid {entry}: no values after '=' (expected e.g. --grid {key}=0.1,0.01)")
    return key, _param(f"--grid {entry}", values=values)


def parse_random(entry: str) -> tuple[str, SweepParam]:
    """Read ``--random KEY=LOW:HIGH[:log|:int]`` (uniform floats unless ``log`` or ``int``).

    Raises:
        UsageError: Malformed entry, bounds that are not numbers, ``LOW >= HIGH``, or
            ``log`` with ``LOW <= 0``.
    """
    key, text = _split(entry, "--random", "KEY=LOW:HIGH[:log|:int]", "optim.lr=1e-4:1e-1:log")
    parts = text.split(":")
    kind = parts[2].strip().lower() if len(parts) == 3 else ""
    if len(parts) not in (2, 3) or kind not in _RANDOM_KINDS:
        raise UsageError(f"--random {entry}: expected KEY=LOW:HIGH, KEY=LOW:HIGH:log or KEY=LOW:HIGH:int")
    try:
        low, high = float(parts[0]), float(parts[1])
    except ValueError:
        raise UsageError(f"--random {entry}: LOW and HIGH must be numbers, got {parts[0]!r} and {parts[1]!r}") from None
    return key, _param(f"--random {entry}", low=low, high=high, distribution=_RANDOM_KINDS[kind])


def build_definition(
    sweep: SweepSpec | None,
    *,
    grid: Sequence[str] = (),
    random: Sequence[str] = (),
    num_trials: int | None = None,
    seed: int | None = None,
    metric: str | None = None,
    goal: str | None = None,
    spec_file: Path | None = None,
    key_lines: Mapping[tuple, int] | None = None,
) -> SweepDefinition:
    """Merge the spec's ``[sweep]`` table with the command line.

    Command-line entries add keys or replace the spec's entry for the same key (keeping
    its position). Any ``--random`` entry makes the sweep random; explicit values are
    then drawn uniformly. Command-line ``num_trials``, ``seed``, ``metric``, ``goal``
    win over the spec's.

    Args:
        sweep: The spec's ``[sweep]`` table, or ``None``.
        grid: ``--grid`` entries. random: ``--random`` entries.
        num_trials, seed, metric, goal: Command-line values, or ``None`` for the spec's.
        spec_file: The spec file, for error locations.
        key_lines: :func:`runner.spec.locate.locate_keys` of that file, for line numbers.

    Raises:
        UsageError: A malformed or repeated command-line entry, nothing to sweep, random
            sampling without a trial budget, a bad ``num_trials``, or a forbidden key.
        SpecError: A range in the spec's ``[sweep.params]`` while the method is grid.
    """
    base = sweep or SweepSpec()
    params = _merge_params(base, grid, random)
    method = "random" if random else base.method
    trials = num_trials if num_trials is not None else base.num_trials
    if trials is not None and trials < 1:
        raise UsageError(f"--num-trials {trials}: give at least 1")
    if method == "random" and trials is None:
        raise UsageError("random sampling needs a trial budget: pass --num-trials N (or set sweep.num_trials)")
    if method == "grid":
        _check_no_ranges(params, spec_file, key_lines or {})
    if seed is not None and seed < 0:
        raise UsageError(f"--seed {seed}: give a seed >= 0")
    return SweepDefinition(
        method=method,
        params=tuple(params.items()),
        num_trials=trials,
        seed=base.seed if seed is None else seed,
        metric=metric or base.metric,
        goal=goal or base.goal,
    )


def _merge_params(base: SweepSpec, grid: Sequence[str], random: Sequence[str]) -> dict[str, SweepParam]:
    """The spec's ``[sweep.params]`` with the command-line entries added or replacing (same position).

    Raises:
        UsageError: A malformed or repeated entry, nothing to sweep, or a forbidden key.
    """
    params: dict[str, SweepParam] = dict(base.params)
    given: set[str] = set()
    for flag, entries, parse in (("--grid", grid, parse_grid), ("--random", random, parse_random)):
        for entry in entries:
            key, param = parse(entry)
            if key in given:
                raise UsageError(f"{flag} {entry}: {key} is swept twice on the command line; give it once")
            given.add(key)
            params[key] = param
    if not params:
        raise UsageError(
            "nothing to sweep: add [sweep.params] to the spec, or --grid KEY=V1,V2 / --random KEY=LOW:HIGH"
        )
    for key in params:
        if key.split(".", 1)[0] in FORBIDDEN_PREFIXES:
            raise UsageError(f"cannot sweep {key}: every trial is recorded in the sweep's own store and experiment")
    return params


def _check_no_ranges(params: Mapping[str, SweepParam], spec_file: Path | None, key_lines: Mapping[tuple, int]) -> None:
    """A grid needs explicit values: one located issue per key given as a range.

    Raises:
        SpecError: Some key has ``low``/``high`` instead of ``values``.
    """
    ranges = [k for k, p in params.items() if p.values is None]
    if not ranges:
        return
    hint = 'a range (low/high) cannot be gridded: set sweep.method = "random" with num_trials, or list values = [...]'
    raise SpecError(
        [SpecIssue(spec_file, key_lines.get(("sweep", "params", key)), f'sweep.params."{key}"', hint) for key in ranges]
    )


def expand(definition: SweepDefinition) -> list[Trial]:
    """List the trials of a definition; the same definition always gives the same trials.

    Grid: the cartesian product in key order (the last key varies fastest), cut to
    ``num_trials``. Random: ``num_trials`` draws from ``random.Random(seed)``, key by key;
    ``uniform`` in [low, high], ``log_uniform`` uniform in log space, ``int_uniform``
    integers in [ceil(low), floor(high)], explicit values uniformly.

    Raises:
        UsageError: An ``int_uniform`` range that holds no integer.
    """
    keys = [k for k, _ in definition.params]
    if definition.method == "grid":
        grid = itertools.product(*(p.values or [] for _, p in definition.params))  # a grid has no ranges
        points = itertools.islice(grid, definition.num_trials)
        return [Trial(i, dict(zip(keys, point, strict=False))) for i, point in enumerate(points)]
    rng = random.Random(definition.seed)
    trials = []
    for i in range(definition.num_trials or 0):
        trials.append(Trial(i, {key: _draw(rng, key, param) for key, param in definition.params}))
    return trials


def _draw(rng: random.Random, key: str, param: SweepParam) -> Any:
    if param.values is not None:
        return rng.choice(param.values)
    low, high = float(param.low), float(param.high)  # type: ignore[arg-type]
    if param.distribution == "log_uniform":
        return min(high, max(low, math.exp(rng.uniform(math.log(low), math.log(high)))))
    if param.distribution == "int_uniform":
        first, last = math.ceil(low), math.floor(high)
        if first > last:
            raise UsageError(f"{key}: int_uniform range [{low}, {high}] holds no integer")
        return rng.randint(first, last)
    return rng.uniform(low, high)


def _split(entry: str, flag: str, form: str, example: str) -> tuple[str, str]:
    key, eq, text = entry.partition("=")
    key = key.strip()
    if not eq or not key:
        raise UsageError(f"{flag} {entry}: expected {form}, e.g. {flag} {example}")
    return key, text.strip()


def _scalar(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _param(where: str, **fields: Any) -> SweepParam:
    try:
        return SweepParam(**fields)
    except ValidationError as exc:
        reasons = "; ".join(str(e.get("msg", e)).removeprefix("Value error, ") for e in exc.errors(include_url=False))
        raise UsageError(f"{where}: {reasons}") from None
