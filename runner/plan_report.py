"""What ``runner plan`` prints: the plan as text, and the memory each device holds in every mode (an estimate from
fake tensors) with the FLOPs of a step. What cannot run here, and the fix, are found in :mod:`runner.plan`."""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from runner.errors import echo, first_line
from runner.plan import plan_or_problem

if TYPE_CHECKING:  # pragma: no cover
    from runner.devices.inventory import Inventory
    from runner.spec.loading import LoadedSpec
    from runner.spec.schema import ExperimentSpec


_LAUNCH_TEXT = {
    "in-process": "one process",
    "elastic": "elastic launcher (torchrun machinery)",
    "external": "already a worker (torchrun / scheduler)",
}


def format_plan(info: dict[str, Any]) -> str:
    """``runner plan``'s text for :meth:`Plan.describe` (or :func:`describe_unrunnable`): one line per fact, and for
    a spec this machine cannot run, what is missing and the command that runs instead."""
    lines = [f"plan for {info['spec']}", _row("run name", info.get("run_name") or "(set when the run starts)")]
    dev = info.get("devices")
    launch = info.get("launch")
    lines.append(_row("mode", f"{info['mode']} ({_LAUNCH_TEXT.get(launch, launch)})" if launch else info["mode"]))
    lines += _device_lines(info, dev) if dev else [_row("devices", info.get("asked", "?"))]
    if dev:
        split = " + ".join(str(b) for b in dev["per_device_batch"])
        accum = f" x {info['grad_accum_steps']} micro-steps" if info["grad_accum_steps"] > 1 else ""
        lines.append(_row("global batch", f"{info['global_batch_size']} = {split} per device{accum}"))
    else:
        lines.append(_row("global batch", str(info["global_batch_size"])))
    if "rendezvous" in info:
        r = info["rendezvous"]
        where = f"c10d at {r['endpoint']} (id {r['id']}, node rank {r['node_rank']}, max restarts {r['max_restarts']})"
        lines.append(_row("rendezvous", where))
        if r["node_rank"] == 0:
            lines.append(_row("", f"its store listens on {r['listens_on']}"))
    tracking = f"{info['tracking_uri']} (experiment {info['experiment']!r})" if info["tracking_uri"] else "off"
    if "slurm" in info:
        slurm = info["slurm"]
        requeued = f", requeued {slurm['restart_count']}x: resumes its run" if slurm["restart_count"] else ""
        text = _SLURM_LAYOUTS[slurm["layout"]].format(**slurm)
        counts = f"SLURM_NTASKS={slurm['ntasks']}, SLURM_NNODES={slurm['nnodes']}"
        lines.append(_row("slurm", f"job {slurm['job_id']}, {text} ({counts}){requeued}"))
    lines.append(_row("tracking", tracking))
    lines.append(_row("checkpoints", info.get("checkpoint_dir") or "off"))
    if dev and dev.get("env"):
        lines.append(_row("environment", " ".join(f"{k}={v}" for k, v in dev["env"].items())))
    by_reason: dict[str, list[str]] = {}  # "parallel.backend, parallel.timeout_s: ddp only (mode = "none")"
    for key, why in (info.get("inactive") or {}).items():
        by_reason.setdefault(why, []).append(key)
    lines += [_row("inactive", f"{', '.join(keys)}: {why}") for why, keys in by_reason.items()]
    lines += [_row("note", note) for note in info.get("notes", [])]
    if (trials := info.get("trials")) is not None:
        lines += [
            _row("trials", f"{len(trials)} (runner sweep)"),
            *(_row("", f"{i}: {t}") for i, t in enumerate(trials)),
        ]
    return "\n".join(lines)  # what cannot run, and the fix, are the error's to print (once, on stderr)


def _row(label: str, value: str) -> str:
    return f"  {label:<14} {value}"


def _device_lines(info: dict[str, Any], dev: dict[str, Any]) -> list[str]:
    """Accelerator, one line per device (id -> CUDA_VISIBLE_DEVICES entry -> cuda:i, name), world size."""
    lines = [_row("accelerator", dev["accelerator"] + (f", backend {dev['backend']}" if dev.get("backend") else ""))]
    for d in dev.get("devices", []):
        uuid = f", {d['uuid']}" if d.get("uuid") else ""
        lines.append(
            _row("device", f"id {d['id']} -> visible {d['entry']} -> cuda:{d['cuda_index']} {d['name']}{uuid}")
        )
    if not dev.get("devices"):
        lines.append(
            _row("device", "cpu" + (f" ({dev['nproc_per_node']} processes)" if dev["nproc_per_node"] > 1 else ""))
        )
    world = f"{info['world_size']} ({dev['nnodes']} node(s) x {dev['nproc_per_node']} process(es))"
    return [*lines, _row("world size", world)]


_SLURM_LAYOUTS = {
    "per-device": "one task per device: this task is rank {procid} of {ntasks}",
    "per-node": "one task per node: this task launches node {nodeid}'s workers ({nnodes} node(s))",
    "batch": "the batch script itself (not started by srun): one launcher on this node",
}


def show_plan(
    loaded: LoadedSpec,
    *,
    shown: str,
    as_json: bool = False,
    with_spec: bool = False,
    sweep_trials: Callable[[LoadedSpec], list[str]] | None = None,
    memory: bool = True,
) -> None:
    """``runner plan``: print the plan (JSON, the resolved spec, the memory estimate, a sweep's trials as asked).

    ``sweep_trials`` is passed in by the command line (the core does not import the tools). The plan is printed first; a
    spec this machine cannot run then raises DeviceError with a working fix.
    """
    from runner.devices.inventory import probe_inventory
    from runner.launch.prebuild import known_differences
    from runner.spec.dump import dump_spec

    inventory = probe_inventory(os.environ)
    info, problem = plan_or_problem(loaded, env=os.environ, inventory=inventory, shown=shown)
    info["notes"] = [*info.get("notes", []), *known_differences(loaded, call_factory=memory)]
    if loaded.spec.sweep is not None and sweep_trials is not None:
        info["trials"] = sweep_trials(loaded)  # the trials say what [sweep] does: no note that exec ignores it
        info["notes"] = [n for n in info.get("notes", []) if not n.startswith("[sweep]")]
        info.get("inactive", {}).pop("sweep", None)
    text = format_plan(info)
    if memory:
        info["memory"] = estimate_memory(loaded, _devices_of(loaded, info, inventory))
        gpus = [(g.name, g.total_memory_bytes) for g in inventory.gpus]
        text += "\n" + "\n".join(format_memory(info["memory"], gpus, loaded.spec))
    echo(json.dumps(info, indent=2) if as_json else text)
    if with_spec:
        print(f"\n# resolved spec ({loaded.path})")
        echo(dump_spec(loaded.spec), end="")
    if problem is not None:
        raise problem  # after the plan: what is missing, and the command that runs here


# ----------------------------------------------------------------------------- memory per device, per mode

_KINDS = {  # torch's kinds of memory (MemTracker's, then FSDPMemTracker's) -> the table's columns
    **{k: "params" for k in ("PARAM", "SHARDED_PARAM", "UNSHARDED_PARAM", "ALL_GATHER")},
    **{k: "grads" for k in ("GRAD", "SHARDED_GRAD", "UNSHARDED_GRAD", "REDUCE_SCATTER")},
    **{k: "activations" for k in ("ACT", "TEMP", "INP")},
    "BUFFER": "buffers",
    "OPT": "optimizer",
}


def estimate_memory(loaded: LoadedSpec, devices: int) -> dict[str, Any]:
    """Bytes per device of one training step in each mode, from fake steps (docs/design.md §10): ``{"devices",
    "global_batch", "flops_per_step", "modes": {mode: [per-device rows]}}``, or ``{"error": why}`` if none runs."""
    from runner.strategies import STRATEGIES
    from runner.strategies.base import StepMemory

    share = math.ceil(loaded.spec.data.batch_size / devices)
    try:
        whole = fake_step(loaded, loaded.spec.data.batch_size, count_flops=True)
        local = fake_step(loaded, share)
        sharded = fake_step(loaded, share, shards=devices)
    except Exception as exc:  # user code under fake tensors: any error means "cannot estimate", never a failure
        return {"error": f"{type(exc).__name__}: {first_line(exc)}"}
    bucket_view = getattr(loaded.spec.parallel, "gradient_as_bucket_view", False)
    step = StepMemory(whole, local, sharded, devices, bucket_view)
    modes = {mode: strategy.memory(step) for mode, strategy in STRATEGIES.items()}
    shown = ("params", "grads", "optimizer", "activations", "peak")
    return {
        "devices": devices,
        "global_batch": loaded.spec.data.batch_size,
        "flops_per_step": whole["flops"],
        "modes": {
            m: [{"device": r["device"], **{k: int(r[k]) for k in shown}} for r in rows] for m, rows in modes.items()
        },
    }


def _devices_of(loaded: LoadedSpec, info: Mapping[str, Any], inventory: Inventory) -> int:
    """n of the multi-device modes: the plan's devices, else those the spec asks for, else the visible GPUs, else 2."""
    planned = len((info.get("devices") or {}).get("per_device_batch") or ())
    ids = loaded.spec.devices.ids
    asked = (len(ids) if isinstance(ids, list) else 0) or getattr(loaded.spec.parallel, "nproc_per_node", 0) or 0
    return next(n for n in (planned, asked, len(inventory.gpus), 2) if n > 1)


def fake_step(
    loaded: LoadedSpec, batch: int, *, fake: bool = True, shards: int = 1, count_flops: bool = False
) -> dict[str, int]:
    """Peak bytes by kind of the second of two steps of ``batch`` samples (docs/design.md §10); ``fake=False`` runs real
    CPU tensors, ``shards`` > 1 gives one fsdp rank's figures, ``count_flops`` counts the first step's FLOPs."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    from runner.strategies.base import find_blocks, transform_blocks
    from runner.strategies.distributed import mixed_precision, shard
    from runner.training.losses import build_optimizer
    from runner.training.models import build_model

    spec, shape, classes = loaded.spec, *_sample_shape(loaded)
    with (
        _process_group(shards, fake) as mesh,
        FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext(),
    ):
        model = build_model(spec.model, loaded.path.parent, input_shape=shape, num_classes=classes)
        blocks = find_blocks(model, getattr(spec.parallel, "fsdp_blocks", None))
        transform_blocks(blocks, spec.train, compile_blocks=False)
        grad_bytes = _bytes(p for p in model.parameters() if p.requires_grad)
        if mesh is not None:
            shard(
                model,
                blocks,
                mixed_precision(spec.train.amp),
                getattr(spec.parallel, "reshard_after_forward", True),
                mesh,
            )
        trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        optimizer = build_optimizer(spec.optim, trained, loaded.path.parent)
        x, y = torch.randn(batch, *shape), torch.randint(0, max(classes, 1), (batch,))
        amp = spec.train.amp != "no"
        target = y if classes else None
        _, flops = _step(model, optimizer, x, target, amp, count_flops)  # untracked: it makes the optimizer state
        tracker = FSDPMemTracker(model, optimizer) if mesh is not None else MemTracker()
        if mesh is None:
            tracker.track_external(model, optimizer)
        with tracker:
            out, _ = _step(model, optimizer, x, target, amp, False)
        peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    found = dict.fromkeys(("params", "buffers", "grads", "optimizer", "activations"), 0)
    for kind, value in peak.items():
        name = _KINDS.get(str(kind).rsplit(".", 1)[-1])
        if name is not None:
            found[name] += int(value)
    found.update(peak=int(peak["Total"]), grad_bytes=grad_bytes, flops=flops)
    return {**found, "input_bytes": _bytes([x]), "output_bytes": _bytes([out])}


def _step(model: Any, optimizer: Any, x: Any, y: Any, amp: bool, count: bool) -> tuple[Any, int]:
    """One training step (cross-entropy on class targets ``y``, else a mean); ``count``: its FLOPs (untracked steps)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    flops = FlopCounterMode(display=False)
    with flops if count else contextlib.nullcontext():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = model(x)
            if not isinstance(out, torch.Tensor):  # a dict or tuple output: its first tensor
                out = next(iter(out.values())) if isinstance(out, dict) else out[0]
        loss = torch.nn.functional.cross_entropy(out.float(), y) if y is not None else out.float().pow(2).mean()
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return out, int(flops.get_total_flops()) if count else 0


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@contextlib.contextmanager
def _process_group(size: int, fake: bool) -> Iterator[Any]:
    """A ``size``-rank CPU mesh (``None`` below 2) over a fake process group as torch's tests make, or the caller's."""
    if size < 2:
        yield None
        return
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not fake:
        yield init_device_mesh("cpu", (size,))
        return
    if dist.is_initialized():
        raise RuntimeError("a process group is initialised in this process already")
    dist.init_process_group("fake", rank=0, world_size=size, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (size,))
    finally:
        dist.destroy_process_group()


def _sample_shape(loaded: LoadedSpec) -> tuple[tuple[int, ...], int]:
    """``(input shape, classes)`` of one sample; ValueError when the shape is known only once the data is read."""
    from runner.training.sources import IN_MEMORY

    data = loaded.spec.data
    if data.dataset == "synthetic":
        return tuple(data.input_shape), data.num_classes
    if data.dataset not in IN_MEMORY:
        raise ValueError(f"the shape of a {data.dataset} sample is known only once the data is read")
    from runner.training.data import build_datasets

    info = build_datasets(loaded.spec, loaded.path.parent).info
    return tuple(info.input_shape), info.num_classes


def format_memory(memory: Mapping[str, Any], gpus: Sequence[tuple[str, int | None]], spec: ExperimentSpec) -> list[str]:
    """``runner plan``'s memory table: MiB per device and mode, whether each fits the smallest GPU of ``gpus``, and
    what would fit when the spec's mode does not (fsdp, a smaller batch, activation checkpointing)."""
    if "error" in memory:
        return [_row("memory", f"not estimated: {memory['error']}")]
    smallest = min((total for _, total in gpus if total), default=None)
    top = max(row["peak"] for rows in memory["modes"].values() for row in rows)
    unit, size = next(
        (u, b) for u, b in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if top >= 10 * b or u == "KiB"
    )
    head = f"per device, {unit}, for a global batch of {memory['global_batch']} on n = {memory['devices']} (estimate)"
    lines = [
        _row("memory", head),
        _row(
            "",
            f"{'mode':<6} {'device':<7}{'params':>9}{'grads':>9}{'optim':>9}"
            f"{'activ.':>10}{'peak':>10}" + ("  fits" if smallest else ""),
        ),
    ]
    for name, rows in memory["modes"].items():
        for row in rows:
            mib = [row[k] / size for k in ("params", "grads", "optimizer", "activations", "peak")]
            figures = "".join(f"{v:>{w}.1f}" for v, w in zip(mib, (9, 9, 9, 10, 10), strict=True))
            lines.append(_row("", f"{_mode_label(name, spec):<6} {row['device']:<7}{figures}{_fits(row, smallest)}"))
    flops = memory["flops_per_step"]
    scale, prefix = next(
        (10**e, p) for e, p in ((15, "P"), (12, "T"), (9, "G"), (6, "M"), (0, "")) if flops >= 10**e or not e
    )
    where = "forward and backward, torch.utils.flop_counter"
    lines.append(
        _row("flops", f"{flops / scale:.3g} {prefix}FLOP a step of {memory['global_batch']} samples ({where})")
    )
    if not gpus:
        return [*lines, _row("fits", "no GPU visible here: nothing to compare with (* the spec's mode)")]
    if smallest is None:
        return [*lines, _row("fits", "the GPUs' memory is unknown (NVML did not say)")]
    lines.append(_row("fits", f"against the smallest visible GPU, {smallest / 2**30:.1f} GiB (* the spec's mode)"))
    worst = max(memory["modes"][spec.parallel.mode], key=lambda r: r["peak"])
    if worst["peak"] > smallest:
        lines.append(_row("", "to fit: " + "; ".join(_switches(memory, worst, smallest, spec))))
    return lines


def _mode_label(mode: str, spec: ExperimentSpec) -> str:
    """``mode``, starred when it is the spec's own."""
    return f"{mode}*" if mode == spec.parallel.mode else mode


def _fits(row: Mapping[str, Any], smallest: int | None) -> str:
    """Whether ``row``'s peak fits the smallest visible GPU, and by how much; ``""`` when its memory is unknown."""
    if not smallest:
        return ""
    spare = (smallest - row["peak"]) / 2**30
    return f"  yes, {spare:.1f} GiB spare" if spare >= 0 else f"  no, {-spare:.1f} GiB over"


def _switches(memory: Mapping[str, Any], worst: Mapping[str, int], total: int, spec: ExperimentSpec) -> list[str]:
    """What would make the spec's mode fit ``total`` bytes: fsdp, a smaller global batch, activation checkpointing."""
    found = []
    from runner.spec.schema_parallel import MODES, REFERENCE_MODE

    sharded = next(name for name, traits in MODES.items() if traits.shards_state)
    if not spec.parallel.traits.shards_state and memory["modes"][sharded][0]["peak"] <= total:
        found.append(f'parallel.mode = "{sharded}"')
    n = 1 if spec.parallel.mode == REFERENCE_MODE else memory["devices"]  # activations were measured per device
    fixed = worst["peak"] - worst["activations"]
    per_sample = worst["activations"] / math.ceil(memory["global_batch"] / n)
    if fixed < total and per_sample > 0:
        found.append(f"data.batch_size = {int((total - fixed) / per_sample) * n} or less")
    if not spec.train.activation_checkpointing:
        found.append("train.activation_checkpointing = true")
    return found or ["nothing runner can switch: a larger GPU"]
