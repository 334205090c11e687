"""Credentials in store URIs never leave the process; a bad store URI exits 2 naming where it was typed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runner.cli import main
from runner.errors import TrackingError, mask_secrets
from runner.tracking.uri import check_reachable
from tests.helpers import write_spec_file


@pytest.mark.parametrize(
    ("uri", "masked"),
    [
        ("http://alice:s3cret@host:5000", "http://alice:***@host:5000"),
        ("postgresql://user:pw@127.0.0.1:1/db", "postgresql://user:***@127.0.0.1:1/db"),
        ("mysql+pymysql://u:p%40ss:w@h/db", "mysql+pymysql://u:***@h/db"),
        ("https://TOKEN@host/x", "https://***@host/x"),
        ("postgresql://h/db?user=u&password=pw", "postgresql://h/db?user=u&password=***"),
        ("postgresql://user@h/db", "postgresql://user@h/db"),
        ("sqlite:////tmp/a.db", "sqlite:////tmp/a.db"),
        ("http://dan:it's@n0t@h:1/api", "http://dan:***@h:1/api"),
        ("uri = 'postgresql://u:p@ss@h/db' here", "uri = 'postgresql://u:***@h/db' here"),
        ("{'uri': 'http://h:5000', 'to': 'a@b'}", "{'uri': 'http://h:5000', 'to': 'a@b'}"),
        ('at "http://alice:s3cret@h:1/api": refused', 'at "http://alice:***@h:1/api": refused'),
        # these leaked: an e-mail as user name, a ' in a user or a token, a git remote with an e-mail user
        ("http://alice@corp.example:pw@host:5000", "http://alice@corp.example:***@host:5000"),
        ("http://o'brien:s3cret@host:5000", "http://o'brien:***@host:5000"),
        ("https://to'ken@host/x", "https://***@host/x"),
        ("https://bob@corp.example:ghp_tok3n@git.example/r.git", "https://bob@corp.example:***@git.example/r.git"),
        ("postgresql://o'neil:pw@h/db", "postgresql://o'neil:***@h/db"),
        ("ssh://git@git.example/r.git", "ssh://git@git.example/r.git"),
    ],
)
def test_mask_secrets_masks_every_credential_of_a_url(uri: str, masked: str) -> None:
    assert mask_secrets(uri) == masked
    assert mask_secrets(masked) == masked


def test_every_error_message_is_masked() -> None:
    assert "s3cret" not in TrackingError("cannot reach http://alice:s3cret@h:1").format_message()


@pytest.fixture
def spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return write_spec_file(tmp_path / "spec.toml", train={"epochs": 1})


@pytest.mark.parametrize(
    ("uri", "says"),
    [
        ("sqlite://relative.db", '"sqlite:///relative.db" (relative to here)'),
        ("", "is empty: remove the key"),
        (
            "sqlite:///",
            'an in-memory database: its runs would vanish when runner ends: write three slashes and the path, "sqlite:///mlflow.db"',
        ),
        ("sqlite:///:memory:", "an in-memory database"),
        ("mlflow-artifacts://u:pgs3cret@127.0.0.1:1/x", "mlflow-artifacts: is not a tracking store"),
        ("postgresql://carol:pgs3cret@127.0.0.1:1/db", "cannot open the tracking store postgresql://carol:***@"),
        ("mysql+nosuchdriver://carol:pgs3cret@127.0.0.1:1/db", "install the mysql driver"),
        ("mssql+nosuchdriver://carol:pgs3cret@127.0.0.1:1/db", "install the mssql driver"),
    ],
)
def test_a_bad_store_uri_in_the_spec_exits_2_at_its_line_masked(spec: Path, uri: str, says: str, capsys) -> None:
    spec.write_text(spec.read_text().replace("[tracking]\n", f'[tracking]\nuri = "{uri}"\n'))
    line = spec.read_text().splitlines().index(f'uri = "{uri}"') + 1
    assert main(["exec", str(spec)]) == 2
    err = capsys.readouterr().err
    assert f"{spec}:{line}: tracking.uri: " in err and says in err, err
    assert "pgs3cret" not in err and "Traceback" not in err
    assert not (spec.parent / "mlflow.db").exists()


def test_a_bad_store_uri_from_set_or_the_environment_names_where_it_came_from(
    spec: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["exec", str(spec), "--set", 'tracking.uri="postgresql://u:pw1secret@127.0.0.1:1/db"']) == 2
    err = capsys.readouterr().err
    assert '(from --set tracking.uri="postgresql://u:***@127.0.0.1:1/db")' in err and "pw1secret" not in err
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "postgresql://u:pw2secret@127.0.0.1:1/db")
    assert main(["exec", str(spec)]) == 2
    err = capsys.readouterr().err
    assert "MLFLOW_TRACKING_URI: cannot open the tracking store postgresql://u:***@" in err and "pw2secret" not in err


def test_check_reachable_fails_fast_on_a_database_that_is_not_there() -> None:
    with pytest.raises(TrackingError) as info:
        check_reachable("postgresql+psycopg://u:pw@127.0.0.1:1/db", timeout_s=2)
    assert "postgresql+psycopg://u:***@127.0.0.1:1/db (OperationalError" in info.value.format_message()  # the sink


def test_mlflow_prints_no_view_run_line() -> None:
    """The package sets it for every process that tracks (and the processes they start)."""
    code = "import os, runner.tracking; print(os.environ['MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT'])"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "true"


def test_the_sinks_mask_what_messages_carry_as_it_is(tmp_path: Path, capsys) -> None:
    """Messages carry a URL whole; the console, report files and the Optuna storage mask it."""
    from runner.errors import echo
    from runner.tools.bench_report import BenchReport, write_json
    from runner.tools.sweep_space import TrialResult
    from runner.tools.sweep_study import _recorded

    echo("at http://alice:s3cret@h:1")
    echo("at postgresql://u:pgs3cret@h/db", err=True)
    out = capsys.readouterr()
    assert out.out == "at http://alice:***@h:1\n" and out.err == "at postgresql://u:***@h/db\n"
    report = BenchReport("s.toml", "s", "cpu", 8, 1, 0, False, [], tracking_uri="http://bob:t0psecret@h:1")
    assert json.loads(write_json(report, tmp_path / "b.json").read_text())["tracking_uri"] == "http://bob:***@h:1"
    failed = TrialResult(0, {}, None, "FAILED", error="TrackingError: cannot reach http://carol:pw@h:1")
    assert _recorded(failed)["error"] == "TrackingError: cannot reach http://carol:***@h:1"


def test_diff_of_two_spec_files_prints_no_credentials(tmp_path: Path, capsys) -> None:
    a = write_spec_file(tmp_path / "a.toml", tracking={"uri": "postgresql://u:s3cret@h/db"})
    b = write_spec_file(tmp_path / "b.toml", tracking={"uri": "postgresql://u:0ther@h/db"})
    assert main(["diff", str(a), str(b)]) == 0
    text = capsys.readouterr().out
    assert "tracking.uri" in text and "postgresql://u:***@h/db" in text
    assert "s3cret" not in text and "0ther" not in text
