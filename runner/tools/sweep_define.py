"""The sweep definition from the spec's ``[sweep]`` and the command line (``--grid``, ``--random``, ``--trials``, ...).

Every problem is found before anything runs (docs/design.md §16).
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from runner.errors import SpecError, SpecIssue, UsageError
from runner.spec.dump import trial_run_name
from runner.spec.messages import locate_keys
from runner.spec.rules import UINT32_LIMIT
from runner.spec.schema import SweepParam, SweepSpec
from runner.tools.sweep_space import SweepDefinition

if TYPE_CHECKING:  # pragma: no cover
    from runner.spec.loading import LoadedSpec


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


def parse_grid(entry: str) -> tuple[str, SweepParam]:
    """Read ``--grid KEY=V1,V2,...`` as TOML values (bare words are strings); UsageError for a malformed entry."""
    key, text = _split(entry, "--grid", "KEY=V1,V2,...", "optim.lr=0.1,0.01")
    try:
        values = tomllib.loads(f"v = [{text}]")["v"]
    except tomllib.TOMLDecodeError:
        values = [_scalar(part.strip()) for part in text.split(",") if part.strip()]
    if not values:
        raise UsageError(f"--grid {entry}: no values after '=' (expected e.g. --grid {key}=0.1,0.01)")
    return key, _param(f"--grid {entry}", values=values)


def parse_random(entry: str) -> tuple[str, SweepParam]:
    """Read ``--random KEY=LOW:HIGH[:log|:int]``; UsageError for a malformed entry, ``LOW >= HIGH`` or ``log`` at
    ``<= 0``."""
    key, text = _split(entry, "--random", "KEY=LOW:HIGH[:log|:int]", "optim.lr=1e-4:1e-1:log")
    parts = text.split(":")
    kind = parts[2].strip().lower() if len(parts) == 3 else ""
    if len(parts) not in (2, 3) or kind not in _RANDOM_KINDS:
        raise UsageError(f"--random {entry}: expected KEY=LOW:HIGH, KEY=LOW:HIGH:log or KEY=LOW:HIGH:int")
    try:
        low, high = float(parts[0]), float(parts[1])
    except ValueError:
        raise UsageError(f"--random {entry}: LOW and HIGH must be numbers, got {parts[0]!r} and {parts[1]!r}") from None
    if _RANDOM_KINDS[kind] == "int_uniform" and math.ceil(low) > math.floor(high):
        raise UsageError(f"--random {entry}: the range [{low}, {high}] holds no integer")
    return key, _param(f"--random {entry}", low=low, high=high, distribution=_RANDOM_KINDS[kind])


@dataclass(frozen=True)
class CommandLine:
    """What ``runner sweep`` flags add to the spec's ``[sweep]`` (``None``: the spec's value)."""

    grid: Sequence[str] = ()
    random: Sequence[str] = ()
    method: str | None = None
    trials: int | None = None
    seed: int | None = None
    metric: str | None = None
    goal: str | None = None
    pruner: str | None = None


def build_definition(
    sweep: SweepSpec | None,
    cli: CommandLine = CommandLine(),
    *,
    spec_file: Path | None = None,
    key_lines: Mapping[tuple, int] | None = None,
) -> SweepDefinition:
    """Merge the spec's ``[sweep]`` with the command line, whose entries add or replace keys and whose flags win.

    A ``--random`` range turns a grid into a random sweep. Raises UsageError: A malformed or repeated entry, nothing to
    sweep, a forbidden key, a bad ``--trials``, or no budget for random or tpe. SpecError: At the key's line: a range in
    a grid, ``trials`` over the grid, an empty ``int_uniform`` range."""
    base = sweep or SweepSpec()
    lines = key_lines or {}
    params = _merge_params(base, cli.grid, cli.random)
    method = cli.method or ("random" if cli.random and base.method == "grid" else base.method)
    if cli.trials is not None and cli.trials < 1:
        raise UsageError(f"--trials {cli.trials}: give at least 1")
    if cli.seed is not None and not 0 <= cli.seed < UINT32_LIMIT:
        raise UsageError(f"--seed {cli.seed}: give a seed >= 0 and < 2**32 (Optuna seeds NumPy's RandomState with it)")
    trials = cli.trials if cli.trials is not None else base.trials
    _check_ranges(params, method == "grid", spec_file, lines)
    if method == "grid":
        trials = _grid_trials(params, trials, from_cli=cli.trials is not None, spec_file=spec_file, lines=lines)
    elif trials is None:
        raise UsageError(f"{method} sampling needs a trial budget: pass --trials N (or set sweep.trials)")
    given = {"seed": cli.seed, "metric": cli.metric, "goal": cli.goal, "pruner": cli.pruner}
    chosen = {key: value for key, value in given.items() if value is not None}
    return SweepDefinition(**{**dict(base), **chosen, "method": method, "params": params, "trials": trials})


def trial_names(loaded: LoadedSpec) -> list[str]:
    """The run names of a spec's sweep trials for ``runner plan``: a grid's, or the budget and space of a random one."""
    definition = build_definition(loaded.spec.sweep, spec_file=loaded.path, key_lines=locate_keys(loaded.source_text))
    if definition.method == "grid":
        return [trial_run_name(point) for point in definition.grid_points()]
    space = ", ".join(f"{key} ~ {definition.describe(key)}" for key in definition.params)
    return [f"{definition.trials} trials sampled by {definition.method} from {space}"]


def _merge_params(base: SweepSpec, grid: Sequence[str], random: Sequence[str]) -> dict[str, SweepParam]:
    """The spec's ``[sweep.params]`` with the command-line entries added or replacing; UsageError as above."""
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


def _param_issue(key: str, spec_file: Path | None, lines: Mapping[tuple, int], message: str) -> SpecIssue:
    return SpecIssue(spec_file, lines.get(("sweep", "params", key)), f'sweep.params."{key}"', message)


def _check_ranges(
    params: Mapping[str, SweepParam], grid: bool, spec_file: Path | None, lines: Mapping[tuple, int]
) -> None:
    """SpecError with one located issue per ``int_uniform`` range that holds no integer, else per range in a grid."""
    empty = [
        (k, p)
        for k, p in params.items()
        if p.distribution == "int_uniform" and p.values is None and math.ceil(p.low or 0) > math.floor(p.high or 0)
    ]
    if empty:
        message = "int_uniform range [{}, {}] holds no integer"
        raise SpecError([_param_issue(k, spec_file, lines, message.format(p.low, p.high)) for k, p in empty])
    ranges = [k for k, p in params.items() if p.values is None] if grid else []
    if ranges:
        hint = 'a range (low/high) cannot be gridded: set sweep.method = "random" or "tpe" with trials, or list values'
        raise SpecError([_param_issue(key, spec_file, lines, hint) for key in ranges])


def _grid_trials(
    params: Mapping[str, SweepParam],
    trials: int | None,
    *,
    from_cli: bool,
    spec_file: Path | None,
    lines: Mapping[tuple, int],
) -> int:
    """The grid's trial count: its size, or ``trials`` when not larger (else UsageError or SpecError)."""
    size = math.prod(len(p.values or []) for p in params.values())
    if trials is None or trials <= size:
        return size if trials is None else trials
    message = f"trials = {trials} but the grid has {size} point(s): give trials <= {size}, or leave it out for all"
    if from_cli:
        raise UsageError(f"--trials {trials}: the grid has only {size} point(s)")
    raise SpecError(SpecIssue(spec_file, lines.get(("sweep", "trials")), "sweep.trials", message))


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
