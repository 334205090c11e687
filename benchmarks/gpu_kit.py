"""The GPU kit: wheels of what runner needs and a GPU machine's image lacks, for a machine without network.

``benchmarks/gpu_kit.sh`` and ``benchmarks/gpu_check.sh`` call this; ``tests/test_gpu_kit.py`` checks the lock.
Three files decide the kit: ``pyproject.toml`` (runner's dependencies), ``benchmarks/gpu_image_packages.txt``
(what the image holds: ``name`` or ``name==version``) and ``benchmarks/gpu_kit.lock`` (written by ``lock``):
one line per wheel, ``name==version  # needs: req; req``, the requirements of that release that apply on
CPython 3.12, Linux x86_64, markers evaluated. The kit is every package reachable from runner's dependencies
through ``needs`` without passing through a package the image holds.

    python benchmarks/gpu_kit.py lock           resolve on the package index (network) and write the lock
    python benchmarks/gpu_kit.py requirements   the lock's name==version lines, for pip download
    python benchmarks/gpu_kit.py view DIR       DIR: links to this interpreter's packages the image holds
    python benchmarks/gpu_kit.py conflicts      kit requirements that installed packages do not meet (exit 1)
    python benchmarks/gpu_kit.py fallbacks DIR  the fallback wheels in DIR that those conflicts call for
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[1]
IMAGE = REPO / "benchmarks" / "gpu_image_packages.txt"
LOCK = REPO / "benchmarks" / "gpu_kit.lock"
PYTHON = "3.12.3"  # the image's python3
# pip matches a manylinux tag exactly: name every glibc level the image's (2.39) can load.
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(17, 40)] + ["manylinux2014_x86_64", "manylinux1_x86_64"]


def _name(name: str) -> str:
    """The canonical form of a package name (PEP 503): ``Typing_Extensions`` -> ``typing-extensions``."""
    return str(canonicalize_name(name))


def target_env(python: str = PYTHON, extra: str = "") -> dict[str, str]:
    """Marker environment of CPython ``python`` (``X.Y.Z``) on Linux x86_64."""
    return {
        "python_version": ".".join(python.split(".")[:2]),
        "python_full_version": python,
        "implementation_name": "cpython",
        "implementation_version": python,
        "platform_python_implementation": "CPython",
        "os_name": "posix",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "platform_release": "",
        "platform_version": "",
        "extra": extra,
    }


def applies(req: Requirement, extras: Iterable[str] = (), python: str = PYTHON) -> bool:
    """Whether ``req`` holds on the target for a package installed with ``extras``."""
    if req.marker is None:
        return True
    return any(req.marker.evaluate(target_env(python, e)) for e in ("", *extras))


def runner_requirements(pyproject: Path = REPO / "pyproject.toml", python: str = PYTHON) -> list[Requirement]:
    """``[project] dependencies`` of ``pyproject`` that apply on the target."""
    deps = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["dependencies"]
    return [r for r in map(Requirement, deps) if applies(r, python=python)]


def read_image(path: Path = IMAGE) -> dict[str, str | None]:
    """Canonical name -> version (``None`` when unknown) of the image's packages."""
    out: dict[str, str | None] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        pin = line.split("#", 1)[0].strip()
        if pin:
            name, _, version = pin.partition("==")
            out[_name(name)] = version or None
    return out


def read_lock(path: Path = LOCK) -> dict[str, tuple[str, list[Requirement]]]:
    """Canonical name -> (version, needs) of the lock's wheels."""
    out: dict[str, tuple[str, list[Requirement]]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        if line.endswith("# fallback"):
            continue
        pin, _, needs = line.partition("# needs:")
        name, _, version = pin.strip().partition("==")
        out[_name(name)] = (version, [Requirement(r) for r in needs.split(";") if r.strip()])
    return out


def read_fallbacks(path: Path = LOCK) -> dict[str, str]:
    """Canonical name -> version of the lock's fallback wheels."""
    lines = path.read_text(encoding="utf-8").splitlines()
    pins = (line.split("#", 1)[0].strip().partition("==") for line in lines if line.endswith("# fallback"))
    return {_name(name): version for name, _, version in pins}


def kit_closure(
    roots: Iterable[Requirement], needs: Mapping[str, list[Requirement]], image: Iterable[str]
) -> tuple[set[str], set[str]]:
    """(kit, missing): names reachable from ``roots`` through ``needs``, stopping at ``image``.

    ``missing`` are reachable names without an entry in ``needs`` (a lock that lacks them).
    """
    held, kit, missing = set(image), set(), set()
    todo = [_name(r.name) for r in roots]
    while todo:
        name = todo.pop()
        if name in held or name in kit or name in missing:
            continue
        if name not in needs:
            missing.add(name)
            continue
        kit.add(name)
        todo.extend(_name(r.name) for r in needs[name])
    return kit, missing


def _resolve(roots: list[Requirement], image: Mapping[str, str | None], python: str) -> list[dict]:
    """pip's resolution of ``roots`` for the target (its --dry-run --report ``install`` items)."""
    with tempfile.TemporaryDirectory() as tmp:
        pins = Path(tmp, "image.txt")
        pins.write_text("".join(f"{n}=={v}\n" for n, v in image.items() if v), encoding="utf-8")
        platforms = [a for p in PLATFORMS for a in ("--platform", p)]
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q"]
        cmd += ["--report", str(Path(tmp, "report.json")), "--target", str(Path(tmp, "t")), "-c", str(pins)]
        cmd += ["--python-version", python, "--implementation", "cp", "--only-binary=:all:", *platforms]
        subprocess.run([*cmd, *map(str, roots)], check=True)
        return json.loads(Path(tmp, "report.json").read_text(encoding="utf-8"))["install"]


def write_lock(path: Path = LOCK, python: str = PYTHON) -> int:
    """Resolve runner's dependencies that the image lacks and write the kit's lock; the number of wheels.

    Image packages of unknown version that a kit wheel needs at some minimum version get a pure-Python
    ``fallback`` line: gpu_check.sh installs that wheel only where the image's own version falls short.
    """
    image = read_image()
    roots = [r for r in runner_requirements(python=python) if _name(r.name) not in image]
    items = {_name(i["metadata"]["name"]): i for i in _resolve(roots, image, python)}
    metas = {name: item["metadata"] for name, item in items.items()}
    extras: dict[str, set[str]] = {}
    for meta in metas.values():  # extras asked for anywhere add their requirements to the package's needs
        for r in map(Requirement, meta.get("requires_dist", [])):
            if r.extras and applies(r, python=python):
                extras.setdefault(_name(r.name), set()).update(r.extras)
    needs = {
        name: [r for r in map(Requirement, meta.get("requires_dist", [])) if applies(r, extras.get(name, ()), python)]
        for name, meta in metas.items()
    }
    kit, missing = kit_closure(roots, needs, image)
    if missing:
        raise SystemExit(f"pip's resolution lacks {sorted(missing)}")
    bounded = {_name(r.name) for n in kit for r in needs[n] if r.specifier}
    fallbacks = sorted(
        n for n in bounded - kit if image.get(n) is None and items[n]["download_info"]["url"].endswith("-none-any.whl")
    )
    lines = [
        "# The wheels benchmarks/gpu_kit.sh downloads into .whl/: runner's dependencies that",
        "# benchmarks/gpu_image_packages.txt lacks, with theirs, for CPython 3.12 on manylinux x86_64;",
        "# `fallback` lines go to .whl/fallback/, for an image whose version of that package is too old.",
        "# Written by `benchmarks/gpu_kit.sh --lock`; tests/test_gpu_kit.py checks it. Do not edit by hand.",
    ]
    for name in sorted(kit):
        reqs = "; ".join(sorted({_plain(r) for r in needs[name]}))
        lines.append(f"{name}=={metas[name]['version']}" + (f"  # needs: {reqs}" if reqs else ""))
    lines += [f"{name}=={metas[name]['version']}  # fallback" for name in fallbacks]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return len(kit)


def _plain(req: Requirement) -> str:
    """``req`` without its marker and extras (both already applied), e.g. ``alembic!=1.10.0,<2``."""
    return f"{_name(req.name)}{req.specifier}"


def image_view(dest: Path) -> int:
    """Fill ``dest`` with links to this interpreter's installed files of the image's packages; the count.

    Packages count as the image's when ``gpu_image_packages.txt`` names them or torch needs them (this
    interpreter's torch stands for the image's, CUDA libraries included). Folders shared with other
    packages (namespace packages) are made as folders and only the image's files in them linked.
    """
    image = set(read_image())
    dists = {_name(d.metadata["Name"]): d for d in md.distributions()}
    todo, torch_needs = ["torch"], set()
    while todo:  # torch's own requirements, as installed here
        name = todo.pop()
        if name in dists and name not in torch_needs:
            torch_needs.add(name)
            reqs = (Requirement(r) for r in dists[name].requires or ())
            todo += [_name(r.name) for r in reqs if r.marker is None or r.marker.evaluate()]
    image |= torch_needs
    tree: dict = {}  # path part -> subtree; the key "" holds whether image / other packages own files below
    for name, dist in dists.items():
        for f in dist.files or ():
            if ".." in f.parts:
                continue
            node = tree
            for part in f.parts:
                node = node.setdefault(part, {"": set()})
                node[""].add(name in image)
    site = Path(str(dists["torch"].locate_file("")))
    return _link(tree, site, dest)


def _link(tree: dict, src: Path, dest: Path) -> int:
    """Link ``src``'s entries that only the image's packages own; recurse into those shared with others."""
    dest.mkdir(parents=True, exist_ok=True)
    count = 0
    for part, child in tree.items():
        if not part or True not in child[""]:
            continue
        if False not in child[""] or not (src / part).is_dir():
            (dest / part).symlink_to(src / part)
            count += 1
        else:
            count += _link(child, src / part, dest / part)
    return count


def conflicts() -> dict[str, list[str]]:
    """Installed package (canonical name) -> the lock's requirements on it that its version does not meet."""
    found: dict[str, list[str]] = {}
    for name, (version, needs) in sorted(read_lock().items()):
        for req in needs:
            try:
                have = md.version(req.name)
            except md.PackageNotFoundError:
                have = "not installed"
            else:
                if not req.specifier or req.specifier.contains(Version(have), prereleases=True):
                    continue
            found.setdefault(_name(req.name), []).append(f"{name}=={version} needs {req}: {have}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["lock", "requirements", "view", "conflicts", "fallbacks"])
    parser.add_argument("dir", nargs="?", type=Path, help="view: the folder to fill; fallbacks: the wheels' folder")
    args = parser.parse_args(argv)
    if args.command == "lock":
        print(f"{LOCK.relative_to(REPO)}: {write_lock()} wheels")
    elif args.command == "requirements":  # the kit's pins, then the fallbacks' after a line "--fallback"
        print("\n".join(f"{n}=={v}" for n, (v, _) in sorted(read_lock().items())))
        print("\n".join(["--fallback", *(f"{n}=={v}" for n, v in read_fallbacks().items())]))
    elif args.command == "view":
        if args.dir is None or args.dir.exists():
            parser.error("view needs a folder that does not exist yet")
        print(f"{args.dir}: {image_view(args.dir)} links to the image's packages of {sys.executable}")
    elif args.command == "fallbacks":  # the fallback wheels in DIR that installed versions make necessary
        wheels = {_name(w.name.split("-")[0]): w for w in (args.dir or Path()).glob("*.whl")}
        print("\n".join(str(wheels[n]) for n in conflicts() if n in wheels))
    else:
        lines = [line for found in conflicts().values() for line in found]
        print("\n".join(lines) if lines else "the kit's requirements on installed packages hold")
        return 1 if lines else 0
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    sys.exit(main())
