"""Provenance of a new run (tags, git artifacts), how values and names are written to MLflow, and its spec records.
Imports neither mlflow nor torch.

A run found in the MLflow UI months later must say what made it: the code (git commit, dirty files), the
machine, the versions and the spec as written; written in one place, so every run says it alike.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import importlib.util
import json
import os
import re
import shlex
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import runner
from runner.errors import mask_secrets
from runner.spec.dump import active_params, group_sha256

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

    from runner.spec.loading import LoadedSpec
    from runner.spec.schema import ExperimentSpec


NOTES_TAG = "runner.notes"
DESCRIPTION_TAG = "mlflow.note.content"  # the run's description: Markdown at the top of its page in the MLflow UI
# The longest runner.* tag value, one line: MLflow's UI cuts a tag chip and a column at their width; the full text
# goes to the run's description (description_with). Kept whole: the paths resume and export read, the long texts.
COLUMN_CHARS = 80
_REMARKS_HEADING = "#### runner"
_REMARK = re.compile(r"^\*\*([^*\n]+)\*\*: ?", re.MULTILINE)


def _torch_versions() -> tuple[str, str]:
    """``(torch version, its CUDA version or "none")`` from ``torch/version.py``, without importing torch (§6)."""
    found = importlib.util.find_spec("torch")
    if found is None or not found.submodule_search_locations:
        return "none", "none"
    try:
        text = (Path(next(iter(found.submodule_search_locations))) / "version.py").read_text()
    except OSError:
        return "unknown", "unknown"
    version, cuda = (re.search(rf"^{name}\b.*= '([^']*)'", text, re.MULTILINE) for name in ("__version__", "cuda"))
    return version.group(1) if version else "unknown", cuda.group(1) if cuda else "none"


def _git_tags(info: GitInfo) -> dict[str, str]:
    """``runner.git.*`` and MLflow's ``mlflow.source.git.*`` tags of a working tree."""
    tags = {
        "runner.git.dirty": "true" if info.dirty else "false",
        "runner.git.untracked_files": str(info.untracked_count),
    }
    if info.commit:
        tags["mlflow.source.git.commit"] = info.commit
    if info.branch:
        tags["runner.git.branch"] = info.branch
        tags["mlflow.source.git.branch"] = info.branch
    if info.remote_url:
        tags["mlflow.source.git.repoURL"] = info.remote_url
    return tags


def planned(plan_description: Mapping[str, Any], key: str) -> Any:
    """``key`` of a plan description (a whole plan, or a device plan's), or ``None``."""
    nested = plan_description.get("devices")
    return plan_description.get(key) or (nested.get(key) if isinstance(nested, Mapping) else None)


def _device_tags(plan_description: Mapping[str, Any]) -> dict[str, Any]:
    """``runner.devices``, ``runner.world_size``, ``runner.accelerator`` of a plan's (or its devices') description."""
    tags: dict[str, Any] = {}
    nested = plan_description.get("devices")
    device_plan = nested if isinstance(nested, Mapping) else plan_description
    names = device_plan.get("names") or [
        d["name"] for d in device_plan.get("devices") or () if isinstance(d, Mapping) and d.get("name")
    ]
    if names:
        tags["runner.devices"] = ", ".join(str(n) for n in names)
    elif device_plan.get("accelerator") == "cpu":
        tags["runner.devices"] = "cpu"
    for key in ("world_size", "accelerator"):
        if (value := planned(plan_description, key)) is not None:
            tags[f"runner.{key}"] = value
    return tags


CODE_TAG = "runner.code"  # the user's modules the spec names, "file:digest ...": runner diff tells code apart


def code_digests(loaded: LoadedSpec) -> str:
    """``"model.py:1a2b3c4d5e6f ..."``: the SHA-256 (12 digits) of each module the spec imports by path (model,
    data, loss, metrics, callbacks), found without importing it, so two runs' code differs visibly even outside git;
    ``"none"`` when the spec names none."""
    from runner.spec.names import find_module, metric_name

    spec = loaded.spec
    metrics = [*spec.metrics.train, *spec.metrics.val] if spec.metrics is not None else []
    targets = [spec.model.name, spec.data.dataset, spec.loss.name, *map(metric_name, metrics)]
    found = [find_module(t, loaded.path.parent) for t in [*targets, *(c.name for c in spec.callbacks)] if ":" in t]
    files = sorted({Path(f.origin) for f in found if f is not None and f.origin and Path(f.origin).is_file()})
    return " ".join(f"{p.name}:{hashlib.sha256(p.read_bytes()).hexdigest()[:12]}" for p in files) or "none"


def run_tags(
    loaded: LoadedSpec,
    plan_description: Mapping[str, Any],
    info: GitInfo | None,
    extra_tags: Mapping[str, Any] | None = None,
    parent_run_id: str | None = None,
) -> dict[str, str]:
    """The tags of a new run: provenance, environment, spec tags, ``runner.overrides``, ``runner.notes``, then
    ``extra_tags``; values cut to MLflow's ``MAX_TAG_VAL_LENGTH``."""
    spec = loaded.spec
    torch_version, cuda_version = _torch_versions()
    spec_path = info.relpath(loaded.path) if info is not None else str(Path(loaded.path).resolve())
    tags: dict[str, Any] = {
        "mlflow.source.type": "LOCAL",  # MLflow's source of a run started from a local file, shown in its UI
        "mlflow.source.name": spec_path,
        "runner.spec.path": spec_path,
        "runner.spec.sha256": loaded.sha256,
        "runner.spec.group": group_sha256(spec),
        "runner.version": runner.__version__,
        "runner.torch_version": torch_version,
        "runner.cuda_version": cuda_version,
        "runner.hostname": socket.gethostname(),
        "runner.parallel_mode": plan_description.get("mode", spec.parallel.mode),
        CODE_TAG: code_digests(loaded),
    }
    with contextlib.suppress(Exception):  # no user name in containers without a passwd entry
        tags["mlflow.user"] = getpass.getuser()
    if info is not None:
        tags.update(_git_tags(info))
    tags.update(_device_tags(plan_description))
    if tags.get("runner.accelerator", "cuda") != "cuda" and cuda_version not in ("none", "unknown"):
        tags["runner.cuda_version"] = f"{cuda_version} (torch build; no GPU used)"
    remarks = {}
    if loaded.overrides or loaded.unset:
        tags[OVERRIDES_TAG] = remarks["overrides"] = shlex.join(loaded.command_line())  # --set k=v --unset k
    notes = [str(n) for n in planned(plan_description, "notes") or ()]
    if notes:
        tags[NOTES_TAG] = "; ".join(notes)
        remarks["notes"] = "\n".join(f"- {n}" for n in notes) if len(notes) > 1 else notes[0]
    if spec.description or remarks:
        tags[DESCRIPTION_TAG] = description_with(spec.description or "", remarks, max_tag_chars())
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    tags.update(spec.tags)
    tags.update(extra_tags or {})
    limit = max_tag_chars()
    return column_tags({k: shorten(param_value(v), limit, "the run's artifacts") for k, v in tags.items()})


def column_value(text: str, limit: int = COLUMN_CHARS) -> str:
    """``text`` on one line (runs of whitespace become one space), cut to ``limit`` characters ending in "…"."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"


def column_tags(tags: Mapping[str, str]) -> dict[str, str]:
    """``tags`` with every ``runner.*`` value but those kept whole made a :func:`column_value`; other keys unchanged."""
    whole = ("runner.spec.path", "runner.checkpoint_dir", "runner.parity.summary", "runner.bench.recommendation")
    return {k: column_value(v) if k.startswith("runner.") and k not in whole else v for k, v in tags.items()}


def description_with(description: str, remarks: Mapping[str, str], limit: int | None = None) -> str:
    """A run's Markdown description: the user's text, then runner's ``remarks`` under ``#### runner`` (a label
    replaces its earlier remark; several lines go into a code block unless a list).

    Within ``limit`` characters (MLflow's longest tag value) the user's text is the part cut, so a long spec
    ``description`` never pushes runner's own section out; the whole text is the ``description`` key of the artifact
    ``spec/resolved.toml``."""
    head, found, earlier = ("\n\n" + description).rpartition(f"\n\n{_REMARKS_HEADING}\n")
    own, earlier = (head[2:], earlier) if found else (description, "")
    parts = _REMARK.split(earlier)
    kept = {label: text.strip() for label, text in zip(parts[1::2], parts[2::2], strict=True)}
    for label, raw in remarks.items():
        text = raw.strip()
        multiline = "\n" in text and not text.startswith("- ")
        kept[label] = "```\n" + text.replace("```", "'''") + "\n```" if multiline else text
    if not kept:
        return own
    body = "\n\n".join(
        f"**{label}**:" + ("\n" if text.startswith(("- ", "```")) else " ") + text for label, text in kept.items()
    )
    section = f"{_REMARKS_HEADING}\n{body}"
    if limit is not None and own and len(own) + 2 + len(section) > limit:
        own = shorten(own, max(0, limit - 2 - len(section)), "artifact spec/resolved.toml, key description")
    return f"{own}\n\n{section}" if own else section


def git_artifacts(info: GitInfo | None) -> dict[str, str]:
    """``git/diff.patch`` when tracked files differ from ``HEAD`` and ``git/untracked.txt`` when untracked files
    exist."""
    out: dict[str, str] = {}
    if info is None:
        return out
    if info.dirty:
        out["git/diff.patch"] = git_diff(info)
    if info.untracked:
        more = info.untracked_count - len(info.untracked)
        out["git/untracked.txt"] = "\n".join(info.untracked) + (f"\n[... and {more} more]" if more > 0 else "") + "\n"
    return out


_BAD_KEY_CHARS = re.compile(r"[^/\w.\- :]")


def param_value(value: Any) -> str:
    """One flattened spec value as a stable MLflow param: ``true``, ``1``, ``1.0`` (``repr``), JSON for lists and
    tables."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, default=str)
    return str(value)


def safe_key(key: str) -> str:
    """Replace the characters MLflow rejects in names with ``_`` (``model.kwargs.hidden|x`` ->
    ``model.kwargs.hidden_x``)."""
    return _BAD_KEY_CHARS.sub("_", key)


def shorten(text: str, limit: int, where: str) -> str:
    """Cut ``text`` to ``limit`` characters with a marker saying how long it was and ``where`` the rest is (e.g.
    ``"artifact spec/resolved.toml"``)."""
    if len(text) <= limit:
        return text
    marker = f"...[truncated from {len(text)} chars; full text in {where}]"
    return text[: max(0, limit - len(marker))] + marker


def max_tag_chars() -> int:
    """MLflow's limit on the length of a tag value (``MAX_TAG_VAL_LENGTH``, 8000 in MLflow 3)."""
    from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

    return int(MAX_TAG_VAL_LENGTH)


def max_param_chars() -> int:
    """MLflow's limit on the length of a param value (``MAX_PARAM_VAL_LENGTH``, 6000 in MLflow 3)."""
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    return int(MAX_PARAM_VAL_LENGTH)


RESOLVED = "spec/resolved.toml"
PLAN = "spec/plan.json"
OVERRIDES_TAG = "runner.overrides"


# A data factory may return its own validation (and test) set: whether these keys applied is known once it ran.
SPLIT_KEYS = ("data.val_fraction", "data.test_fraction", "data.split_seed")


def spec_params(spec: ExperimentSpec, accelerator: str | None = None, *, split: bool | None = None) -> dict[str, str]:
    """The MLflow params of a spec: the keys that apply (docs/design.md §10), as strings within MLflow's limits.

    ``None`` values are left out; a value over ``MAX_PARAM_VAL_LENGTH`` is cut with a pointer to ``spec/resolved.toml``.
    ``accelerator = "cpu"`` leaves out GPU-only keys too. With a data factory, :data:`SPLIT_KEYS` wait for the data
    (``split=None``, a new run's params): once it is built, ``split=True`` gives them alone, when the factory's one set
    was split.
    """

    limit = max_param_chars()
    params = {
        safe_key(key): shorten(param_value(value), limit, f"artifact {RESOLVED}")
        for key, value in active_params(spec, accelerator).items()
        if value is not None
    }
    if ":" not in spec.data.dataset:
        return params
    return {k: v for k, v in params.items() if (k in SPLIT_KEYS) == bool(split)}


def spec_artifacts(loaded: LoadedSpec, resolved_toml: str, plan_json: str) -> dict[str, str]:
    """Artifact path -> text of a new run's spec: every file read under ``spec/`` at its relative path, the resolved
    spec and the plan (a file named like those is stored as ``source-<name>``)."""
    sources = list(loaded.sources) or [(Path(loaded.path), loaded.source_text)]
    root = Path(os.path.commonpath([str(Path(p).parent) for p, _ in sources]))
    out: dict[str, str] = {}
    for path, text in sources:
        relative = PurePosixPath(Path(path).relative_to(root).as_posix())
        if str(relative) in ("resolved.toml", "plan.json"):
            relative = relative.with_name(f"source-{relative.name}")
        out[f"spec/{relative}"] = text
    out[RESOLVED] = resolved_toml
    out[PLAN] = plan_json
    return out


GIT_TIMEOUT_S = 10.0
MAX_UNTRACKED_LISTED = 1000


@dataclass(frozen=True)
class GitInfo:
    """Provenance of a git working tree; ``dirty`` counts tracked files only (untracked ones are listed, at most
    ``MAX_UNTRACKED_LISTED``); ``remote_url`` without credentials."""

    root: Path
    commit: str | None
    branch: str | None
    dirty: bool
    remote_url: str | None = None
    untracked: list[str] = field(default_factory=list)
    untracked_count: int = 0

    def relpath(self, path: str | os.PathLike[str]) -> str:
        """``path`` (relative: to the current directory) relative to :attr:`root` in POSIX form, or absolute when it
        lies outside."""
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


def git_info(path: str | os.PathLike[str]) -> GitInfo | None:
    """The git working tree that contains the file or folder ``path`` (not the current directory's), or ``None`` when
    ``path`` is not inside one, git is not installed, or git fails. Never raises."""
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
    remote_url = mask_secrets(remote.strip()) if remote and remote.strip() else None  # tokens in https remotes
    return GitInfo(root, commit, branch, dirty, remote_url, untracked_all[:MAX_UNTRACKED_LISTED], len(untracked_all))


def git_diff(info: GitInfo, max_bytes: int = 5 * 1024 * 1024) -> str:
    """``git diff HEAD`` of a working tree (staged and unstaged changes to tracked files; binary files show as
    "Binary files ... differ"), at most ``max_bytes`` with a marker line when cut; in a repository without commits,
    the index against the empty tree; ``""`` when clean or when git fails. Never raises."""
    if info.commit is not None:
        base = "HEAD"
    else:
        empty = _git(info.root, "hash-object", "-t", "tree", os.devnull)
        if not empty or not empty.strip():
            return ""
        base = empty.strip()
    return _git(info.root, "diff", "--no-color", "--no-ext-diff", base, max_bytes=max_bytes) or ""


def tag_run(
    client: MlflowClient, run_id: str, tags: Mapping[str, str], remarks: Mapping[str, str] | None = None
) -> None:
    """Set ``tags`` and add ``remarks`` to the run's description; MlflowException when the store rejects it."""
    from mlflow.entities import RunTag

    values = column_tags(tags)
    if remarks:
        current = client.get_run(run_id).data.tags.get(DESCRIPTION_TAG, "")
        values[DESCRIPTION_TAG] = shorten(
            description_with(current, remarks, max_tag_chars()), max_tag_chars(), "the run's artifacts"
        )
    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in values.items()], synchronous=True)
