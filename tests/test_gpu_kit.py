"""The GPU kit's lock covers runner's dependencies that the GPU image lacks, offline.

benchmarks/gpu_kit.lock pins what benchmarks/gpu_kit.sh downloads; a dependency added to pyproject.toml
(or a new requirement of a pinned release) that neither the lock nor the image list holds fails here,
instead of as an ImportError on a GPU machine without network. The fix is ``benchmarks/gpu_kit.sh --lock``.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).parents[1]
_SPEC = importlib.util.spec_from_file_location("gpu_kit", REPO / "benchmarks" / "gpu_kit.py")
assert _SPEC is not None and _SPEC.loader is not None
kit = importlib.util.module_from_spec(_SPEC)
sys.modules["gpu_kit"] = kit
_SPEC.loader.exec_module(kit)

LOCK = kit.read_lock()
IMAGE = kit.read_image()
NEEDS = {name: needs for name, (_, needs) in LOCK.items()}
RELOCK = "run benchmarks/gpu_kit.sh --lock"


def test_the_lock_holds_exactly_what_runner_needs_and_the_image_lacks() -> None:
    closure, missing = kit.kit_closure(kit.runner_requirements(), NEEDS, IMAGE)
    assert not missing, f"the GPU kit lacks {sorted(missing)}: {RELOCK}"
    assert set(LOCK) == closure, f"the GPU kit holds wheels nothing needs: {sorted(set(LOCK) - closure)}: {RELOCK}"
    assert not set(LOCK) & set(IMAGE), "a wheel of the kit would shadow the image's own package"


def test_a_new_dependency_missing_from_the_lock_is_caught() -> None:
    roots = [*kit.runner_requirements(), Requirement("newdep>=1")]
    needs = {**NEEDS, "pydantic": [*NEEDS["pydantic"], Requirement("pydantic-extra-thing")]}
    assert kit.kit_closure(roots, needs, IMAGE)[1] == {"newdep", "pydantic-extra-thing"}
    assert kit.kit_closure([Requirement("numpy")], {}, IMAGE) == (set(), set())  # the image's: no wheel


def test_the_pins_meet_every_specifier() -> None:
    pins = {name: version for name, (version, _) in LOCK.items()} | {n: v for n, v in IMAGE.items() if v}
    reqs = [("pyproject.toml", r) for r in kit.runner_requirements()]
    reqs += [(f"{name}=={LOCK[name][0]}", r) for name, needs in NEEDS.items() for r in needs]
    broken = [
        f"{who} needs {r}, pinned {pins[n]}"
        for who, r in reqs
        if (n := canonicalize_name(r.name)) in pins and not r.specifier.contains(Version(pins[n]), prereleases=True)
    ]
    assert not broken, f"{broken}: {RELOCK}"


def test_fallbacks_are_image_packages_that_kit_wheels_bound() -> None:
    bounded = {canonicalize_name(r.name) for needs in NEEDS.values() for r in needs if r.specifier}
    fallbacks = kit.read_fallbacks()
    assert "typing-extensions" in fallbacks  # pydantic needs a recent one; the image's version is unknown
    assert set(fallbacks) <= bounded & {n for n, v in IMAGE.items() if v is None}


def test_the_lock_agrees_with_the_installed_releases_metadata() -> None:
    """A pinned release installed here at the same version declares no requirement the lock dropped."""
    checked = 0
    for name, (version, needs) in LOCK.items():
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        if dist.version != version:
            continue
        checked += 1
        declared = {canonicalize_name(r.name) for r in map(Requirement, dist.requires or ()) if kit.applies(r)}
        assert declared <= {canonicalize_name(r.name) for r in needs}, f"{name}=={version}: {RELOCK}"
    if not checked:
        pytest.skip("no release of the lock is installed here at its pinned version")


def test_the_kit_folder_is_ignored_by_git() -> None:
    proc = subprocess.run(["git", "check-ignore", "--no-index", "-q", ".whl/a.whl"], cwd=REPO, check=False)
    assert proc.returncode == 0, ".whl/ is not in .gitignore"


def test_every_part_the_gpu_check_runs_is_defined() -> None:
    """A part added to gpu_check.sh's run list has its function (a typo would surface only on a GPU)."""
    script = REPO / "benchmarks" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    text = script.read_text(encoding="utf-8")
    called = set(re.findall(r"^\s*part ([\w-]+) \d+", text, flags=re.MULTILINE))
    defined = {name.replace("_", "-") for name in re.findall(r"^part_(\w+)\(\)", text, flags=re.MULTILINE)}
    assert {"kit", "cuda-tests", "none", "dp-1", "ddp-1", "amp-fp16", "sync-debug", "fsdp", "parity"} <= called
    assert called <= defined, f"parts without a function: {sorted(called - defined)}"
