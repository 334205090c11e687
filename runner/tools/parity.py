"""``runner parity``: train one spec under each parallel mode in float64 and compare every step with ``none``; a
perturbed control sets the tolerance. Semantics: docs/design.md §17.

Bench says which mode is faster; parity says whether switching changes the results, and by how much beyond the
rounding a float64 run cannot avoid: the question the tool was built for, answered per step.
"""

from __future__ import annotations

import copy
import json
import math
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.errors import DeviceError, SpecError, TrainingError, UsageError, first_line
from runner.spec.schema_parallel import MODES, REFERENCE_MODE
from runner.tools.compare import (
    ComparedRuns,
    Parent,
    check_modes,
    config_id,
    derive,
    ending,
    first_beyond,
    log_history,
    loss_deltas,
    loss_scale,
    reason,
    start_parent,
)
from runner.tracking.runs import TrackedRun
from runner.tracking.uri import ui_line

if TYPE_CHECKING:
    import torch

    from runner.spec.loading import LoadedSpec

PERTURBATION = 2.0**-23  # the control's relative nudge of every initial weight: one float32 ulp (at most 1.2e-07)
DEFAULT_STEPS = 1000  # at most: the spec's own epochs usually end the runs first
EPS = {"float64": 2.0**-52, "float32": 2.0**-23}
MARGIN = {"float64": 1e3, "float32": 10.0}  # how far beyond the control's growth (at the run's epsilon) is rounding
FLOOR = {"float64": 1e-10, "float32": 1e-6}  # relative to the size of the values: summation order alone


@dataclass
class ModeResult:
    """One configuration's run and how far it is from ``none``'s.

    ``config`` is ``none``, ``<mode>-<n>`` or ``control``; ``params`` the final parameters by name (float64 on CPU; not
    in the JSON); ``first_beyond`` the first step whose |Δ train/loss| exceeds the tolerance; ``status`` ``ok``,
    ``skipped`` (not asked for and cannot run here, ``reason`` says why) or ``failed``.
    """

    config: str
    mode: str
    n: int
    run_id: str | None = None
    losses: dict[int, float] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict, repr=False)
    loss_deltas: dict[int, float] = field(default_factory=dict)
    max_loss_delta: float | None = None
    max_param_delta: float | None = None
    first_beyond: int | None = None
    status: str = "ok"
    reason: str = ""


@dataclass
class ParityReport(ComparedRuns):
    """The verdict of ``runner parity``: ``modes[0]`` is ``none``, ``control`` the perturbed ``none`` in float32,
    ``reference`` the float32 ``none`` it is compared with (``None`` when everything ran in float32)."""

    precision: str
    steps: int
    modes: list[ModeResult]
    control: ModeResult
    reference: ModeResult | None = None
    loss_tolerance: float = 0.0
    param_tolerance: float = 0.0
    causes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def differing(self) -> list[ModeResult]:
        return [
            m for m in self.modes[1:] if m.status == "failed" or m.first_beyond is not None or _params_differ(m, self)
        ]

    @property
    def failed(self) -> int:
        """Configurations that differ from ``none`` or failed (the command then exits 1)."""
        return len(self.differing)

    def verdict(self) -> str:
        return "differ" if self.differing else "agree"

    def table(self) -> str:
        """What ``runner parity`` prints: the verdict, one line per configuration, the spec's sensitivity."""
        differ = self.differing
        head = "the modes differ beyond rounding" if differ else "the modes agree"
        lines = [f"runner parity: {self.name}: {head} ({self.precision}, {self.steps} steps, deterministic)"]
        lines += [f"  {m.config:<8} {self._line(m)}" for m in self.modes[1:]]
        lines.append(f"  {'control':<8} none in float32, initial weights nudged by one ulp: {self.sensitivity()}")
        lines += [f"  likely cause: {cause}" for cause in (self.causes if differ else [])]
        lines += [f"  note: {note}" for note in self.notes]
        if self.parent_run_id:
            lines.append(f"MLflow: parent run {self.parent_run_id} (experiment {self.experiment!r})")
            lines.append(ui_line(self.tracking_uri or "", self.experiment_id, self.parent_run_id))
        return "\n".join(lines)

    def _line(self, m: ModeResult) -> str:
        if m.status != "ok":
            return f"{m.status}: {m.reason}"
        figures = (
            f"max |Δ train/loss| {_e(m.max_loss_delta)} (tolerance {_e(self.loss_tolerance)}), "
            f"max |Δ parameter| {_e(m.max_param_delta)} (tolerance {_e(self.param_tolerance)})"
        )
        if m.first_beyond is not None:
            at = m.loss_deltas[m.first_beyond]
            return f"differs from step {m.first_beyond} by {_e(at)}; {figures}"
        if _params_differ(m, self):
            return f"final parameters differ; {figures}"
        return figures

    def sensitivity(self) -> str:
        """The control's growth in words: what float32 runs of this spec differ by across modes."""
        growth = self.control.max_loss_delta or 0.0
        return (
            f"a {PERTURBATION:.1e} perturbation grows to {_e(growth)} in train/loss in {self.steps} steps: "
            "float32 runs of this spec will differ by about that much across modes"
        )

    def to_json(self) -> dict[str, Any]:
        """The report's fields, the verdict and the sensitivity; each configuration without its tensors and |Δ|s."""
        rows = [m for m in [*self.modes, self.control, self.reference] if m is not None]
        configurations = [{k: v for k, v in vars(m).items() if k not in ("params", "loss_deltas")} for m in rows]
        plain = {k: v for k, v in vars(self).items() if k not in ("modes", "control", "reference")}
        verdict = {"verdict": self.verdict(), "perturbation": PERTURBATION, "sensitivity": self.sensitivity()}
        return {**plain, **verdict, "causes": self.causes if self.differing else [], "configurations": configurations}


def _e(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def _params_differ(m: ModeResult, report: ParityReport) -> bool:
    return m.max_param_delta is not None and m.max_param_delta > report.param_tolerance


def tolerance(precision: str, growth: float, scale: float) -> float:
    """How far a mode may be from ``none`` by rounding alone: the control's ``growth`` (its largest |Δ|) scaled to
    ``precision``'s rounding (``EPS / PERTURBATION``) times a margin, at least the floor relative to ``scale`` (the
    size of the values); the growth itself when the control saturated (grew to the size of the values: then rounding
    cannot be told from a mode difference below it)."""
    scaled = growth * EPS[precision] / PERTURBATION * MARGIN[precision]
    saturated = growth if growth >= 0.1 * scale else 0.0
    return max(scaled, FLOOR[precision] * scale, saturated)


def run_parity(loaded: LoadedSpec, *, modes: Sequence[str] | None = None, steps: int | None = None) -> ParityReport:
    """Run ``none``, the control and each mode of ``modes`` (``None``: every mode this machine runs) for ``steps``
    steps, compare them and record the verdict; ``report.failed`` counts the modes that differ. Raises UsageError:
    An unknown mode, a named mode this machine cannot run, ``steps < 1``, or under torchrun. TrainingError: ``none``
    failed to train; the parent run is FAILED. Interrupted: SIGINT/SIGTERM; the parent run is KILLED."""
    from runner.plan import launched_externally

    if steps is not None and steps < 1:
        raise UsageError(f"--steps: expected at least 1 optimizer step, got {steps}")
    if launched_externally(os.environ):
        raise UsageError("runner parity starts its own workers: run it directly, not under torchrun")
    cap = loaded.spec.train.max_steps
    steps = min(steps or DEFAULT_STEPS, cap) if cap else (steps or DEFAULT_STEPS)
    with tempfile.TemporaryDirectory(prefix="runner-parity-") as tmp:
        base, others, skipped = _configurations(loaded, modes, steps, Path(tmp))
        report = ParityReport(
            str(loaded.path), loaded.spec.name, "float64", steps, [], ModeResult("control", "none", 1)
        )
        report.modes = [ModeResult("none", "none", 1), *(ModeResult(c, m, n) for c, m, n, _ in others), *skipped]
        parent = start_parent(base, report, "parity", [m.config for m in report.modes], parity={"steps": steps})
        with ending(parent):
            _run_all(report, base, others, parent)
            if parent is not None:
                _record(report, parent, Path(tmp))
    return report


_Config = tuple[str, str, int, "LoadedSpec"]  # (config id, mode, n, its spec)


def _configurations(
    loaded: LoadedSpec, modes: Sequence[str] | None, steps: int, folder: Path
) -> tuple[LoadedSpec, list[_Config], list[ModeResult]]:
    """``none``'s spec, the configurations that run here, the skipped ones; UsageError for a named one that cannot."""
    from runner.devices.inventory import probe_inventory

    if modes is not None:
        check_modes(modes)
    gpus = len(probe_inventory(os.environ).gpus)
    cpu = gpus < 2 or loaded.spec.devices.accelerator == "cpu"  # every configuration on the same kind of device
    base = _mode_spec(loaded, REFERENCE_MODE, 1, steps, cpu, folder)
    others: list[_Config] = []
    skipped: list[ModeResult] = []
    for mode in [m for m in MODES if m != REFERENCE_MODE and (modes is None or m in modes)]:
        config = f"{mode}-2"
        try:
            others.append((config, mode, 2, _mode_spec(loaded, mode, 2, steps, cpu, folder)))
        except (SpecError, DeviceError) as exc:
            why = f"{mode} needs 2 GPUs; this machine has {gpus}" if MODES[mode].replicas else reason(exc)
            if modes is not None:
                raise UsageError(f"--modes: {config} cannot run on this machine: {why}") from None
            skipped.append(ModeResult(config, mode, 2, status="skipped", reason=why))
    return base, others, skipped


def _mode_spec(loaded: LoadedSpec, mode: str, n: int, steps: int, cpu: bool, folder: Path) -> LoadedSpec:
    """One configuration's spec: bench's, with determinism, its own epochs, checkpoints, ``<experiment>/parity``."""

    def adjust(data: dict[str, Any]) -> None:
        train, original = data["train"], loaded.data.get("train", {})
        for key in ("epochs", "eval_every_n_epochs"):  # the spec's own epochs; max_steps ends the run
            train.pop(key, None)
            if key in original:
                train[key] = copy.deepcopy(original[key])
        train["amp"] = "no"
        data["deterministic"] = True
        if cpu:
            data["devices"]["accelerator"] = "cpu"
        data["checkpoint"] = {"dir": str(folder / config_id(mode, n)), "every_n_steps": steps, "keep_last": 1}
        experiment = f"{loaded.spec.experiment_name}/parity"
        data.setdefault("tracking", {}).update(log_model=False, experiment=experiment)

    return derive(loaded, mode, n, steps, 0, adjust)[0]


def _run_all(report: ParityReport, base: LoadedSpec, others: list[_Config], parent: Parent | None) -> None:
    """Train none (falling back to float32), the control and the other modes; compare; name the causes."""
    none = report.modes[0]
    try:
        _train(none, base, parent, "float64")
        report.reference = ModeResult("none-float32", "none", 1)
        _train(report.reference, base, parent, None)
    except TrainingError as exc:
        if report.reference is not None:
            raise
        first = first_line(exc) or type(exc).__name__
        report.precision = "float32"
        report.notes.append(f"the model does not train in float64 ({first}): every configuration ran in float32")
        _train(none, base, parent, None)
    dtype = "float64" if report.precision == "float64" else None
    _train(report.control, base, parent, None, nudge=True)
    for (_, _, _, loaded), result in zip(others, report.modes[1:], strict=False):
        try:
            _train(result, loaded, parent, dtype)
        except TrainingError as exc:
            result.status, result.reason = "failed", reason(exc)
    report.steps = max(none.losses, default=report.steps)  # the spec's epochs may end the runs first
    _compare(report)
    if report.differing:
        report.causes = likely_causes(base, [m.mode for m in report.differing])


def _train(
    result: ModeResult, loaded: LoadedSpec, parent: Parent | None, dtype: str | None, nudge: bool = False
) -> None:
    """``runner exec`` of one configuration as a child of ``parent``; fills its losses and final parameters."""
    from runner.launch.driver import exec_experiment
    from runner.launch.session import ExecOptions
    from runner.training.checkpoint import load_latest
    from runner.training.shards import read_with_model

    options = ExecOptions(
        run_name=f"{result.config} parity {loaded.spec.name}",
        parent_run_id=parent.run_id if parent else None,
        tags=(("runner.parity.config", result.config),),
        dtype=dtype,
        nudge=nudge,
        in_process=True,  # parity's configurations reuse its process
        started_at=time.time(),
    )
    done = exec_experiment(loaded, options)
    result.run_id = done.run_id
    result.losses = {step: m["train/loss"] for step, m in done.history if "train/loss" in m}
    found = load_latest(Path(done.checkpoint_dir), read_with_model)
    state = found.payload["model"] if found is not None else {}
    result.params = {k: v.double() for k, v in state.items() if v.is_floating_point()}


def _compare(report: ParityReport) -> None:
    """Fill each |Δ| against ``none`` (the control's: float32 ``none``), the tolerances, the first step beyond."""
    none = report.modes[0]
    for m, base in [(report.control, report.reference or none), *((m, none) for m in report.modes[1:])]:
        if m.status != "ok":
            continue
        m.loss_deltas = loss_deltas(m.losses, base.losses)
        m.max_loss_delta = max(m.loss_deltas.values(), default=None)
        m.max_param_delta = max(
            (float((m.params[k] - v).abs().max()) if k in m.params else math.inf for k, v in base.params.items()),
            default=None,
        )
    param_scale = max([1.0, *(float(v.abs().max()) for v in none.params.values() if v.numel())])
    report.loss_tolerance = tolerance(report.precision, report.control.max_loss_delta or 0.0, loss_scale(none.losses))
    report.param_tolerance = tolerance(report.precision, report.control.max_param_delta or 0.0, param_scale)
    for m in report.modes[1:]:
        m.first_beyond = first_beyond(m.loss_deltas, report.loss_tolerance)


def likely_causes(loaded: LoadedSpec, modes: Sequence[str]) -> list[str]:
    """The known causes of a mode difference this spec has (docs/design.md §3), else what to look for; the model is
    built on the ``meta`` device in this process (a factory is called once more)."""
    from runner.launch.prebuild import difference_notes

    spec = loaded.spec
    causes = difference_notes(_meta_model(loaded), spec, modes)
    if spec.loss.name == "model" or ":" in spec.loss.name:
        causes.append(
            f"loss.name = {spec.loss.name!r} returns a mean over each rank's micro-batch: a mean weighted other than "
            "per sample (e.g. over non-ignored tokens) differs per rank (docs/design.md §13)"
        )
    return causes or [
        "none of the known ones (BatchNorm, dropout, a per-rank mean loss): look for layers or a loss that use "
        "the batch split, the rank or random numbers"
    ]


def _meta_model(loaded: LoadedSpec) -> torch.nn.Module | None:
    """The spec's model on ``meta``, else on the CPU (its construction may compute on weights), else ``None``."""
    import torch

    from runner.training.data import build_datasets
    from runner.training.models import build_model

    spec = loaded.spec
    folder = loaded.path.parent
    try:
        info = build_datasets(spec, folder).info
    except Exception:
        return None
    for device in ("meta", "cpu"):
        try:
            with torch.random.fork_rng(devices=[]), torch.device(device):
                return build_model(spec.model, folder, input_shape=info.input_shape, num_classes=info.num_classes)
        except Exception:
            continue
    return None


def _record(report: ParityReport, parent: Parent, folder: Path) -> None:
    """The verdict on the parent run (tags, figures, text, JSON, plot) and per-step |Δ| on each child."""
    metrics: dict[str, float] = {}
    for m in [*report.modes[1:], report.control, *([report.reference] if report.reference else [])]:
        figures = {"max_abs_dloss": m.max_loss_delta, "max_abs_dparam": m.max_param_delta}
        shown = {f"parity/{k}": v for k, v in figures.items() if v is not None and math.isfinite(v)}
        metrics.update({f"parity/{m.config}/{k[7:]}": v for k, v in shown.items()})
        if m.run_id is not None:
            child = TrackedRun(parent.uri, m.run_id)
            child.log(metrics=shown)
            log_history(child, [(s, {"parity/abs_dloss": d}) for s, d in m.loss_deltas.items() if math.isfinite(d)])
    plot = write_plot(report, folder / "parity.png")
    text = report.table()
    tags = {"runner.parity.verdict": report.verdict(), "runner.parity.precision": report.precision}
    tags["runner.parity.summary"] = text[:5000]
    parent.log(
        metrics=metrics,
        params={"parity.steps": str(report.steps), "parity.precision": report.precision},
        tags=tags,
        texts={"parity/verdict.txt": text + "\n", "parity/parity.json": json.dumps(report.to_json(), indent=2)},
        files=[plot],
        files_dir="parity",
    )


def write_plot(report: ParityReport, path: Path) -> Path:
    """Per-step |Δ train/loss| against ``none`` on a log scale: one line per mode, one for the control (Agg)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    floor = 1e-18  # exact agreement is drawn here (a log scale has no 0)
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.subplots()
    for m in [*report.modes[1:], report.control]:
        if m.loss_deltas:
            steps = sorted(m.loss_deltas)
            values = [min(max(m.loss_deltas[s], floor), 1e3) for s in steps]
            ax.plot(steps, values, label=m.config, linestyle=":" if m is report.control else "-")
    ax.axhline(report.loss_tolerance, color="grey", linestyle="--", label="tolerance")
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("|Δ train/loss| against none")
    ax.set_title(f"runner parity: {report.name} ({report.precision}): the modes {report.verdict()}")
    ax.legend()
    fig.savefig(path)
    return path
