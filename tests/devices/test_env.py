"""``scoped_environ``: variables set for a ``with`` block, the previous values back afterwards."""

from __future__ import annotations

import os

import pytest

from runner.devices.inventory import peak_tflops, scoped_environ


def test_scoped_environ_sets_then_restores_and_removes_what_was_unset(monkeypatch) -> None:
    monkeypatch.setenv("RUNNER_TEST_KEPT", "before")
    monkeypatch.delenv("RUNNER_TEST_NEW", raising=False)
    with pytest.raises(RuntimeError), scoped_environ({"RUNNER_TEST_KEPT": "inside", "RUNNER_TEST_NEW": "1"}):
        assert (os.environ["RUNNER_TEST_KEPT"], os.environ["RUNNER_TEST_NEW"]) == ("inside", "1")
        raise RuntimeError  # restored on the way out of an error too
    assert os.environ["RUNNER_TEST_KEPT"] == "before"
    assert "RUNNER_TEST_NEW" not in os.environ


def test_host_load_says_busy_when_the_load_exceeds_the_cores_the_run_used() -> None:
    from runner.devices.inventory import HostLoad

    quiet = HostLoad(start=0.3, end=1.9, cores=2)
    assert not quiet.busy(2) and quiet.describe(2).startswith("quiet: 1-min load 0.3 at the start, 1.9 at the end")
    crowded = HostLoad(start=3.4, end=4.0, cores=2)
    assert crowded.busy(2) and crowded.describe(8).startswith("busy: ") and "the run used 2" in crowded.describe(8)
    assert HostLoad(start=0.1, end=0.2, cores=4, steal=0.2).describe(1).startswith("busy: ")
    assert crowded.tags(8) == {
        "runner.host_load": "busy: load 3.4 -> 4.0 on 2 cores, 2 used",
        "runner.host_busy": "true",
    }
    assert (
        HostLoad(start=0.1, end=0.2, cores=4, steal=0.2).tags(1)["runner.host_load"]
        == "busy: load 0.1 -> 0.2 on 4 cores, 1 used, 20% steal"
    )
    advice = "on a shared CPU one intra-op thread stalls less than 2: devices.threads_per_process = 1"
    assert crowded.advice(2, 2, "cpu") == advice  # measured: benchmarks/threads.py
    assert crowded.advice(2, 1, "cpu") == crowded.advice(2, 2, "cuda") == quiet.advice(2, 2, "cpu") == ""
    load, counters = HostLoad.read()
    assert load >= 0 and counters[1] >= counters[0] >= 0
    assert HostLoad.since((load, counters)).cores >= 1


def test_a_busy_cpu_run_with_several_threads_is_told_that_one_thread_stalls_less() -> None:
    from types import SimpleNamespace

    from runner.devices.inventory import HostLoad
    from runner.launch.driver import host_note

    def plan(threads: int, accelerator: str = "cpu") -> object:
        devices = SimpleNamespace(nproc_per_node=1, threads_per_process=threads, accelerator=accelerator)
        return SimpleNamespace(devices=devices, tracking_uri=None)

    busy, quiet = HostLoad(start=3.4, end=4.0, cores=2), HostLoad(start=0.2, end=0.3, cores=2)
    note = host_note(plan(2), busy)  # type: ignore[arg-type]
    assert note.startswith("busy: 1-min load 3.4") and note.endswith(
        "(tag runner.host_load); on a shared CPU one intra-op thread stalls less than 2: devices.threads_per_process = 1"
    )
    assert host_note(plan(1), busy).endswith("(tag runner.host_load)")  # type: ignore[arg-type]
    assert host_note(plan(2), quiet) == ""  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "dtype", "expect"),
    [
        ("NVIDIA H200", "bf16", (989.0, "NVIDIA H200 SXM datasheet")),
        ("NVIDIA H100 PCIe", "fp32", (51.0, "NVIDIA H100 PCIe datasheet")),
        ("NVIDIA H100 80GB HBM3", "bf16", (989.0, "NVIDIA H100 SXM datasheet")),
        ("NVIDIA A100-SXM4-80GB", "fp16", (312.0, "NVIDIA A100 datasheet")),
        ("NVIDIA L40S", "bf16", (362.0, "NVIDIA L40S datasheet")),  # not L4's row
        ("NVIDIA L4", "bf16", (121.0, "NVIDIA L4 datasheet")),
        ("NVIDIA A10", "fp32", (31.2, "NVIDIA A10 datasheet")),  # not A100's row
        ("Tesla T4", "bf16", None),  # no bf16 on Turing
        ("NVIDIA GeForce RTX 4090", "bf16", None),  # not in the table: no guess
        ("cpu", "fp32", None),
        ("NVIDIA H200", "fp64", None),
    ],
)
def test_the_peak_table_knows_each_gpu_by_name_and_dtype_and_guesses_nothing(name, dtype, expect) -> None:
    assert peak_tflops(name, dtype) == expect
