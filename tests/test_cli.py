"""The command line: exit codes, messages, and the shipped example specs."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from runner.cli import main
from runner.errors import UsageError

REPO = Path(__file__).parents[1]
EXPERIMENTS = sorted((REPO / "experiments").glob("**/*.toml"))


@pytest.mark.parametrize("path", EXPERIMENTS, ids=[str(p.relative_to(REPO)) for p in EXPERIMENTS])
def test_every_shipped_spec_validates(path: Path, capsys) -> None:
    assert main(["validate", str(path)]) == 0
    assert capsys.readouterr().out.startswith("ok")


def test_there_are_shipped_specs_in_subfolders_too() -> None:
    assert len(EXPERIMENTS) >= 4 and any(p.parent.name != "experiments" for p in EXPERIMENTS)


def test_validate_reports_each_file_and_exits_2_when_one_is_bad(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(
        'name = "x"\n[model]\nname = "mlp"\n[data]\ndataset = "synthetic"\nbatch_size = 0\n[optim]\nlr = 0.1\n'
    )
    assert main(["validate", str(EXPERIMENTS[0]), str(bad)]) == 2
    captured = capsys.readouterr()
    assert f"ok    {EXPERIMENTS[0]}" in captured.out and f"error {bad}" in captured.out
    assert f"{bad}:6: data.batch_size" in captured.err


def test_validate_imports_neither_torch_nor_mlflow() -> None:
    code = (
        "import sys; from runner.cli import main; rc = main(['validate', sys.argv[1]]); "
        "print(sorted(m for m in ('torch', 'mlflow') if m in sys.modules)); sys.exit(rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(EXPERIMENTS[0])], capture_output=True, text=True, cwd=REPO, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("entry", [["-m", "runner"], ["-m", "runner.launch.elastic"]])
def test_runner_processes_exit_with_their_status_and_the_imported_objects_frozen(entry: list[str], tmp_path) -> None:
    """The console script, ``python -m runner`` and the training child end through ``exit_quickly``: the teardown's
    last collection skips the objects alive at the end (about 1 s of every process, benchmarks/README.md)."""
    (tmp_path / "args.pk").write_bytes(pickle.dumps(None))  # not a WorkerArgs: the child returns 1
    args = ["validate", str(tmp_path / "missing.toml")] if entry[-1] == "runner" else [str(tmp_path / "args.pk")]
    code = (
        "import atexit, gc, runpy, sys; "
        "atexit.register(lambda: print('frozen', gc.get_freeze_count() > 0)); "
        f"sys.argv = ['x', *{args!r}]; runpy.run_module({entry[-1]!r}, run_name='__main__')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=False)
    assert proc.returncode != 0 and proc.stdout.splitlines()[-1] == "frozen True", (proc.stdout, proc.stderr)


@pytest.mark.parametrize("command", ["exec", "reproduce"])
def test_an_empty_run_name_exits_2_as_the_key_does(command: str, capsys) -> None:
    """``--run-name ""`` used to fall back to the default name, while ``tracking.run_name = ""`` is refused."""
    target = str(EXPERIMENTS[0]) if command == "exec" else "0123abcd"
    assert main([command, target, "--run-name", ""]) == 2
    assert "--run-name: '': a run name is not empty" in capsys.readouterr().err


def test_sweep_takes_unset_as_exec_does(tmp_path: Path, capsys) -> None:
    """``--unset tracking.enabled`` lifts the spec's ``false``: the sweep gets as far as its bad trial value."""
    spec = tmp_path / "s.toml"
    spec.write_text(
        'name = "s"\n[model]\nname = "mlp"\n[data]\ndataset = "synthetic"\nbatch_size = 8\n'
        "[optim]\nlr = 0.1\n[tracking]\nenabled = false\n"
    )
    argv = ["sweep", str(spec), "--grid", "optim.lr=0.1,-1"]
    assert main(argv) == 2
    assert "tracking.enabled = true" in capsys.readouterr().err
    assert main([*argv, "--unset", "tracking.enabled"]) == 2
    err = capsys.readouterr().err
    assert "optim.lr" in err and "tracking.enabled" not in err


def test_bench_takes_unset_as_exec_does(tmp_path: Path, capsys, monkeypatch) -> None:
    import runner.spec.loading

    seen = []

    def load_spec(path, overrides=(), unset=()):
        seen.append((list(overrides), list(unset)))
        raise UsageError("stop here")

    monkeypatch.setattr(runner.spec.loading, "load_spec", load_spec)
    assert main(["bench", "spec.toml", "--unset", "devices.ids", "--set", "seed=1"]) == 2
    assert seen == [(["seed=1"], ["devices.ids"])]


def test_plan_of_dp_spec_on_a_cpu_machine_explains_and_exits_2(capsys, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert main(["plan", str(REPO / "experiments" / "resnet_dp.toml"), "--no-memory"]) == 2
    out, err = capsys.readouterr()
    assert "resnet_dp.toml" in err and "no GPU is visible" in err and "Traceback" not in err
    assert "memory" not in out  # --no-memory: no torch, no fake step


def test_plan_json_of_ddp_spec(capsys) -> None:
    assert main(["plan", str(REPO / "experiments" / "digits_mlp_ddp.toml"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["world_size"] == 2 and info["launch"] == "elastic"
    assert info["devices"]["per_device_batch"] == [32, 32] and info["devices"]["backend"] == "gloo"


def test_plan_shows_overrides_and_multi_node_flags(capsys) -> None:
    spec = str(REPO / "experiments" / "digits_mlp_ddp.toml")
    assert main(["plan", spec, "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "10.0.0.1:29500", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["world_size"] == 4
    assert info["rendezvous"]["endpoint"] == "10.0.0.1:29500" and info["rendezvous"]["node_rank"] == 1


def test_plan_human_output_has_the_batch_split(capsys) -> None:
    assert main(["plan", str(REPO / "experiments" / "digits_mlp_ddp.toml")]) == 0
    out = capsys.readouterr().out
    assert "global batch   64 = 32 + 32 per device" in out and "[optim]" not in out  # the plan alone
    assert "rendezvous     c10d at localhost:<free port>" in out
    assert "its store listens on every interface (torch's TCPStore binds no single address)" in out
    assert main(["plan", str(REPO / "experiments" / "digits_mlp_ddp.toml"), "--spec"]) == 0
    out = capsys.readouterr().out
    assert out.index("global batch   64 = 32 + 32 per device") < out.index("[optim]")  # the plan first


def test_schema_is_json_schema_with_documented_fields(capsys) -> None:
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["$schema"].endswith("2020-12/schema")
    batch = schema["$defs"]["DataSpec"]["properties"]["batch_size"]
    assert "GLOBAL" in batch["description"] and batch["minimum"] == 1


def test_usage_errors_exit_2(capsys) -> None:
    assert main([]) == 2
    assert main(["exec"]) == 2
    assert main(["frobnicate"]) == 2
    assert main(["exec", str(EXPERIMENTS[0]), "--allow-spec-change", "optim.lr"]) == 2
    assert "--resume" in capsys.readouterr().err


def test_missing_spec_file_exits_2(tmp_path: Path, capsys) -> None:
    assert main(["exec", str(tmp_path / "nope.toml")]) == 2
    assert "nope.toml" in capsys.readouterr().err


def test_version_and_help(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.startswith("runner ")
    with pytest.raises(SystemExit):
        main(["exec", "--help"])
    assert "--resume" in capsys.readouterr().out


def test_python_dash_m_runner_works() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "runner", "validate", str(EXPERIMENTS[0])], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0 and proc.stdout.startswith("ok")
