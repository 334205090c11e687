"""A sweep's definition from the spec's ``[sweep]`` and the command line (``--grid``, ``--random``, ``--trials``, ...),
and its trials as experiments: the trial spec, every trial validated up front, the child run's tags, pruning. Every
problem is found before anything runs (docs/design.md §16)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from runner.errors import DeviceError, SpecError, SpecIssue, UsageError
from runner.spec.dump import spec_sha256, trial_run_name
from runner.spec.loading import load_spec, relocate_issues, spec_from_dict
from runner.spec.messages import locate_keys
from runner.spec.rules import UINT32_LIMIT
from runner.spec.schema import SweepParam, SweepSpec
from runner.tools.sweep_space import SweepDefinition, Trial
from runner.tools.sweep_study import SweepStudy, open_storage
from runner.tracking.tags import param_value, safe_key

if TYPE_CHECKING:
    import optuna

    from runner.plan import Plan
    from runner.spec.loading import LoadedSpec


# Swept keys may not change where or how a trial is recorded: every trial must be a
# child of the parent run, in the parent's store and experiment.
FORBIDDEN_PREFIXES = ("sweep", "tracking")
_RANDOM_KINDS = {"": "uniform", "log": "log_uniform", "int": "int_uniform"}  # --random's suffix: its distribution


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
    kind = _RANDOM_KINDS.get(kind, kind)  # the distribution's own name is taken too
    if len(parts) not in (2, 3) or kind not in _RANDOM_KINDS.values():
        raise UsageError(f"--random {entry}: expected KEY=LOW:HIGH, KEY=LOW:HIGH:log or KEY=LOW:HIGH:int")
    try:
        low, high = float(parts[0]), float(parts[1])
    except ValueError:
        raise UsageError(f"--random {entry}: LOW and HIGH must be numbers, got {parts[0]!r} and {parts[1]!r}") from None
    if kind == "int_uniform" and math.ceil(low) > math.floor(high):
        raise UsageError(f"--random {entry}: the range [{low}, {high}] holds no integer")
    return key, _param(f"--random {entry}", low=low, high=high, distribution=kind)


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


SCHEDULER_PREFIXES = ("SLURM_",)


def without_sweep(loaded: LoadedSpec) -> LoadedSpec:
    """``loaded`` as a plain experiment: its ``[sweep]`` removed, hash recomputed."""
    if loaded.spec.sweep is None and "sweep" not in loaded.data:
        return loaded
    data = {k: v for k, v in loaded.data.items() if k != "sweep"}
    spec = spec_from_dict(data, origin=str(loaded.path))
    return dataclasses.replace(loaded, spec=spec, data=data, sha256=spec_sha256(spec))


def trial_environ() -> dict[str, str]:
    """This environment without a scheduler's variables: a trial is never a Slurm job's run (docs/design.md §15-§16)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(SCHEDULER_PREFIXES)}


def trials_to_check(definition: SweepDefinition) -> list[Trial]:
    """The trials validated before the first starts: a grid's every point; else each key at each value or range end,
    the others at their first (index ``-1``)."""
    if definition.method == "grid":
        return [Trial(i, point) for i, point in enumerate(definition.grid_points())]
    options = {key: _candidates(p.values, p.low, p.high, p.distribution) for key, p in definition.params.items()}
    first = {key: values[0] for key, values in options.items()}
    checks, seen = [], set()
    for key, values in options.items():
        for value in values:
            point = {**first, key: value}
            marker = json.dumps(point, sort_keys=True, default=str)
            if marker not in seen:
                seen.add(marker)
                checks.append(Trial(-1, point))
    return checks


def _candidates(values: list[Any] | None, low: float | None, high: float | None, distribution: str) -> list[Any]:
    if values is not None:
        return list(values)
    if distribution == "int_uniform":
        return [math.ceil(low or 0), math.floor(high or 0)]
    return [float(low or 0), float(high or 0)]


def prepare_trials(
    path: Path,
    overrides: Sequence[str],
    trials: Sequence[Trial],
    environ: Mapping[str, str] | None = None,
    in_file: Mapping[str, int | None] | None = None,
    on_cli: Mapping[str, str] | None = None,
    *,
    unset: Sequence[str] = (),
) -> list[tuple[LoadedSpec, Plan]]:
    """``(spec without [sweep], plan)`` per trial, every trial loaded, validated and planned before any runs.

    ``in_file`` and ``on_cli`` map swept keys to their line or command-line entry, which a problem then names. Raises
    SpecError: Trial specs that do not validate, each issue at its key and naming the trial, once. DeviceError: Trials
    that ask for devices this machine lacks, a line each."""
    from runner.devices.inventory import probe_inventory
    from runner.plan import make_plan

    env = trial_environ() if environ is None else dict(environ)
    inventory = probe_inventory(env)
    issues: list[tuple[SpecIssue, str]] = []  # (issue, the trial it was found in)
    device_errors: list[str] = []
    where = _Sources(path, in_file or {}, on_cli or {})
    checked: dict[tuple[str, Path], SpecError | None] = {}
    out = []
    for trial in trials:
        try:
            loaded = without_sweep(load_spec(path, [*overrides, *trial.overrides()], unset))
        except SpecError as exc:
            issues += [(where.place(issue, trial), trial.label()) for issue in exc.issues]
            continue
        model_error = _model_error(loaded, checked)
        if model_error is not None:
            located = relocate_issues(model_error, loaded)  # at model.name's line in the spec file
            issues += [(where.place(issue, trial), trial.label()) for issue in located.issues]
            continue
        try:
            out.append((loaded, make_plan(loaded, env=env, inventory=inventory)))
        except (DeviceError, UsageError, SpecError) as exc:
            device_errors.append(f"{trial.label()}: {exc}")
    if issues:
        raise SpecError(_once_each(issues, len(trials)))
    if device_errors:
        raise DeviceError("\n".join(device_errors))
    return out


def _model_error(loaded: LoadedSpec, checked: dict[tuple[str, Path], SpecError | None]) -> SpecError | None:
    """Whether the trial's model name resolves (each name and folder is checked once)."""
    from runner.training.models import check_model_name

    key = (loaded.spec.model.name, loaded.path.parent)
    if key not in checked:
        try:
            check_model_name(*key)
            checked[key] = None
        except SpecError as exc:
            checked[key] = exc
    return checked[key]


def trial_tags(trial: Trial, study: str | None = None, number: int | None = None) -> tuple[tuple[str, str], ...]:
    """MLflow tags of a trial's child run: index, values, ``sweep.<key>``, the study and the Optuna trial number."""
    tags = [
        ("runner.sweep", "trial"),
        ("runner.sweep.trial", str(trial.index)),
        ("runner.sweep.values", json.dumps(trial.values, default=str)),
    ]
    if study is not None:
        tags.append(("runner.sweep.study", study))
    if number is not None:
        tags.append(("runner.sweep.optuna_trial", str(number)))
    tags += [(safe_key(f"sweep.{k}"), param_value(v)) for k, v in trial.values.items()]
    return tuple(tags)


def swept_in_file(base: LoadedSpec, grid: Sequence[str], random: Sequence[str]) -> dict[str, int | None]:
    """Keys of the spec's ``[sweep.params]`` that ``grid`` and ``random`` do not replace, with their line."""
    if base.spec.sweep is None:
        return {}
    given = {entry.partition("=")[0].strip() for entry in (*grid, *random)}
    lines = locate_keys(base.source_text)
    return {key: lines.get(("sweep", "params", key)) for key in base.spec.sweep.params if key not in given}


@dataclasses.dataclass(frozen=True)
class _Sources:
    """Where a sweep's values were written: the spec file, its ``[sweep.params]`` lines, the command line."""

    path: Path
    in_file: Mapping[str, int | None]
    on_cli: Mapping[str, str]

    def place(self, issue: SpecIssue, trial: Trial) -> SpecIssue:
        """The issue of a trial's spec, blamed on the swept value's own source when it is about one."""
        keys = [*self.in_file, *self.on_cli]
        swept = next((k for k in keys if issue.key == k or issue.key.startswith((k + ".", k + "["))), None)
        if swept is None or swept not in trial.values:
            return issue
        message = issue.message.split(" (from --set ", 1)[0]
        if swept in self.in_file:
            return SpecIssue(
                self.path, self.in_file[swept], issue.key, f'{message} (a value of sweep.params."{swept}")'
            )
        entry = self.on_cli[swept]
        return SpecIssue(None, None, issue.key, f"{message} (from {entry})", entry.split(" ", 1)[0])


def _once_each(found: Sequence[tuple[SpecIssue, str]], trials: int) -> list[SpecIssue]:
    """Each issue naming its trial; one found in every trial (an unknown key, say) once, naming none."""
    labels: dict[SpecIssue, list[str]] = {}
    for issue, label in found:
        labels.setdefault(issue, []).append(label)
    out = []
    for issue, label in found:
        names = labels[issue]
        if trials > 1 and len(names) == trials:
            if names[0] == label:
                out.append(dataclasses.replace(issue, message=f"{issue.message} [all {trials} sweep trials]"))
        else:
            out.append(dataclasses.replace(issue, message=f"{issue.message} [sweep {label}]"))
    return out


def swept_on_cli(grid: Sequence[str], random: Sequence[str]) -> dict[str, str]:
    """Keys swept by ``--grid`` and ``--random`` entries, each with its entry as typed (``--grid optim.lr=0.1,1``)."""
    flagged = [("--grid", entry) for entry in grid] + [("--random", entry) for entry in random]
    return {entry.partition("=")[0].strip(): f"{flag} {entry}" for flag, entry in flagged}


class OptunaPruning:
    """Report ``metric`` of each epoch to the trial (step = epoch) and return the pruner's verdict."""

    def __init__(
        self,
        url: str,
        study_name: str,
        trial_number: int,
        definition: dict[str, Any],
        trial: optuna.Trial | None = None,
    ):
        self.url = url
        self.study_name = study_name
        self.trial_number = trial_number
        self.definition = definition
        self._trial = trial

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_trial"] = None  # another process opens the study itself
        return state

    def __call__(self, epoch: int, metrics: dict[str, float]) -> bool:
        """Whether the trial stops after ``epoch``: False while the metric is missing or not finite."""
        value = metrics.get(self.definition["metric"])
        if value is None or not math.isfinite(float(value)):
            return False
        trial = self._trial or self._reopen()
        trial.report(float(value), step=epoch)
        return bool(trial.should_prune())

    def _reopen(self) -> optuna.Trial:
        """The trial, from its study in the storage (for a rank 0 that is not the sweep worker's process)."""
        import optuna

        storage, definition = open_storage(self.url, heartbeat=False), SweepDefinition.model_validate(self.definition)
        study = SweepStudy.join(storage, self.url, self.study_name, definition)
        self._trial = optuna.Trial(study.study, study.trial_id(self.trial_number))
        return self._trial
