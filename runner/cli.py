"""Command line: parse arguments, call the library, map errors to exit codes (docs/design.md §9). Nothing more: each
:class:`~runner.errors.RunnerError` carries its own ``exit_code``; :func:`main` maps them with one ``except``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from runner import __version__
from runner.errors import Interrupted, RunnerError, SpecError, TrainingError, UsageError, echo, exit_quickly

if TYPE_CHECKING:
    from runner.spec.loading import LoadedSpec


EXIT_OK = 0
_T = TypeVar("_T")
_Commands = argparse._SubParsersAction  # what ``ArgumentParser.add_subparsers()`` returns


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so the exit code is mapped in one place."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    """The ``runner`` argument parser with its sub-commands."""
    parser = _Parser(
        prog="runner",
        description="Declarative experiment runner for PyTorch: a TOML spec in, one MLflow run out.",
        epilog="Exit status: 0 ok, 1 training failed, 2 bad spec or usage, 130 interrupted.",
    )
    parser.add_argument("--version", action="version", version=f"runner {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("validate", help="check specs: keys, types, ranges, cross-field rules (no torch import)")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument(
        "--dependents-in",
        action="append",
        default=[],
        metavar="DIR",
        help="also check the specs under DIR whose extends chain reaches a FILE; a FILE they extend is "
        "checked through them (repeatable; the pre-commit hook passes its spec folder)",
    )
    p.set_defaults(func=_validate)

    p = sub.add_parser("plan", help="show what would run: devices, world size, batches, launch, tracking")
    _spec_args(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--spec", action="store_true", help="also print the resolved spec (TOML, every default)")
    p.add_argument(
        "--no-memory",
        dest="memory",
        action="store_false",
        help="leave out the memory estimate of every mode (it imports torch and runs the model on fake tensors)",
    )
    p.set_defaults(func=_plan)

    p = sub.add_parser("schema", help="print the JSON Schema of a spec (for TOML editors and check-jsonschema)")
    p.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of standard output")
    p.add_argument("--markdown", action="store_true", help="print a Markdown reference of every key instead")
    p.add_argument(
        "--write",
        nargs="?",
        const=".",
        metavar="DIR",
        help="write runner.schema.json and .taplo.toml into DIR (default .) and refresh README.md's key reference",
    )
    p.set_defaults(func=_schema)

    _add_exec(sub)
    _add_stored_run_commands(sub)
    _add_sweep(sub)
    _add_bench(sub)
    _add_parity(sub)
    return parser


def _add_exec(sub: _Commands) -> None:
    """``runner exec FILE``: train and record one run."""
    p = sub.add_parser("exec", help="train the experiment and record it in MLflow")
    _spec_args(p)
    p.add_argument(
        "--run-name", type=_run_name, metavar="NAME", help="MLflow run name (default: spec name, mode, changed values)"
    )
    p.add_argument(
        "--resume", metavar="RUN_ID", help="continue run RUN_ID from its last checkpoint ('last': newest run)"
    )
    p.add_argument(
        "--allow-spec-change",
        action="append",
        default=[],
        metavar="KEY",
        help="with --resume: allow dotted KEY to differ from the run's spec (repeatable; recorded as a tag)",
    )
    p.add_argument("--parent-run-id", metavar="RUN_ID", help=argparse.SUPPRESS)
    p.set_defaults(func=_exec)


def _add_stored_run_commands(sub: _Commands) -> None:
    """``runner status``, ``resume``, ``reproduce``, ``export``, ``test`` RUN_ID, ``runner diff A B``: from MLflow
    to a run."""
    helps = {
        "status": "show RUNNING runs and their owner; mark KILLED those whose owner died without ending them",
        "resume": "continue a KILLED or FAILED run with the spec stored in it (no spec file)",
        "reproduce": "start a new run from the resolved spec stored in a run",
        "export": "write the model of a run's newest checkpoint as a plain PyTorch state dict",
        "test": "score a run's checkpoint on its test split and log test/* to the run",
        "diff": "compare two runs or spec files: spec keys, git commits, environment",
    }
    p = {name: sub.add_parser(name, help=text) for name, text in helps.items()}
    p["status"].add_argument("run_id", nargs="?", metavar="RUN_ID", help="one run (default: every RUNNING run)")
    for name in ("resume", "reproduce", "export", "test"):
        p[name].add_argument("run_id", metavar="RUN_ID")
    p["reproduce"].add_argument(
        "--run-name", type=_run_name, metavar="NAME", help="MLflow run name (default: the original's, '(reproduced)')"
    )
    p["export"].add_argument("--out", metavar="FILE", help="the file to write (default: RUN_ID-step-N.pt here)")
    p["export"].add_argument(
        "--best", action="store_true", help="the best checkpoint by checkpoint.monitor instead of the newest"
    )
    p["export"].add_argument("--ema", action="store_true", help="the weights' moving average (train.ema_decay)")
    p["test"].add_argument(
        "--checkpoint", choices=("last", "best"), default="last", help="the newest, or the best by checkpoint.monitor"
    )
    p["diff"].add_argument("a", metavar="A", help="a run id or a spec file")
    p["diff"].add_argument("b", metavar="B", help="a run id or a spec file")
    p["diff"].add_argument("--json", action="store_true", help="print the differences as JSON")
    for parser in p.values():
        parser.add_argument(
            "--tracking-uri",
            metavar="URI",
            help="the MLflow store holding the run (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db here)",
        )
        parser.set_defaults(func=_stored_run)


def _add_sweep(sub: _Commands) -> None:
    """``runner sweep FILE``: many trials searched by Optuna, as child runs of one MLflow run, over many workers."""
    p = sub.add_parser(
        "sweep", help="search many trials of one spec with Optuna (grid, random, tpe), as child runs of one MLflow run"
    )
    _spec_args(p)
    p.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2,...",
        help="try dotted KEY at these TOML values, e.g. --grid optim.lr=0.1,0.01 (repeatable)",
    )
    p.add_argument(
        "--random",
        action="append",
        default=[],
        metavar="KEY=LOW:HIGH[:log|:int]",
        help="sample dotted KEY from a range, uniformly, log-uniformly or as integers (repeatable)",
    )
    p.add_argument("--method", choices=["grid", "random", "tpe"], help="Optuna sampler (default: sweep.method or grid)")
    p.add_argument(
        "--trials", "--num-trials", dest="trials", type=int, metavar="N", help="trials in total over all workers"
    )
    p.add_argument("--seed", type=int, metavar="S", help="seed of the sampler (default: sweep.seed or 0)")
    p.add_argument("--pruner", choices=["none", "median", "hyperband"], help="stop poor trials early (default: none)")
    p.add_argument("--storage", metavar="URL", help="Optuna storage shared by all workers (default: sqlite optuna.db)")
    p.add_argument("--study", metavar="NAME", help="Optuna study name (default: from the spec and the sweep)")
    p.add_argument("--jobs", type=int, default=1, metavar="N", help="trials this worker runs at a time (default 1)")
    p.add_argument("--metric", metavar="NAME", help="metric that ranks trials (default: sweep.metric or val/accuracy)")
    p.add_argument(
        "--mode", dest="goal", choices=["max", "min"], help="whether larger or smaller is better (default: max)"
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=_sweep)


def _add_bench(sub: _Commands) -> None:
    """``runner bench FILE``: none / dp / ddp measured side by side."""
    p = sub.add_parser("bench", help="measure none / dp / ddp side by side on this machine")
    _spec_args(p)
    p.add_argument(
        "--modes",
        metavar="M1,M2",
        help="parallel modes to compare (default: every mode, none,dp,ddp,fsdp; what cannot run here is skipped)",
    )
    p.add_argument(
        "--nproc", default="1,2", metavar="N1,N2", help="ddp process counts / dp device counts (default 1,2)"
    )
    p.add_argument(
        "--steps", type=int, default=20, metavar="N", help="timed optimizer steps per configuration (default 20)"
    )
    p.add_argument("--warmup", type=int, default=3, metavar="N", help="untimed warm-up steps first (default 3)")
    p.add_argument(
        "--repeats",
        default="2:4",
        metavar="MIN:MAX",
        help="repeats per configuration: at least MIN, more while its figures are noisy, at most MAX (default 2:4)",
    )
    p.add_argument("--out", metavar="DIR", help="folder for bench.json and bench.png (default ./bench-results)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_bench)


def _add_parity(sub: _Commands) -> None:
    """``runner parity FILE``: each mode against none, step by step in float64, with a control."""
    p = sub.add_parser(
        "parity", help="check that every parallel mode trains this spec as none does (float64, step by step)"
    )
    _spec_args(p)
    p.add_argument(
        "--modes", metavar="M1,M2", help="modes to compare with none (default: every mode this machine runs)"
    )
    p.add_argument(
        "--steps", type=int, metavar="N", help="optimizer steps per run (default: the spec's whole run, at most 1000)"
    )
    p.add_argument("--json", action="store_true", help="print the verdict as JSON")
    p.set_defaults(func=_parity)


def _spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE", help="the experiment spec (TOML)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a dotted key with a TOML value, e.g. --set optim.lr=0.05 (repeatable)",
    )
    p.add_argument("--nnodes", type=int, help="ddp: number of nodes (parallel.nnodes)")
    p.add_argument("--node-rank", type=int, help="ddp: rank of this node (parallel.node_rank)")
    p.add_argument("--nproc-per-node", type=int, help="ddp: workers per node (parallel.nproc_per_node)")
    p.add_argument(
        "--rdzv-endpoint", metavar="HOST:PORT", help="ddp: c10d rendezvous endpoint (parallel.rdzv_endpoint)"
    )
    p.add_argument(
        "--unset",
        action="append",
        default=[],
        metavar="KEY",
        help="remove dotted KEY from the spec so its default applies, e.g. --unset devices.ids (repeatable; "
        "applied before --set)",
    )


def _run_name(text: str) -> str:
    """``--run-name``: refused when empty, as ``tracking.run_name = ""`` is (leave the flag out for the default)."""
    if not text:
        raise argparse.ArgumentTypeError(f"{text!r}: a run name is not empty; leave the flag out for the default name")
    return text


def _overrides(args: argparse.Namespace) -> list[str]:
    from runner.spec.reading import parallel_flags

    ddp = {flag: getattr(args, flag) for flag in ("nnodes", "node_rank", "nproc_per_node", "rdzv_endpoint")}
    return [*args.overrides, *parallel_flags(**ddp)]


def _load(args: argparse.Namespace) -> LoadedSpec:
    """The command's spec, kept in ``args`` for :func:`main` to place the issues found later in its files."""
    from runner.spec.loading import load_spec

    loaded = load_spec(args.file, _overrides(args), getattr(args, "unset", ()))
    args.loaded = loaded
    return loaded


def _validate(args: argparse.Namespace) -> int:
    from runner.spec.loading import validate_files

    return validate_files(args.files, args.dependents_in)


def _plan(args: argparse.Namespace) -> int:
    """Print the plan first (the resolved spec with ``--spec``); exit 2 with a working fix when it cannot run here."""
    from runner.plan_report import show_plan

    loaded = _load(args)
    sweep_trials: Callable[[LoadedSpec], list[str]] | None = None
    if loaded.spec.sweep is not None:
        from runner.tools.sweep_trials import trial_names

        sweep_trials = trial_names
    show_plan(
        loaded, shown=args.file, as_json=args.json, with_spec=args.spec, sweep_trials=sweep_trials, memory=args.memory
    )
    return EXIT_OK


def _schema(args: argparse.Namespace) -> int:
    from runner.spec.editor_schema import emit_schema

    emit_schema(write=args.write, output=args.output, markdown=args.markdown)
    return EXIT_OK


def _exec(args: argparse.Namespace) -> int:
    from runner.launch.driver import exec_experiment
    from runner.launch.session import ExecOptions

    if args.allow_spec_change and not args.resume:
        raise UsageError("--allow-spec-change only applies with --resume RUN_ID")
    options = ExecOptions(
        run_name=args.run_name,
        resume=args.resume,
        allow_spec_change=tuple(args.allow_spec_change),
        parent_run_id=args.parent_run_id,
    )
    return _summarized(lambda: exec_experiment(_load(args), options))


def _summarized(job: Callable[[], Any]) -> int:
    """Run ``job``, a run's driver, its training child prestarted (importing torch meanwhile); print the summary."""
    from runner.launch.elastic import prestarted

    with prestarted():
        summary = job().summary()
    if summary:
        echo(summary)
    return EXIT_OK


def _stored_run(args: argparse.Namespace) -> int:
    """``runner status``, ``resume``, ``reproduce``, ``export``, ``test`` and ``diff``: commands on runs in the
    store."""
    from runner.launch import reproduce
    from runner.launch.resume import status_lines
    from runner.launch.scoring import score_run

    uri = args.tracking_uri
    if args.command == "status":
        lines = status_lines(uri, args.run_id)
    elif args.command == "export":
        exported = reproduce.export_run(args.run_id, uri, args.out, best=args.best, ema=args.ema)
        lines = [exported]  # the summary: never empty
    elif args.command == "test":
        lines = [score_run(args.run_id, uri, args.checkpoint)]
    elif args.command == "diff":
        reproduce.show_diff(args.a, args.b, uri, as_json=args.json)
        lines = []
    elif args.command == "resume":
        return _summarized(lambda: reproduce.resume_run(args.run_id, uri))
    else:
        return _summarized(lambda: reproduce.reproduce_run(args.run_id, uri, run_name=args.run_name))
    for line in lines:
        echo(line)
    return EXIT_OK


def _sweep(args: argparse.Namespace) -> int:
    from runner.tools.sweep import CommandLine, run_sweep

    flags = CommandLine(**{field.name: getattr(args, field.name) for field in dataclasses.fields(CommandLine)})
    report = run_sweep(
        args.file, _overrides(args), args.unset, cli=flags, jobs=args.jobs, storage=args.storage, study=args.study
    )
    return print_report(report, as_json=args.json, failure=f"{report.failed} of {len(report.trials)} trials failed")


def _bench(args: argparse.Namespace) -> int:
    from runner.spec.schema_parallel import MODES
    from runner.tools.bench import run_bench

    low, _, high = args.repeats.partition(":")  # "2:5" -> (2, 5); "3" -> (3, 3)
    try:
        repeats = int(low), int(high or low)
    except ValueError:
        raise UsageError(f"--repeats: expected MIN:MAX (e.g. 2:5) or N, got {args.repeats!r}") from None
    report = run_bench(
        args.file,
        _overrides(args),
        args.unset,
        modes=_csv(args.modes, str) if args.modes is not None else tuple(MODES),
        nprocs=_csv(args.nproc, int),
        steps=args.steps,
        warmup=args.warmup,
        repeats=repeats,
        out_dir=args.out,
    )
    return print_report(report, as_json=args.json, failure=f"{report.failed} configuration(s) failed")


def _parity(args: argparse.Namespace) -> int:
    from runner.tools.parity import run_parity

    modes = _csv(args.modes, str) if args.modes is not None else None
    report = run_parity(_load(args), modes=modes, steps=args.steps)
    return print_report(report, as_json=args.json, failure="the modes differ beyond rounding")


def _csv(text: str, kind: Callable[[str], _T]) -> list[_T]:
    try:
        return [kind(part.strip()) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"expected a comma-separated list, got {text!r}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``runner`` console script; returns the exit status (0, 1, 2 or 130): the ``exit_code`` of
    the error that ended the command."""
    parser = build_parser()
    args = argparse.Namespace()
    try:
        args = parser.parse_args(argv)
        if not getattr(args, "command", None):
            parser.print_help()
            return UsageError.exit_code
        func: Callable[[argparse.Namespace], int] = args.func
        return func(args)
    except RunnerError as exc:
        if isinstance(exc, SpecError) and hasattr(args, "loaded"):  # a key without a line, found after loading
            from runner.spec.loading import relocate_issues

            exc = relocate_issues(exc, args.loaded)
        print(f"runner: {exc.format_message()}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("runner: interrupted", file=sys.stderr)
        return Interrupted.exit_code
    except BrokenPipeError:  # e.g. `runner schema | head`: the reader left; not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK


def console() -> None:
    """The ``runner`` console script and ``python -m runner``: :func:`main`, then exit with its status
    (:func:`exit_quickly` spares the interpreter's teardown its walk over every object torch and mlflow made)."""
    exit_quickly(main())


if __name__ == "__main__":  # pragma: no cover
    console()


class ToolReport(Protocol):
    """A sweep's or a bench's report: a table, its JSON, and how many parts (trials, configurations) failed."""

    @property
    def failed(self) -> int: ...

    def table(self) -> str: ...

    def to_json(self) -> dict[str, Any]: ...


def print_report(report: ToolReport, *, as_json: bool, failure: str) -> int:
    """Print ``report`` as a table (or JSON); when part of it failed, say ``failure`` on standard error. Returns the
    command's exit status: 1 when part failed."""
    echo(json.dumps(report.to_json(), indent=2) if as_json else report.table())
    if report.failed:
        echo(f"runner: {failure}", err=True)
        return TrainingError.exit_code
    return EXIT_OK
