"""``runner bench`` without training: statistics, efficiency, configuration specs, table, JSON and chart."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from runner.cli import main
from runner.errors import SpecError, SpecIssue, UsageError
from runner.spec.loading import load_spec, spec_from_dict
from runner.tools.bench import configurations
from runner.tools.bench_report import BenchReport, ConfigResult, finish_comparisons, write_chart
from runner.tools.bench_runs import summarize
from runner.tools.compare import (
    bench_spec_data,
    comparability,
    config_id,
    final_loss,
    first_beyond,
    loss_check,
    loss_deltas,
    median,
    percentile,
    scaling_efficiency,
    throughput,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
NOT_COMPARABLE = "not comparable: batch-statistics layers"  # what a bench of a model with BatchNorm says


# ----------------------------------------------------------------------------- statistics


@pytest.mark.parametrize("values", [[0.5], [3.0, 1.0], [0.01, 0.02, 0.5, 0.03, 0.02], list(np.linspace(0, 1, 11))])
def test_median_and_p90_match_numpy(values: list[float]) -> None:
    assert median(values) == pytest.approx(float(np.median(values)))
    assert percentile(values, 0) == min(values) and percentile(values, 100) == max(values)


def test_p90_sees_a_slow_tail_the_median_ignores() -> None:
    times = [0.010] * 9 + [0.100]
    assert median(times) == pytest.approx(0.010)
    assert percentile(times, 90) == pytest.approx(0.019)


def test_statistics_of_nothing_are_nan_and_bad_quantiles_are_refused() -> None:
    assert math.isnan(median([])) and math.isnan(percentile([], 90))
    with pytest.raises(ValueError, match=r"range \[0, 100\]"):
        percentile([1.0], 101)


def test_throughput_is_samples_over_summed_step_time() -> None:
    assert throughput(64 * 4, [0.5, 0.5, 0.5, 0.5]) == pytest.approx(128.0)
    assert throughput(10, []) == 0.0


def test_scaling_efficiency_against_n_times_the_single_device_rate() -> None:
    assert scaling_efficiency(180.0, 100.0, 2) == pytest.approx(0.9)
    assert scaling_efficiency(100.0, 100.0, 1) == pytest.approx(1.0)
    assert scaling_efficiency(50.0, 100.0, 4) == pytest.approx(0.125)
    assert scaling_efficiency(180.0, None, 2) is None
    assert scaling_efficiency(180.0, 0.0, 2) is None


def test_loss_check_compares_every_step_within_the_tolerance_of_nones_losses() -> None:
    base = {1: 2.0, 2: 1.5, 3: 1.0, 4: 0.5}
    assert loss_check(dict(base), base) == ("ok", 4)
    assert loss_check({**base, 4: 0.5 + 1.9e-4}, base) == ("ok", 4)  # 1e-4 of none's largest |loss| (2.0)
    flagged, through = loss_check({1: 2.0, 2: 1.5 * (1 + 1e-6), 3: 1.01, 4: 0.5}, base)
    assert through == 2 and flagged.startswith("differs from step 3 by 0.01 (0.0001 of none's losses is 0.0002)")
    assert flagged.endswith("curves agree through step 2 of 4")
    assert loss_check({1: 2.1, 2: 1.5}, base)[1] is None  # apart from the first step; 3 and 4 missing
    assert loss_check({s: v / 100 for s, v in base.items()}, {s: v / 100 for s, v in base.items()})[0] == "ok"
    assert loss_check({1: 0.02, 2: 0.0101}, {1: 0.02, 2: 0.01})[0] == "ok"  # scale at least 1
    assert loss_check({1: 2.0, 2: math.nan}, {1: 2.0, 2: 1.5})[0].startswith("differs from step 2 by inf")
    assert comparability(True) == NOT_COMPARABLE
    assert comparability(False, dropout=True) == "not comparable: dropout layers"
    assert comparability(False, False) == ""
    assert loss_check({1: 1.5}, {1: 1.0}, not_comparable=comparability(True)) == (NOT_COMPARABLE, None)
    assert loss_check({1: 1.0}, {}) == ("no baseline", None)
    assert loss_check({1: 1.0}, {1: math.nan}) == ("no baseline", None)


def test_one_definition_of_disagreement_the_first_step_beyond_the_tolerance() -> None:
    deltas = loss_deltas({1: 1.0, 2: 1.1, 4: 3.0}, {1: 1.0, 2: 1.0, 3: 2.0, 4: math.inf})
    assert deltas[1] == 0.0 and deltas[2] == pytest.approx(0.1) and deltas[3] == deltas[4] == math.inf
    assert first_beyond(deltas, 0.2) == 3 and first_beyond(deltas, 0.05) == 2
    assert first_beyond({1: 0.0, 2: 0.1}, 0.1) is None  # at the tolerance agrees


# ----------------------------------------------------------------------------- configurations


def test_configurations_order_and_dp_needs_two_devices() -> None:
    assert configurations(["none", "dp", "ddp"], [2, 1, 2]) == [("none", 1), ("dp", 2), ("ddp", 1), ("ddp", 2)]
    assert configurations(["ddp"], [4]) == [("ddp", 4)]
    assert configurations(["dp", "none"], [1]) == [("none", 1)]
    assert [config_id(m, n) for m, n in configurations(["none", "dp", "ddp"], [1, 2])] == [
        "none",
        "dp-2",
        "ddp-1",
        "ddp-2",
    ]


@pytest.mark.parametrize(
    "modes,nprocs,match",
    [
        (["none", "zero"], [1], "subset of none,dp,ddp,fsdp"),
        ([], [1], "--modes"),
        (["ddp"], [0], "--nproc"),
        (["ddp"], [], "--nproc"),
    ],
)
def test_configurations_refuses_bad_arguments(modes, nprocs, match) -> None:
    with pytest.raises(UsageError, match=match):
        configurations(modes, nprocs)


DDP_SPEC = """
[parallel]
mode = "ddp"
backend = "gloo"
nproc_per_node = 2
timeout_s = 60
max_restarts = 1
"""


def test_bench_spec_data_derives_a_valid_spec_for_every_mode(write_spec) -> None:
    base = load_spec(write_spec(DDP_SPEC))
    before = json.dumps(base.data, sort_keys=True, default=str)
    none = spec_from_dict(bench_spec_data(base.data, "none", 1, steps=5, warmup=2))
    ddp = spec_from_dict(bench_spec_data(base.data, "ddp", 4, steps=5, warmup=2))
    assert json.dumps(base.data, sort_keys=True, default=str) == before, "the user's dict must not change"
    assert none.parallel.mode == "none" and "nproc_per_node" not in none.parallel.model_fields_set
    assert ddp.parallel.nproc_per_node == 4 and ddp.parallel.backend == "gloo" and ddp.parallel.timeout_s == 60
    assert ddp.parallel.max_restarts == 0, "restarts would hide failures and distort timing"
    for spec in (none, ddp):
        assert spec.train.max_steps == 7 and spec.train.epochs >= 7
        assert spec.train.log_every_n_steps == 1 and spec.train.progress == "off"
        assert spec.checkpoint.enabled is False
        assert (spec.seed, spec.data.batch_size, spec.optim.lr) == (
            base.spec.seed,
            base.spec.data.batch_size,
            base.spec.optim.lr,
        )
    assert none.devices.ids == [0] and ddp.devices.ids == [0, 1, 2, 3]
    assert none.devices.accelerator == ddp.devices.accelerator == "cpu"


def test_dp_on_this_cpu_spec_and_an_indivisible_batch_are_skipped_with_reasons(write_spec) -> None:
    from runner.tools.bench import _prepare, fill_batch_sizes

    base = load_spec(write_spec("", name="s.toml"), ["data.batch_size=15"])
    dp, ddp2, ddp1 = (_prepare(base, m, n, 3, 1) for m, n in (("dp", 2), ("ddp", 2), ("ddp", 1)))
    assert (
        dp.loaded is None and dp.result.status == "skipped" and "dp" in dp.result.reason and "cpu" in dp.result.reason
    )
    assert ddp2.loaded is None and ddp2.result.status == "skipped" and "15" in ddp2.result.reason
    assert ddp1.loaded is not None and ddp1.result.status == "ok"
    fill_batch_sizes([ddp1], 72)
    assert sum(ddp1.batch_sizes) == 72  # 96 synthetic samples, 25 % held out


def test_probe_counts_training_samples_and_detects_batch_statistics_layers(write_spec) -> None:
    from runner.tools.compare import probe_model_and_data

    assert probe_model_and_data(load_spec(write_spec("", name="a.toml"))) == (72, False, False)
    bn = load_spec(
        write_spec("", name="b.toml"),
        ['model.name="cnn"', "model.kwargs={ batch_norm = true, width = 4 }", "data.input_shape=[1,8,8]"],
    )
    assert probe_model_and_data(bn) == (72, True, False)
    dropout = load_spec(write_spec("", name="c.toml"), ["model.kwargs={ hidden = [8], dropout = 0.5 }"])
    assert probe_model_and_data(dropout) == (72, False, True)


# ----------------------------------------------------------------------------- summarize


def _worker(rank: int, times: list[float], waits: list[float], peak: int = 100 << 20, device: str = "cpu"):
    return SimpleNamespace(rank=rank, step_times_s=times, data_wait_s=waits, peak_memory_bytes=peak, device=device)


def test_summarize_uses_timed_steps_of_the_slowest_rank_and_the_last_loss() -> None:
    history = [(s, {"train/loss": 1.0 / s, "lr": 0.1}) for s in range(1, 7)] + [(6, {"val/loss": 0.3})]
    fast = _worker(0, [9.0, 9.0, 0.10, 0.10, 0.10, 0.10], [1.0, 1.0, 0.01, 0.01, 0.01, 0.01])
    slow = _worker(1, [9.0, 9.0, 0.20, 0.20, 0.20, 0.40], [1.0, 1.0, 0.05, 0.05, 0.05, 0.05], peak=200 << 20)
    row = ConfigResult(config="ddp-2", mode="ddp", n=2)
    summarize(row, [slow, fast], history, batch_sizes=[32, 32, 16], warmup=2, steps=4)
    # steps 2..5 of a 3-step epoch: sizes 16, 32, 32, 16
    assert row.timed_steps == 4 and row.timed_samples == 96
    assert row.samples_per_s == pytest.approx(96 / 1.0)
    assert row.step_time_median_s == pytest.approx(0.20)
    assert row.step_time_p90_s == pytest.approx(0.34)
    assert row.data_wait_fraction == pytest.approx(0.2)
    assert row.peak_memory_bytes == [100 << 20, 200 << 20] and row.peak_memory_kind == "cpu_rss"
    assert row.devices == ["cpu", "cpu"]
    assert row.final_loss == pytest.approx(1 / 6)
    assert row.train_losses == {s: pytest.approx(1.0 / s) for s in range(1, 7)}


def test_summarize_reports_every_dp_device_from_the_cuda_peaks() -> None:
    row = ConfigResult(config="dp-2", mode="dp", n=2)
    summarize(
        row,
        [_worker(0, [0.1] * 3, [0.0] * 3, device="cuda:0")],
        [],
        [8],
        warmup=1,
        steps=2,
        cuda_peaks=[3 << 20, 1 << 20],
    )
    assert row.peak_memory_bytes == [3 << 20, 1 << 20] and row.devices == ["cuda:0", "cuda:1"]
    assert row.peak_memory_kind == "cuda_allocated" and row.final_loss is None


def test_final_loss_skips_epoch_metrics() -> None:
    assert final_loss([(1, {"train/loss": 2.0}), (2, {"train/loss": 1.5}), (2, {"train/epoch_loss": 9.0})]) == 1.5
    assert final_loss([]) is None


# ----------------------------------------------------------------------------- report


def _report(batch_statistics: bool = False) -> BenchReport:
    curve = {s: 1.0 / s for s in range(1, 21)}
    rows = [
        ConfigResult(
            "none",
            "none",
            1,
            samples_per_s=1000.0,
            step_time_median_s=0.064,
            step_time_p90_s=0.07,
            data_wait_fraction=0.05,
            peak_memory_bytes=[300 << 20],
            devices=["cpu"],
            final_loss=0.5,
            timed_steps=20,
            train_losses=dict(curve),
        ),
        ConfigResult(
            "dp-2", "dp", 2, status="skipped", reason='parallel.mode = "dp" needs CUDA GPUs but none is usable'
        ),
        ConfigResult(
            "ddp-2",
            "ddp",
            2,
            samples_per_s=1500.0,
            step_time_median_s=0.043,
            step_time_p90_s=0.05,
            data_wait_fraction=0.02,
            peak_memory_bytes=[280 << 20, 270 << 20],
            devices=["cpu", "cpu"],
            final_loss=0.5 * (1 + 5e-3),
            timed_steps=20,
            train_losses={s: v * (1 + 1e-2 * (s > 12)) for s, v in curve.items()},
        ),
        ConfigResult("ddp-4", "ddp", 4, status="failed", reason="rank 1 failed: RuntimeError: boom"),
    ]
    report = BenchReport(
        spec="/x/spec.toml",
        name="demo",
        accelerator="cpu",
        global_batch_size=64,
        steps=20,
        warmup=3,
        batch_statistics=batch_statistics,
        configs=rows,
        parent_run_id="p" * 32,
        tracking_uri="sqlite:///m.db",
        experiment="e",
        json_path="out/bench.json",
        png_path="out/bench.png",
    )
    finish_comparisons(report.configs, not_comparable=comparability(batch_statistics))
    return report


def test_comparisons_fill_efficiency_and_flag_a_differing_loss() -> None:
    report = _report()
    none, dp, ddp, _failed = report.configs
    assert none.scaling_efficiency == pytest.approx(1.0) and none.loss_check == "baseline"
    assert ddp.scaling_efficiency == pytest.approx(0.75)
    assert ddp.loss_check.startswith("differs") and ddp.loss_check.endswith("curves agree through step 12 of 20")
    assert ddp.loss_agrees_through_step == 12
    assert dp.scaling_efficiency is None and dp.loss_check == ""
    assert report.failed == 1


def test_batch_statistics_make_losses_not_comparable() -> None:
    report = _report(batch_statistics=True)
    assert {c.loss_check for c in report.configs if c.status == "ok"} == {NOT_COMPARABLE}
    assert report.configs[2].loss_agrees_through_step is None
    assert "batch-statistics" in report.table()


def test_table_lists_every_configuration_with_aligned_columns_and_reasons() -> None:
    table = _report().table()
    lines = table.splitlines()
    header = next(line for line in lines if line.startswith("config"))
    rows = {
        line.split()[0]: line
        for line in lines
        if line.split() and line.split()[0] in ("none", "dp-2", "ddp-2", "ddp-4")
    }
    assert set(rows) == {"none", "dp-2", "ddp-2", "ddp-4"}
    assert 'skipped: parallel.mode = "dp" needs CUDA GPUs' in rows["dp-2"]
    assert "failed: rank 1 failed" in rows["ddp-4"]
    end = header.index("samples/s") + len("samples/s")
    assert rows["none"][:end].endswith("1000.0") and rows["ddp-2"][:end].endswith("1500.0")
    assert "75%" in rows["ddp-2"] and "100%" in rows["none"]
    assert "64.00" in rows["none"] and "280/270" in rows["ddp-2"] and "5.0%" in rows["none"]
    assert "differs" in rows["ddp-2"]
    assert "p" * 32 in table and "efficiency = samples/s / (n x samples/s of none)" in table


def test_json_is_standard_and_complete() -> None:
    report = _report()
    report.configs[0].step_time_p90_s = math.nan
    data = json.loads(json.dumps(report.to_json(), allow_nan=False))
    assert [c["config"] for c in data["configurations"]] == ["none", "dp-2", "ddp-2", "ddp-4"]
    assert data["configurations"][0]["step_time_p90_s"] is None
    assert data["configurations"][1]["status"] == "skipped" and data["configurations"][1]["reason"]
    assert {"samples_per_s", "scaling_efficiency"} <= set(data["definitions"])
    assert data["global_batch_size"] == 64 and data["parent_run_id"] == "p" * 32
    assert "train_losses" not in data["configurations"][0]


def test_chart_is_a_png(tmp_path: Path) -> None:
    path = write_chart(_report(), tmp_path / "bench.png")
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    from PIL import Image

    with Image.open(path) as image:
        assert image.format == "PNG" and image.size[0] > 300


def test_a_withdrawn_efficiency_is_labelled_so_not_drawn_as_a_0_percent_bar(tmp_path: Path, monkeypatch) -> None:
    from matplotlib.axes import Axes

    report = _report()
    ddp2 = next(c for c in report.configs if c.config == "ddp-2")
    ddp2.scaling_efficiency = None  # withdrawn: above 100 % by more than the spread
    labels: list[str] = []
    drawn = Axes.text
    monkeypatch.setattr(Axes, "text", lambda self, x, y, s, *a, **k: labels.append(s) or drawn(self, x, y, s, *a, **k))
    write_chart(report, tmp_path / "bench.png")
    efficiency = labels[len(labels) // 2 :]  # the second chart's labels, one per configuration
    assert efficiency[[c.config for c in report.configs].index("ddp-2")] == "withdrawn"
    assert "0%" not in efficiency


# ----------------------------------------------------------------------------- CLI errors


def test_cli_refuses_unknown_modes_and_torchrun(write_spec, monkeypatch, capsys) -> None:
    spec = str(write_spec())
    assert main(["bench", spec, "--modes", "none,zero"]) == 2
    assert "zero" in capsys.readouterr().err
    assert main(["bench", spec, "--steps", "0"]) == 2
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert main(["bench", spec]) == 2
    assert "torchrun" in capsys.readouterr().err


def test_cli_bad_spec_exits_2_without_any_run(write_spec, store: str, capsys) -> None:
    spec = str(write_spec("", name="bad.toml"))
    assert main(["bench", spec, "--set", "optim.lr=-1"]) == 2
    assert "optim.lr" in capsys.readouterr().err
    from mlflow.tracking import MlflowClient

    assert MlflowClient(store).get_experiment_by_name("tests") is None


def _pair(rate: float, *, spreads: tuple[float, float] = (0.02, 0.03), budgets: tuple[int, int] = (2, 2)):
    """none at 100 samples/s and ddp-2 at ``rate``, with their spreads and CPU thread budgets, compared."""
    none = ConfigResult("none", "none", 1, samples_per_s=100.0, spread=spreads[0], train_losses={1: 0.5})
    none.threads_per_process, none.thread_budget = budgets[0], budgets[0]
    ddp = ConfigResult("ddp-2", "ddp", 2, samples_per_s=rate, spread=spreads[1], train_losses={1: 0.5})
    ddp.threads_per_process, ddp.thread_budget = budgets[1] // 2, budgets[1]
    finish_comparisons([none, ddp])
    return none, ddp


def test_an_efficiency_above_100_percent_beyond_the_spread_is_a_measurement_problem_never_a_result() -> None:
    from runner.tools.bench_report import _row

    _, ddp = _pair(714.0, budgets=(1, 2))  # 357 %: none had 1 thread, ddp-2 two
    assert ddp.scaling_efficiency is None
    row = _row(ddp)
    assert row[10] == "-" and "357%" not in " ".join(row[:-1])  # no efficiency column value
    assert "efficiency 357% is above 100% by more than the measured spread (5%): a measurement problem" in row[-1]
    assert "unequal CPU thread budgets (1 for none, 2 here)" in row[-1]
    _, loaded = _pair(250.0)  # equal budgets: the baseline was slowed
    assert loaded.scaling_efficiency is None and "likely cause: " in _row(loaded)[-1]
    assert "thread budgets" not in _row(loaded)[-1]


def test_an_efficiency_above_100_percent_within_the_spread_stands() -> None:
    from runner.tools.bench_report import _row

    _, ddp = _pair(208.0)  # 104 % with spreads of 2 % and 3 %
    assert ddp.scaling_efficiency == pytest.approx(1.04) and _row(ddp)[10] == "104%" and _row(ddp)[-1] == ""
    _, slower = _pair(180.0)
    assert slower.scaling_efficiency == pytest.approx(0.9) and _row(slower)[-1] == ""


def test_the_table_prints_the_thread_budget_of_every_configuration() -> None:
    none, ddp = _pair(180.0)
    report = BenchReport("/x/s.toml", "demo", "cpu", 64, 20, 3, False, [none, ddp])
    table = report.table()
    assert "2 CPU threads per configuration (processes x threads)" in table.splitlines()[1]
    rows = {line.split()[0]: line.split() for line in table.splitlines() if line.split()[:1] in (["none"], ["ddp-2"])}
    assert "1x2" in rows["none"] and "2x1" in rows["ddp-2"]
    unequal = BenchReport("/x/s.toml", "demo", "cpu", 64, 20, 3, False, list(_pair(180.0, budgets=(1, 2))))
    assert "UNEQUAL CPU thread budgets [1, 2]" in unequal.table()


def test_bench_gives_every_mode_the_same_thread_budget(write_spec) -> None:
    from runner.tools.bench import _prepare

    base = load_spec(write_spec("", name="s.toml"))
    none, ddp2 = _prepare(base, "none", 1, 3, 1), _prepare(base, "ddp", 2, 3, 1)
    assert none.result.thread_budget == ddp2.result.thread_budget or ddp2.result.threads_per_process == 1
    assert none.result.threads_per_process == none.result.thread_budget
    assert ddp2.result.thread_budget == 2 * ddp2.result.threads_per_process


# ----------------------------------------------------------------------------- repeats and noise


def _repeat_row(rate: float, times: list[float]) -> ConfigResult:
    row = ConfigResult("none", "none", 1, samples_per_s=rate, timed_steps=len(times), timed_samples=64 * len(times))
    row.step_times_s, row.data_wait_s = list(times), [t / 10 for t in times]
    row.peak_memory_bytes, row.devices, row.final_loss = [100 << 20], ["cpu"], 0.5
    row.train_losses = {1: 1.0}
    return row


def test_spread_tail_and_steadiness() -> None:
    from runner.tools.compare import noise, spread, steady, tail

    assert spread([100.0]) is None and spread([90.0, 100.0, 110.0]) == pytest.approx(0.2)
    assert tail([1.0] * 9 + [3.0]) == pytest.approx(1.2)
    assert noise(0.2, 2.2) == ["repeats differ by 20% (limit 10%)", "p90 is 2.2x p50 (limit 1.5x)"]
    assert steady(0.05, 1.1) and not steady(None, 1.1) and not steady(0.05, 1.6) and not steady(0.2, 1.0)


def test_a_figure_just_over_its_limit_does_not_print_as_the_limit() -> None:
    from runner.tools.compare import noise

    assert noise(0.104, 1.504) == ["repeats differ by 10.4% (limit 10%)", "p90 is 1.504x p50 (limit 1.5x)"]
    assert noise(None, 1.5000001) == ["p90 is 1.5000001x p50 (limit 1.5x)"]


def test_combine_takes_the_median_rate_and_pools_the_step_times() -> None:
    from runner.tools.bench_runs import combine

    repeats = [
        _repeat_row(1000.0, [0.01] * 4),
        _repeat_row(1200.0, [0.01, 0.01, 0.01, 0.05]),
        _repeat_row(900.0, [0.02] * 4),
    ]
    repeats[1].peak_memory_bytes = [300 << 20]
    row = ConfigResult("none", "none", 1)
    combine(row, repeats)
    assert row.repeats == 3 and row.repeat_samples_per_s == [1000.0, 1200.0, 900.0]
    assert row.samples_per_s == 1000.0 and row.spread == pytest.approx(0.3)
    assert row.step_time_median_s == pytest.approx(0.01) and row.step_time_p90_s == pytest.approx(0.02)
    assert row.data_wait_fraction == pytest.approx(0.1) and row.peak_memory_bytes == [300 << 20]
    assert row.steady is False and row.noise == ["repeats differ by 30% (limit 10%)", "p90 is 2.0x p50 (limit 1.5x)"]
    assert row.final_loss == 0.5 and row.timed_steps == 4


def test_ddp1_far_below_none_and_noisy_rows_are_flagged_in_table_chart_and_json(tmp_path: Path) -> None:
    none = ConfigResult("none", "none", 1, samples_per_s=1000.0, step_time_median_s=0.0010, repeats=2, steady=True)
    ddp1 = ConfigResult("ddp-1", "ddp", 1, samples_per_s=500.0, step_time_median_s=0.0020, repeats=2, steady=True)
    ddp2 = ConfigResult("ddp-2", "ddp", 2, samples_per_s=1200.0, repeats=5, steady=False)
    ddp2.noise = ["p90 is 2.2x p50 (limit 1.5x)"]
    ddp2.repeat_samples_per_s = [900.0, 1200.0, 1500.0]
    long_reason = "needs CUDA GPUs but none is usable " * 8
    dp = ConfigResult("dp-2", "dp", 2, status="skipped", reason=long_reason.strip())
    fsdp1 = ConfigResult("fsdp-1", "fsdp", 1, samples_per_s=400.0, step_time_median_s=0.0025, repeats=2, steady=True)
    finish_comparisons([none, ddp1, ddp2, dp, fsdp1])
    assert ddp1.noise == [
        "ddp-1 at 50% of none: the fixed cost per step of ddp's process group and collectives (about 1 ms here) "
        "outweighs a step this small, or other load slowed it"
    ]
    assert fsdp1.noise[0].startswith("fsdp-1 at 40% of none: the fixed cost per step of fsdp's process group")
    report = BenchReport("/x.toml", "n", "cpu", 64, 20, 3, False, [none, ddp1, ddp2, dp], min_repeats=2, max_repeats=5)
    table = report.table()
    assert "noisy after 5 repeats: p90 is 2.2x p50" in table and "ddp-1 at 50% of none" in table
    assert long_reason.strip() in table, "reasons are never shortened"
    data = report.to_json()
    rows = {c["config"]: c for c in data["configurations"]}
    assert rows["dp-2"]["reason"] == long_reason.strip()
    assert rows["ddp-2"]["steady"] is False and rows["ddp-2"]["repeat_samples_per_s"] == [900.0, 1200.0, 1500.0]
    assert "step_times_s" not in rows["none"] and "spread" in data["definitions"]

    from runner.tools.bench_report import error_bars

    assert error_bars(ddp2) == (300.0, 300.0) and error_bars(dp) == (0.0, 0.0)
    path = write_chart(report, tmp_path / "bench.png")
    assert path.read_bytes()[:8] == PNG_SIGNATURE


def test_repeats_stop_once_steady_or_at_the_budget(monkeypatch) -> None:
    from runner.tools import bench_runs as bench
    from runner.tools.bench_pool import Reply

    def worker(times: list[float]) -> SimpleNamespace:
        return SimpleNamespace(
            rank=0,
            step_times_s=[9.0, *times],
            data_wait_s=[0.0] * (len(times) + 1),
            peak_memory_bytes=1,
            device="cpu",
            history=[(1, {"train/loss": 1.0})],
        )

    class Pool:
        def __init__(self, runs: list[list[float]]) -> None:
            self.runs, self.calls = runs, 0

        def run(self, jobs):
            self.calls += 1
            return [Reply("ok", result=worker(self.runs[self.calls - 1]))]

    config = bench.Config(
        ConfigResult("none", "none", 1), SimpleNamespace(), plan=SimpleNamespace(devices=SimpleNamespace(selected=[]))
    )
    config.batch_sizes = [64]
    monkeypatch.setattr(bench, "_jobs", lambda config: [])
    report = BenchReport("/x.toml", "n", "cpu", 64, 4, 1, False, [], min_repeats=2, max_repeats=4)
    quiet = Pool([[0.01] * 4] * 4)
    rows, _, bad = bench.repeats(config, report, quiet, "1/1")
    assert bad is None and len(rows) == 2 == quiet.calls
    loud = Pool([[0.01, 0.01, 0.01, 0.05]] * 4)
    rows, history, _ = bench.repeats(config, report, loud, "1/1")
    assert len(rows) == 4 == loud.calls and history == [(1, {"train/loss": 1.0})]


@pytest.mark.parametrize("value", ["0:3", "4:2", "two", "2:x"])
def test_cli_refuses_bad_repeats(write_spec, capsys, value: str) -> None:
    assert main(["bench", str(write_spec()), "--repeats", value]) == 2
    assert "--repeats" in capsys.readouterr().err


def _measured(config: str, rates: list[float], loss_check: str = "ok", memory: int = 3 * 1024**3) -> ConfigResult:
    mode, _, n = config.partition("-")
    return ConfigResult(
        config=config,
        mode=mode,
        n=int(n or 1),
        samples_per_s=float(np.median(rates)),
        repeat_samples_per_s=rates,
        loss_check=loss_check,
        peak_memory_bytes=[memory // 2, memory],
        peak_memory_kind="cuda_allocated",
    )


def test_recommend_names_the_fastest_configuration_whose_results_agree() -> None:
    from runner.tools.bench_report import recommend

    rows = [
        _measured("none", [100.0, 100.0], "baseline"),
        _measured("ddp-2", [180.0, 190.0, 200.0]),
        _measured("dp-2", [300.0, 310.0], "differs: 1.2 vs 1.1 for none"),
    ]
    assert recommend(rows) == (
        "recommend: ddp-2 — 1.9× none (1.8–2.0×), results agree, 3.0 GiB per device; "
        "left out, results not shown to agree: dp-2"
    )


def test_recommend_is_inconclusive_when_the_repeats_overlap() -> None:
    from runner.tools.bench_report import recommend

    rows = [_measured("none", [100.0, 120.0], "baseline"), _measured("ddp-2", [110.0, 130.0])]
    assert recommend(rows).startswith("recommend: inconclusive — ddp-2 and none overlap (110–130 vs 100–120 samples/s")
    assert recommend(rows[1:]).startswith("recommend: inconclusive — none was not measured")


@pytest.mark.parametrize(
    ("raised", "status", "error"),
    [
        (None, "FINISHED", None),
        ("failed configs", "FAILED", "ddp-2: boom"),
        (RuntimeError("boom"), "FAILED", "RuntimeError: boom"),
        (KeyboardInterrupt(), "KILLED", None),
        (SpecError(SpecIssue(Path("s.toml"), 3, "model.name", "unknown")), None, None),
    ],
)
def test_bench_and_parity_end_their_parent_run_one_way(
    ready_store: str, raised: BaseException | str | None, status: str | None, error: str | None
) -> None:
    from mlflow.tracking import MlflowClient

    from runner.tools.compare import Parent, ending

    client = MlflowClient(ready_store)
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    with contextlib.suppress(Exception, KeyboardInterrupt), ending(Parent(ready_store, run_id, "e")) as outcome:
        if isinstance(raised, BaseException):
            raise raised
        if raised:
            outcome.update(status="FAILED", error="ddp-2: boom")
    if status is None:  # a bad spec leaves no run behind, not even a deleted one
        assert not client.search_runs([client.get_experiment_by_name("e").experiment_id], run_view_type=3)
        return
    run = client.get_run(run_id)
    assert run.info.status == status
    assert run.data.tags.get("runner.error") == error
