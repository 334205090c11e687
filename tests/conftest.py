"""Shared fixtures: a clean environment per test, a temporary MLflow store, spec writing helpers."""

from __future__ import annotations

import contextlib
import os
import shutil
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import spec_text

_ENV_PREFIXES = ("MLFLOW_", "MASTER_", "TORCHELASTIC_", "RUNNER_", "SLURM_")
_ENV_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
)


def _snapshot() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES) or k in _ENV_KEYS}


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Start every test without launcher/MLflow variables, restore them after, and leave no process group, no
    active MLflow run and no tracking URI set through MLflow's fluent API."""
    before = _snapshot()
    for key in before:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)
    yield
    for key in set(_snapshot()) - set(before):
        os.environ.pop(key, None)
    os.environ.update(before)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except ImportError:  # pragma: no cover
        pass
    try:
        import mlflow

        while mlflow.active_run() is not None:
            mlflow.end_run()
        mlflow.set_tracking_uri(None)  # type: ignore[arg-type]  # unset: the next test's store is its own
    except ImportError:  # pragma: no cover
        pass


@pytest.fixture
def git_identity(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A fixed git author/committer and no global or system git config (HOME is the test folder)."""
    for key, value in {
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.com",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.com",
        "GIT_CONFIG_NOSYSTEM": "1",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("HOME", str(tmp_path))


@pytest.fixture(scope="session")
def _created_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty MLflow sqlite store whose schema MLflow created once for the whole session."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("created-store") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments(max_results=1)
    return path


@pytest.fixture
def ready_store(tmp_path: Path, _created_store: Path) -> str:
    """A fresh sqlite tracking URI whose store already exists (a copy of the session's): no migration per test."""
    target = tmp_path / "ready.db"
    shutil.copyfile(_created_store, target)
    return f"sqlite:///{target}"


@pytest.fixture
def store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh sqlite tracking URI in the test's temporary folder, ``mlflow.db``.

    Under the ``created_store`` marker the file is there already, a copy of the session's created store:
    the runs of the test start without a schema migration (about 1.5 s each on 2 cores).
    """
    path = tmp_path / "mlflow.db"
    if request.node.get_closest_marker("created_store") is not None:
        shutil.copyfile(request.getfixturevalue("_created_store"), path)
    return f"sqlite:///{path}"


@pytest.fixture
def write_spec(tmp_path: Path, store: str) -> Callable[..., Path]:
    """Write a spec file; ``write_spec(extra="...")`` appends TOML, ``text=`` replaces the minimal spec.

    The minimal spec is ``helpers.MINIMAL`` logging to this test's ``store``.
    """

    def write(extra: str = "", *, text: str | None = None, name: str = "spec.toml") -> Path:
        body = spec_text(tracking={"uri": store}) if text is None else text
        path = tmp_path / name
        path.write_text(textwrap.dedent(body) + "\n" + textwrap.dedent(extra), encoding="utf-8")
        return path

    return write


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """Under pytest-xdist (``-n``), the tests of one ``*_integration.py`` module run on one worker, one at a time.

    So a module-scoped fixture that starts an expensive run (a DDP job, a server, a finished run to resume)
    starts it once. Modules run beside each other; every other test is scheduled on its own. This replaces
    ``--dist loadgroup`` (the project's default), whose marked groups do not reach the scheduler under pytest 9.
    """
    from xdist.scheduler import LoadScheduling, LoadScopeScheduling

    if config.getvalue("dist") != "loadgroup":
        return None
    if config.getoption("markexpr") == "not integration":
        return LoadScheduling(config, log)  # spreads the fast tier best: 52 s against 63 s by test

    class ByIntegrationModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module.endswith("_integration.py") else nodeid

    return ByIntegrationModule(config, log)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under ``-m "not integration"`` (the fast tier) a ``*_integration.py`` module is not even imported: every test
    in one is marked ``integration`` (checked below, whenever the module is collected)."""
    if collection_path.name.endswith("_integration.py") and config.getoption("markexpr") == "not integration":
        return True
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    unmarked = [
        item.nodeid
        for item in items
        if item.path.name.endswith("_integration.py") and item.get_closest_marker("integration") is None
    ]
    if unmarked:
        raise pytest.UsageError(f"tests in *_integration.py modules must be marked integration: {unmarked}")


def _end_descendants() -> None:
    """End every process this one started, and theirs (a ``runner exec`` an interrupted test never waited for)."""
    import psutil

    try:
        descendants = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for process in descendants:
        with contextlib.suppress(psutil.Error):
            process.kill()


def pytest_keyboard_interrupt(excinfo: pytest.ExceptionInfo[BaseException]) -> None:
    """Ctrl-C (or SIGINT) to the suite: the processes its tests started end with it, while they are still this
    process's descendants (the workers of ``-n`` included, whose own children would be orphaned once they end)."""
    _end_descendants()


def pytest_unconfigure(config: pytest.Config) -> None:
    """At the end of a session, in each worker (or the one process without ``-n``): nothing a test started is left
    running. The main process of ``-n`` leaves its workers to xdist."""
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        _end_descendants()
