"""pre-commit takes this repository as a hook source: good specs commit, a bad one (or a base that breaks one) blocks it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import SMALL, spec_text

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

REPO = Path(__file__).parents[2]
BIN = Path(sys.executable).parent
BASE = spec_text(SMALL, name="base")
CHILD = 'extends = "base/common.toml"\nname = "child"\n\n[train]\nepochs = 2\n'


def _run(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, check=False, timeout=180)


def _snapshot_of_this_repository(target: Path, env: dict[str, str]) -> str:
    """This working tree (tracked and untracked, not ignored) as a one-commit git repository; returns its commit."""
    listed = _run(["git", "ls-files", "-co", "--exclude-standard", "-z"], REPO, env).stdout.split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    for args in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "snapshot"]):
        assert _run(args, target, env).returncode == 0
    return _run(["git", "rev-parse", "HEAD"], target, env).stdout.strip()


@pytest.fixture
def project(tmp_path: Path, git_identity) -> tuple[Path, dict[str, str]]:
    """A git repository of specs whose pre-commit config names this repository as the hook source."""
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}/usr/bin{os.pathsep}/bin",
        "PYTHONPATH": str(REPO),  # the `runner` on PATH runs this working tree
        "PRE_COMMIT_HOME": str(tmp_path / "pre-commit-cache"),
    }
    source = tmp_path / "runner-source"
    source.mkdir()
    rev = _snapshot_of_this_repository(source, env)
    work = tmp_path / "specs"
    (work / "experiments" / "base").mkdir(parents=True)
    (work / "experiments" / "base" / "common.toml").write_text(BASE, encoding="utf-8")
    (work / "experiments" / "child.toml").write_text(CHILD, encoding="utf-8")
    (work / "pyproject.toml").write_text('[project]\nname = "not-a-spec"\n', encoding="utf-8")
    config = {"repos": [{"repo": str(source), "rev": rev, "hooks": [{"id": "runner-validate"}]}]}
    (work / ".pre-commit-config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    assert _run(["git", "init", "-q"], work, env).returncode == 0
    installed = _run([str(BIN / "pre-commit"), "install"], work, env)
    assert installed.returncode == 0, installed.stderr
    return work, env


def _commit(work: Path, env: dict[str, str], message: str) -> subprocess.CompletedProcess[str]:
    assert _run(["git", "add", "-A"], work, env).returncode == 0
    return _run(["git", "commit", "-m", message], work, env)


def test_good_specs_commit_and_a_bad_one_blocks_the_commit(project) -> None:
    work, env = project
    good = _commit(work, env, "specs")
    assert good.returncode == 0, good.stdout + good.stderr
    assert "runner validate....." in good.stderr and "Passed" in good.stderr, "the hook ran on the specs"

    (work / "experiments" / "child.toml").write_text(CHILD + '\n[parallel]\nmdoe = "ddp"\n', encoding="utf-8")
    bad = _commit(work, env, "typo")
    assert bad.returncode != 0
    output = bad.stdout + bad.stderr
    assert "Failed" in output and "experiments/child.toml:8: parallel.mdoe" in output
    head = _run(["git", "log", "--format=%s"], work, env).stdout.split()
    assert head == ["specs"], "the bad spec must not be committed"


def test_editing_a_base_re_validates_the_specs_that_extend_it(project) -> None:
    work, env = project
    child = work / "experiments" / "child.toml"
    child.write_text(CHILD + "\n[optim]\nmomentum = 0.9\n", encoding="utf-8")
    assert _commit(work, env, "specs").returncode == 0
    # Only the base changes, and it is a valid spec alone; the spec on top of it no longer is
    # (momentum is sgd's: the child's momentum no longer applies once the base switches to adam).
    base = work / "experiments" / "base" / "common.toml"
    base.write_text(spec_text(SMALL, name="base", optim={"name": "adam"}), encoding="utf-8")
    assert _run([sys.executable, "-m", "runner", "validate", str(base)], work, env).returncode == 0
    broken = _commit(work, env, "base switches the optimizer")
    assert broken.returncode != 0
    output = broken.stdout + broken.stderr
    assert "base  experiments/base/common.toml: checked through 1 spec(s) that extend it" in output
    assert "error experiments/child.toml" in output and "optim.momentum" in output
