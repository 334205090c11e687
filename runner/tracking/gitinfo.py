"""Git state of the repository holding a file (commit, branch, dirty, diff), read with the git CLI.

Every function here returns ``None`` or an empty value when git is missing, the path is
outside a repository, or git fails; nothing raises, so recording provenance can never
stop a run.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

GIT_TIMEOUT_S = 10.0
MAX_UNTRACKED_LISTED = 1000


@dataclass(frozen=True)
class GitInfo:
    """Provenance of a git working tree.

    Attributes:
        root: Absolute top-level folder of the working tree.
        commit: Full hash of ``HEAD``, or ``None`` in a repository without commits.
        branch: Current branch name, or ``None`` on a detached ``HEAD``.
        dirty: Whether tracked files differ from ``HEAD`` (staged or not). Untracked
            files do not count, as with ``git describe --dirty``; they are listed in
            ``untracked`` instead.
        remote_url: URL of the ``origin`` remote with any user name or password removed,
            or ``None``.
        untracked: Untracked, not ignored files (paths relative to ``root``), at most
            ``MAX_UNTRACKED_LISTED`` of them.
        untracked_count: Number of untracked, not ignored files (may exceed the list).
    """

    root: Path
    commit: str | None
    branch: str | None
    dirty: bool
    remote_url: str | None = None
    untracked: list[str] = field(default_factory=list)
    untracked_count: int = 0

    def relpath(self, path: str | os.PathLike[str]) -> str:
        """Return ``path`` relative to :attr:`root` in POSIX form, or absolute when it lies outside.

        Args:
            path: A file path; relative paths are taken from the current directory.
        """
        p = Path(path).resolve()
        try:
            return p.relative_to(self.root).as_posix()
        except ValueError:
            return str(p)


def _git(cwd: Path, *args: str, max_bytes: int | None = None) -> str | None:
    """Run ``git -C cwd args`` and return stdout, or ``None`` when it fails in any way."""
    env = dict(os.environ)
    # Never take the index lock (status would otherwise refresh it) and keep output parseable.
    env.update(GIT_OPTIONAL_LOCKS="0", LC_ALL="C", GIT_TERMINAL_PROMPT="0")
    try:
        proc = subprocess.run(
            ["git", "-C", str(cwd), *args],
            capture_output=True,
            timeout=GIT_TIMEOUT_S,
            env=env,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    out = proc.stdout
    if max_bytes is not None and len(out) > max_bytes:
        out = (
            out[:max_bytes]
            + f"\n[... truncated: diff is {len(proc.stdout)} bytes, kept the first {max_bytes}]\n".encode()
        )
    return out.decode("utf-8", errors="replace")


def _strip_credentials(url: str) -> str:
    """Remove ``user:password@`` from an URL (tokens are often embedded in https remotes)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if parts.scheme in ("http", "https") and "@" in parts.netloc:
        host = parts.netloc.rsplit("@", 1)[1]
        return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))
    return url


def git_info(path: str | os.PathLike[str]) -> GitInfo | None:
    """Describe the git working tree that contains ``path``.

    Args:
        path: A file or folder; the repository searched is the one containing it (not the
            current directory).

    Returns:
        A :class:`GitInfo`, or ``None`` when ``path`` is not inside a working tree, git is
        not installed, or git fails. Never raises.
    """
    p = Path(path).resolve()
    start = p if p.is_dir() else p.parent
    if not start.is_dir():
        return None
    top = _git(start, "rev-parse", "--show-toplevel")
    if not top or not top.strip():
        return None
    root = Path(top.strip()).resolve()
    head = _git(root, "rev-parse", "--verify", "--quiet", "HEAD")
    commit = head.strip() if head and head.strip() else None
    branch_out = _git(root, "symbolic-ref", "--quiet", "--short", "HEAD")
    branch = branch_out.strip() if branch_out and branch_out.strip() else None
    status = _git(root, "status", "--porcelain", "--untracked-files=no")
    dirty = bool(status and status.strip())
    others = _git(root, "ls-files", "--others", "--exclude-standard", "-z")
    untracked_all = [f for f in (others or "").split("\0") if f]
    remote = _git(root, "remote", "get-url", "origin")
    remote_url = _strip_credentials(remote.strip()) if remote and remote.strip() else None
    return GitInfo(
        root=root,
        commit=commit,
        branch=branch,
        dirty=dirty,
        remote_url=remote_url,
        untracked=untracked_all[:MAX_UNTRACKED_LISTED],
        untracked_count=len(untracked_all),
    )


def git_diff(info: GitInfo, max_bytes: int = 5 * 1024 * 1024) -> str:
    """Return ``git diff HEAD`` (staged and unstaged changes to tracked files) of a working tree.

    Args:
        max_bytes: Keep at most this many bytes of the diff; a marker line says when it was cut.

    Returns:
        The patch text (binary files show as "Binary files ... differ"); in a repository
        without commits, the diff of the index against the empty tree; ``""`` when clean
        or when git fails. Never raises.
    """
    if info.commit is not None:
        base = "HEAD"
    else:
        empty = _git(info.root, "hash-object", "-t", "tree", os.devnull)
        if not empty or not empty.strip():
            return ""
        base = empty.strip()
    return _git(info.root, "diff", "--no-color", "--no-ext-diff", base, max_bytes=max_bytes) or ""
