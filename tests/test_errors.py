"""Exit codes live on the exception classes; the CLI maps every RunnerError with one except."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import runner.cli as cli
from runner.errors import (
    DeviceError,
    Interrupted,
    RunnerError,
    SpecError,
    SpecIssue,
    TrackingError,
    TrainingError,
    UsageError,
)
from runner.launch.driver import ExecResult

RUNNER = Path(__file__).parents[1] / "runner"


@pytest.mark.parametrize(
    ("cls", "code"),
    [
        (RunnerError, 1),
        (SpecError, 2),
        (UsageError, 2),
        (DeviceError, 2),
        (TrackingError, 2),
        (TrainingError, 1),
        (Interrupted, 130),
    ],
)
def test_each_class_carries_its_exit_code(cls: type[RunnerError], code: int):
    assert cls.exit_code == code


def test_subclasses_inherit_the_exit_code():
    from runner.training.checkpoint import CheckpointError

    assert CheckpointError.exit_code == 1


def test_messages_have_their_heading():
    assert UsageError("bad flag").format_message() == "error: bad flag"
    assert TrainingError("rank 1 failed: boom").format_message() == "training failed: rank 1 failed: boom"
    two = SpecError([SpecIssue(Path("a.toml"), 1, "x", "one"), SpecIssue(Path("a.toml"), 2, "y", "two")])
    assert two.format_message() == "error:\n  a.toml:1: x: one\n  a.toml:2: y: two"
    stopped = Interrupted(2, run_id="r1").format_message()
    assert stopped.startswith("interrupted: run r1 is KILLED") and stopped.endswith(": runner resume r1")
    elsewhere = Interrupted(15, run_id="r1", command="runner resume r1 --tracking-uri sqlite:////x.db")
    assert elsewhere.format_message().endswith("Continue it with: runner resume r1 --tracking-uri sqlite:////x.db")
    assert Interrupted().format_message() == "interrupted: stopped (SIGINT)"
    assert Interrupted(15, rank=1).format_message() == "interrupted: stopped (SIGTERM at rank 1)"


def test_device_error_names_its_key_and_can_be_placed():
    error = DeviceError("ids = [3] asks for [3]", key="devices.ids")
    assert str(error) == "devices.ids: ids = [3] asks for [3]"
    placed = error.located(Path("s.toml"), 9)
    assert str(placed) == "s.toml:9: devices.ids: ids = [3] asks for [3]" and placed.key == "devices.ids"
    assert str(DeviceError("no key")) == "no key"


class _Custom(RunnerError):
    exit_code = 7
    heading = "custom"


@pytest.mark.parametrize(
    ("error", "code", "heading"),
    [
        (SpecError("x.toml:1: a: bad"), 2, "runner: error: "),
        (UsageError("bad flag"), 2, "runner: error: "),
        (DeviceError("no GPU", key="devices.accelerator"), 2, "runner: error: devices.accelerator: no GPU"),
        (TrackingError("store down"), 2, "runner: error: store down"),
        (TrainingError("rank 0 failed"), 1, "runner: training failed: rank 0 failed"),
        (Interrupted(15), 130, "runner: interrupted: stopped (SIGTERM)"),
        (_Custom("seven"), 7, "runner: custom: seven"),
        (KeyboardInterrupt(), 130, "runner: interrupted"),
    ],
)
def test_main_maps_what_a_command_raises(monkeypatch, capsys, error: BaseException, code: int, heading: str):
    def command(args):
        raise error

    monkeypatch.setattr(cli, "_validate", command)
    assert cli.main(["validate", "any.toml"]) == code
    captured = capsys.readouterr()
    assert captured.err.startswith(heading) and "Traceback" not in captured.err


def test_broken_pipe_is_not_an_error(monkeypatch, tmp_path: Path):
    def command(args):
        raise BrokenPipeError

    redirected: list[int] = []
    monkeypatch.setattr(cli, "_schema", command)
    monkeypatch.setattr(cli.os, "dup2", lambda fd, target: redirected.append(target))
    with open(tmp_path / "out", "w") as stdout:
        monkeypatch.setattr(cli.sys, "stdout", stdout)
        assert cli.main(["schema"]) == 0
        assert redirected == [stdout.fileno()]  # later writes go to the null device, not the closed pipe


def test_main_has_one_except_for_runner_errors():
    tree = ast.parse((RUNNER / "cli.py").read_text())
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    caught = [ast.unparse(h.type) for node in ast.walk(main) if isinstance(node, ast.Try) for h in node.handlers]
    assert caught == ["RunnerError", "KeyboardInterrupt", "BrokenPipeError"]
    errors = {"SpecError", "UsageError", "DeviceError", "TrackingError", "TrainingError", "Interrupted"}
    handlers = [n for n in ast.walk(tree) if isinstance(n, ast.ExceptHandler) and n.type is not None]
    assert {ast.unparse(h.type) for h in handlers} & errors <= {"SpecError"}  # validate goes on after a bad file
    assert "EXIT_FAILED" not in (RUNNER / "cli.py").read_text()


@pytest.mark.parametrize("module", ["cli.py", "plan.py", "launch/driver.py", "launch/resume.py"])
def test_launcher_variables_are_read_through_launcher_environment(module: str):
    text = (RUNNER / module).read_text()
    assert not re.search(r"environ(\.get)?[\[(]\s*[\"'](RANK|LOCAL_RANK|WORLD_SIZE|RUNNER_RUN_ID)", text)
    assert not re.search(r"env\[[\"'](RANK|WORLD_SIZE)", text)


def test_exec_summary_is_printed_by_rank_0_only():
    result = ExecResult(
        run_id="r1",
        status="FINISHED",
        metrics={"val/loss": 0.25, "train/loss": 0.5},
        tracking_uri="sqlite:///m.db",
        experiment="e",
        checkpoint_dir="c",
        notes=["resuming from step-1.pt"],
    )
    assert result.summary().splitlines() == [
        "note: resuming from step-1.pt",
        "status: FINISHED",
        "run id: r1  (experiment 'e')",
        "  train/loss             0.5",
        "  val/loss               0.25",
        "open the UI: mlflow ui --backend-store-uri sqlite:///m.db",
    ]
    result.experiment_id = "3"  # the run's page, in the UI's training view (MLflow 3 opens GenAI without it)
    assert result.summary().splitlines()[-1] == (
        "open the run: mlflow ui --backend-store-uri sqlite:///m.db, "
        "then http://127.0.0.1:5000/#/experiments/3/runs/r1?workflowType=machine_learning"
    )
    result.startup_s = 3.04
    assert "start-up: 3.0 s to the end of the first step (metric time_to_first_step_s)" in result.summary().splitlines()
    result.metrics = {"val/a_rather_long_custom_metric_name": 1.0, "train/loss": 0.5}
    values = [line.rsplit(" ", 1) for line in result.summary().splitlines() if line.startswith("  ")]
    assert len({len(head) for head, _ in values}) == 1  # one column, however long the names
    result.rank = 1
    assert result.summary() == ""
    quiet = ExecResult(None, "FINISHED", {}, None, "e", "c")
    assert quiet.summary() == "status: FINISHED"


def test_start_up_counts_from_runners_import_when_a_shell_execd_into_runner(tmp_path: Path) -> None:
    """``sh -c 'setup && runner exec ...'`` runs its last command in the shell's own process, created before the setup:
    the start-up figure must not include the setup (a fresh clone's README command 1 once reported 245 s)."""
    import subprocess
    import sys

    stamp = tmp_path / "before-exec"
    code = "from runner.launch.driver import process_started_at; print(repr(process_started_at(exec_gap_s=1.0)))"
    script = f'sleep 1.5; date +%s.%N > {stamp}; exec "$0" -c "$1"'
    done = subprocess.run(["sh", "-c", script, sys.executable, code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) >= float(stamp.read_text())  # not the shell's creation, 1.5 s before (as exec_gap_s=1e9)


def test_a_ranks_user_code_error_keeps_all_its_lines_and_other_errors_their_last_line():
    from types import SimpleNamespace

    from runner.launch.failures import python_error

    def failure(trace: str) -> SimpleNamespace:
        return SimpleNamespace(error_file_data={"message": {"extraInfo": {"py_callstack": trace}}})

    located = (
        'Traceback (most recent call last):\n  File "x.py", line 1, in f\n'
        "runner.errors.UserCodeError: loss.name: your code raised IndexError: boom (at /p/m.py:3, in loss)\n"
        "your frames (most recent call last):\n  m.py:3 in loss: return x[5]\n"
    )
    assert python_error(failure(located)).splitlines() == [
        "loss.name: your code raised IndexError: boom (at /p/m.py:3, in loss)",
        "your frames (most recent call last):",
        "  m.py:3 in loss: return x[5]",
    ]
    assert python_error(failure("Traceback ...\nRuntimeError: plain\n")) == "RuntimeError: plain"
    multi_line = (  # fully_shard's refusal of a ModuleList: its repr spans lines; the last one is ")"
        'Traceback (most recent call last):\n  File "fsdp.py", line 9, in fully_shard\n    raise ValueError(\n'
        "    ^^^^^^^^^^^^^^^^^\n"  # Python 3.11's carets under the code
        "ValueError: fully_shard does not support containers that do not implement forward: ModuleList(\n"
        "  (0-1): 2 x Block()\n)\n"
    )
    assert python_error(failure(multi_line)) == (
        "ValueError: fully_shard does not support containers that do not implement forward: ModuleList("
    )


def test_store_errors_maps_mlflow_errors_once_and_passes_runners_own_through(tmp_path: Path) -> None:
    from mlflow.exceptions import MlflowException

    from runner.errors import store_errors
    from runner.tracking.uri import client_for

    with pytest.raises(TrackingError) as info, store_errors("read run x"):
        raise MlflowException("Run 'x' not found")
    assert str(info.value) == "could not read run x: Run 'x' not found"  # MLflow's own message, not its repr
    with pytest.raises(TrackingError) as info, store_errors("read run x"):
        raise ConnectionError("refused")
    assert str(info.value) == "could not read run x: ConnectionError: refused"
    with pytest.raises(TrackingError) as info, store_errors("outer"):
        raise TrackingError("the experiment 'e' is deleted")
    assert str(info.value) == "the experiment 'e' is deleted"  # not wrapped twice
    uri = f"sqlite:///{tmp_path}/m.db"
    assert client_for(uri) is client_for(uri) and client_for(uri) is not client_for(uri + "2")


def test_first_line_names_an_error_by_its_first_line_or_a_tracebacks_last() -> None:
    from runner.errors import first_line

    assert first_line(RuntimeError("bad shape\nException raised from at::native ... (C++ frames)")) == "bad shape"
    traceback = 'Traceback (most recent call last):\n  File "t.py", line 3, in f\n    x()\nValueError: boom\n'
    assert first_line(traceback) == "ValueError: boom"
    dead = "the sweep worker process exited with status 1\nloading\n\nKeyError: 'lr'\n"  # sweep_jobs' message
    assert first_line(dead) == "the sweep worker process exited with status 1"
    assert first_line("") == "" and first_line(ValueError()) == ""
