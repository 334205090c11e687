"""Tests of runner.tracking.tags against throw-away repositories made with the git CLI."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from runner.tracking.tags import GitInfo, git_diff, git_info

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs the git executable")


@pytest.fixture(autouse=True)
def _git_identity(git_identity):
    """Every test here runs git with a fixed identity and no machine config."""


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def make_repo(root: Path, commit: bool = True) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    git(root, "init", "-q", "-b", "main")
    (root / "experiments").mkdir()
    (root / "experiments" / "a.toml").write_text('name = "a"\n')
    if commit:
        git(root, "add", "-A")
        git(root, "commit", "-q", "-m", "init")
    return root


def test_outside_a_repository_is_none(tmp_path):
    (tmp_path / "x.toml").write_text("")
    assert git_info(tmp_path / "x.toml") is None
    assert git_info(tmp_path / "does" / "not" / "exist.toml") is None


def test_without_git_executable_is_none(tmp_path, monkeypatch):
    repo = make_repo(tmp_path / "repo")
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    assert git_info(repo / "experiments" / "a.toml") is None


def test_clean_repository(tmp_path):
    repo = make_repo(tmp_path / "repo")
    info = git_info(repo / "experiments" / "a.toml")
    assert isinstance(info, GitInfo)
    assert info.root == repo.resolve()
    assert info.commit == git(repo, "rev-parse", "HEAD").strip()
    assert len(info.commit) == 40
    assert info.branch == "main"
    assert info.dirty is False
    assert info.untracked == [] and info.untracked_count == 0
    assert info.remote_url is None
    assert info.relpath(repo / "experiments" / "a.toml") == "experiments/a.toml"
    assert info.relpath(tmp_path / "elsewhere.toml") == str((tmp_path / "elsewhere.toml").resolve())
    assert git_diff(info) == ""


def test_repository_of_the_file_not_of_the_cwd(tmp_path, monkeypatch):
    spec_repo = make_repo(tmp_path / "specs")
    other = make_repo(tmp_path / "other")
    monkeypatch.chdir(other)
    info = git_info(spec_repo / "experiments" / "a.toml")
    assert info is not None and info.root == spec_repo.resolve()


def test_modified_tracked_file_is_dirty_with_diff(tmp_path):
    repo = make_repo(tmp_path / "repo")
    (repo / "experiments" / "a.toml").write_text('name = "b"\n')
    info = git_info(repo)
    assert info is not None and info.dirty is True
    diff = git_diff(info)
    assert '-name = "a"' in diff and '+name = "b"' in diff


def test_staged_change_is_dirty(tmp_path):
    repo = make_repo(tmp_path / "repo")
    (repo / "new.py").write_text("x = 1\n")
    git(repo, "add", "new.py")
    info = git_info(repo)
    assert info is not None and info.dirty is True
    assert "+x = 1" in git_diff(info)


def test_untracked_files_are_listed_but_not_dirty(tmp_path):
    repo = make_repo(tmp_path / "repo")
    (repo / "notes.txt").write_text("hi\n")
    (repo / ".gitignore").write_text("ignored.log\n")
    (repo / "ignored.log").write_text("x\n")
    info = git_info(repo)
    assert info is not None
    assert info.dirty is False
    assert sorted(info.untracked) == [".gitignore", "notes.txt"]
    assert info.untracked_count == 2


def test_detached_head_has_no_branch(tmp_path):
    repo = make_repo(tmp_path / "repo")
    git(repo, "checkout", "-q", "--detach")
    info = git_info(repo)
    assert info is not None and info.branch is None and info.commit


def test_repository_without_commits(tmp_path):
    repo = make_repo(tmp_path / "repo", commit=False)
    git(repo, "add", "-A")
    info = git_info(repo / "experiments" / "a.toml")
    assert info is not None
    assert info.commit is None
    assert info.dirty is True
    assert '+name = "a"' in git_diff(info)


def test_remote_credentials_are_masked(tmp_path):
    repo = make_repo(tmp_path / "repo")
    git(repo, "remote", "add", "origin", "https://user:s3cret@example.com/org/proj.git")
    info = git_info(repo)
    assert info is not None
    assert info.remote_url == "https://user:***@example.com/org/proj.git"  # by runner.errors.mask_secrets


def test_diff_is_capped(tmp_path):
    repo = make_repo(tmp_path / "repo")
    (repo / "experiments" / "a.toml").write_text("x = 1\n" * 5000)
    info = git_info(repo)
    assert info is not None
    diff = git_diff(info, max_bytes=1000)
    assert len(diff) < 1200 and "truncated" in diff
