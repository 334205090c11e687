"""Your own experiment end to end: the shipped examples in none and ddp, first-step errors, non-finite losses."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from runner.cli import main
from runner.training.checkpoint import list_checkpoints
from runner.training.shards import whole_model

pytestmark = [pytest.mark.integration, pytest.mark.created_store, pytest.mark.timeout(300)]

REPO = Path(__file__).parents[2]
DDP = ['parallel.mode="ddp"', "parallel.nproc_per_node=2"]

# Metrics that count what evaluation saw: a sum state, a sum of the targets and a concatenated ("cat") state.
COUNTING = """
import torch
import torchmetrics


class Count(torchmetrics.Metric):
    def __init__(self):
        super().__init__()
        self.add_state("n", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("labels", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, pred, target):
        self.n += target.numel()
        self.labels += target.long().sum()

    def compute(self):
        return self.n.double() * 10_000 + self.labels.double()  # both numbers in one value


class Seen(torchmetrics.Metric):
    def __init__(self):
        super().__init__()
        self.add_state("targets", default=[], dist_reduce_fx="cat")

    def update(self, pred, target):
        self.targets.append(target.long())

    def compute(self):
        return torch.tensor(float(torchmetrics.utilities.dim_zero_cat(self.targets).numel()))
"""


# A model with an auxiliary loss beside its logits, and a loss function that sees both and the whole batch.
AUX = """
import torch
import torch.nn.functional as F
from torch import nn


class WithAux(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, pixels):
        logits = self.net(pixels)
        return {"logits": logits, "aux_loss": logits.pow(2).mean(dim=1).mean()}  # a mean over the batch


def build():
    return WithAux()


def loss(output, batch):
    return F.cross_entropy(output["logits"], batch["labels"]) + 0.01 * output["aux_loss"]
"""


def _sets(items: list[str]) -> list[str]:
    out: list[str] = []
    for item in items:
        out += ["--set", item]
    return out


def _runs(store: str, experiment: str):
    client = MlflowClient(store)
    exp = client.get_experiment_by_name(experiment)
    return client, client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"]) if exp else []


def _history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One tracking store for the single-process runs of this module (each test uses its own experiment)."""
    return f"sqlite:///{tmp_path_factory.mktemp('store')}/mlflow.db"


def _in(store: str, experiment: str) -> list[str]:
    return _sets([f'tracking.uri="{store}"', f'tracking.experiment="{experiment}"'])


@pytest.fixture
def in_repo(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Run from the repository root (the examples are imported as ``examples.custom_model``), with tmp_path importable."""
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "counting_metrics.py").write_text(COUNTING)
    return tmp_path


def _none_and_ddp(spec: str, store: str, experiment: str, sets: list[str]) -> tuple[MlflowClient, list]:
    common = [f'tracking.uri="{store}"', 'train.progress="off"', "train.log_every_n_steps=1", *sets]
    assert main(["exec", spec, *_sets(common)]) == 0
    assert main(["exec", spec, *_sets([*common, *DDP])]) == 0
    client, runs = _runs(store, experiment)
    assert [r.info.status for r in runs] == ["FINISHED", "FINISHED"]
    assert runs[1].data.tags["runner.world_size"] == "2"
    a, b = (_history(client, r.info.run_id, "train/loss") for r in runs)
    assert [s for s, _ in a] == [s for s, _ in b] and len(a) >= 20
    for (step, va), (_, vb) in zip(a, b, strict=True):
        assert va == pytest.approx(vb, rel=1e-5), f"step {step}"
    return client, runs


def test_custom_model_example_agrees_in_none_and_ddp_and_counts_every_validation_sample_once(
    in_repo: Path, store: str
) -> None:
    # 1797 digits, 359 held out: an odd validation set, split 180 + 179 over two ranks
    val = [
        '"accuracy"',
        '{ name = "f1", average = "macro" }',
        '{ name = "examples.custom_model:TrueClassProbability", log_as = "true_class_probability" }',
        '"counting_metrics:Count"',
        '"counting_metrics:Seen"',
    ]
    _, (single, ddp) = _none_and_ddp(
        "experiments/custom_model.toml", store, "custom-model", ["train.epochs=1", f"metrics.val=[{', '.join(val)}]"]
    )
    from runner.spec.loading import load_spec
    from runner.training.data import build_datasets

    bundle = build_datasets(load_spec(REPO / "experiments/custom_model.toml").spec, REPO / "experiments")
    assert bundle.val is not None and len(bundle.val) == 359
    label_sum = sum(int(bundle.val[i]["labels"]) for i in range(len(bundle.val)))
    for run in (single, ddp):
        metrics = run.data.metrics
        assert metrics["val/Count"] == 359 * 10_000 + label_sum  # every sample once, none padded or repeated
        assert metrics["val/Seen"] == 359
        assert {"train/accuracy", "train/step_accuracy", "val/f1", "val/true_class_probability"} <= set(metrics)
        assert run.data.params["data.val_fraction"] == "0.2"  # the factory's one set was split: logged once built
    for key in ("val/accuracy", "val/f1", "val/true_class_probability", "val/loss"):
        assert single.data.metrics[key] == pytest.approx(ddp.data.metrics[key], abs=1e-4), key


@pytest.mark.timeout(600)
def test_an_auxiliary_loss_trains_and_logs_the_same_in_none_and_ddp(in_repo: Path, store: str) -> None:
    (in_repo / "aux_model.py").write_text(AUX)
    sets = [
        'model.name="aux_model:build"',
        "model.kwargs={}",
        'loss.name="aux_model:loss"',
        'metrics.train=["accuracy", { output = "aux_loss" }]',
        'metrics.val=[{ output = "aux_loss" }]',
        "train.epochs=1",
    ]
    client, (single, ddp) = _none_and_ddp("experiments/custom_model.toml", store, "custom-model", sets)
    for key in ("train/aux_loss", "val/aux_loss", "train/step_aux_loss"):
        a, b = (_history(client, r.info.run_id, key) for r in (single, ddp))
        assert a and [s for s, _ in a] == [s for s, _ in b], key
        for (step, va), (_, vb) in zip(a, b, strict=True):
            assert va == pytest.approx(vb, rel=1e-4), (key, step)
    assert single.data.metrics["val/aux_loss"] > 0


def test_diabetes_example_agrees_in_none_and_ddp_with_mae_and_r2(in_repo: Path, store: str) -> None:
    _, (single, ddp) = _none_and_ddp("experiments/diabetes_regression.toml", store, "diabetes", ["train.epochs=2"])
    for run in (single, ddp):
        assert {"val/mae", "val/r2", "train/mae", "val/loss"} <= set(run.data.metrics)
        assert "val/accuracy" not in run.data.metrics  # regression: no default classification metric
    assert single.data.metrics["val/mae"] == pytest.approx(ddp.data.metrics["val/mae"], rel=1e-4)


# --------------------------------------------------------------------------- errors seen at the first step: exit 1

MODELS = '''
import torch
from torch import nn


class DictNet(nn.Module):
    def __init__(self, loss=True):
        super().__init__()
        self.lin = nn.Linear(8, 3)
        self.with_loss = loss

    def forward(self, x, y=None):
        logits = self.lin(x)
        if self.with_loss and y is not None:
            return {"loss": nn.functional.cross_entropy(logits, y), "logits": logits}
        return {"logits": logits}


def build(**kwargs):
    return DictNet(**kwargs)


def per_sample(pred, target):
    return nn.functional.cross_entropy(pred, target, reduction="none")


class Poisoned(nn.Module):
    """Finite for the first steps, then a NaN loss (as a diverging run would give)."""

    def __init__(self, at_call=4):
        super().__init__()
        self.lin = nn.Linear(8, 3)
        self.calls, self.at_call = 0, at_call

    def forward(self, x):
        out = self.lin(x)
        if self.training:
            self.calls += 1
            if self.calls >= self.at_call:
                return out * float("nan")
        return out


def poisoned(**kwargs):
    return Poisoned(**kwargs)
'''


@pytest.mark.parametrize(
    ("sets", "fragments"),
    [
        (
            ['model.name="user_models:build"'],
            ("model.output", "a dict with keys ['logits']", 'model.output = "logits"'),
        ),
        (['model.name="user_models:build"', 'model.output="logit"'], ("model.output", "no entry 'logit'")),
        (
            ['model.name="user_models:build"', 'model.output="logits"', 'loss.name="user_models:per_sample"'],
            ("loss.name", "returned a tensor of shape [16]", ".mean()"),
        ),
        (
            ['model.name="user_models:build"', "model.kwargs={loss=false}", 'loss.name="model"'],
            ("loss.name", 'loss.name = "model"', "a dict with keys ['logits']"),
        ),
    ],
    ids=["dict-without-output", "output-key-missing", "loss-not-scalar", "model-returns-no-loss"],
)
def test_errors_seen_at_the_first_step_exit_1_fail_the_run_and_name_the_key(
    write_spec, shared_store: str, tmp_path: Path, capsys, request, sets: list[str], fragments: tuple[str, ...]
) -> None:
    (tmp_path / "user_models.py").write_text(MODELS)
    kwargs = [] if any(s.startswith("model.kwargs") for s in sets) else ["model.kwargs={}"]
    experiment = request.node.callspec.id
    assert main(["exec", str(write_spec()), *_sets([*sets, *kwargs]), *_in(shared_store, experiment)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err
    _, runs = _runs(shared_store, experiment)
    assert [r.info.status for r in runs] == ["FAILED"]


def test_a_huge_lr_stops_the_run_failed_naming_the_step_and_keeps_the_good_checkpoints(
    write_spec, shared_store: str, tmp_path: Path, capsys
) -> None:
    store = shared_store
    (tmp_path / "user_models.py").write_text(MODELS)
    sets = ['model.name="user_models:poisoned"', "model.kwargs={at_call=4}", "checkpoint.every_n_steps=1"]
    assert main(["exec", str(write_spec()), *_sets([*sets, "train.log_every_n_steps=2"]), *_in(store, "nan")]) == 1
    err = capsys.readouterr().err
    assert 'train.on_nonfinite = "stop": the loss was not finite at step 4' in err and "optim.lr" in err
    _, (run,) = _runs(store, "nan")
    assert run.info.status == "FAILED"
    folder = Path(store[len("sqlite:///") :]).parent / "checkpoints" / run.info.run_id
    saved = list_checkpoints(folder)
    assert [p.name for p in saved] == ["step-00000002", "step-00000003"]  # keep_last = 2; step 4 never saved
    for tensor in whole_model(saved[-1]).values():
        assert torch.isfinite(tensor).all()
    assert all(math.isfinite(v) for _, v in _history(MlflowClient(store), run.info.run_id, "train/loss"))


def test_a_huge_lr_without_any_help_stops_as_well(write_spec, shared_store: str, capsys) -> None:
    assert main(["exec", str(write_spec()), *_sets(["optim.lr=1e30"]), *_in(shared_store, "huge-lr")]) == 1
    assert "was not finite at step" in capsys.readouterr().err
    assert [r.info.status for r in _runs(shared_store, "huge-lr")[1]] == ["FAILED"]


def test_a_batchnorm_model_meeting_one_sample_exits_2_at_the_batch_size_line_and_leaves_no_run(
    write_spec, shared_store: str, tmp_path: Path, capsys
) -> None:
    (tmp_path / "bn_model.py").write_text(
        "from torch import nn\n\ndef build():\n    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))\n"
    )
    spec = write_spec()
    spec.write_text(spec.read_text().replace("batch_size = 16", "batch_size = 71"))  # 72 training samples: 71 + 1
    code = main(
        ["exec", str(spec), *_sets(['model.name="bn_model:build"', "model.kwargs={}"]), *_in(shared_store, "bn")]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    line = next(i for i, text in enumerate(spec.read_text().splitlines(), 1) if text.startswith("batch_size"))
    assert f"{spec}:{line}: data.batch_size:" in err and "data.drop_last = true" in err and "BatchNorm" in err
    assert _runs(shared_store, "bn")[1] == []


# --------------------------------------------------------------------------- a language model's loss is PyTorch's

# word_language_model's layout: forward gives log-probabilities (batch * time, ntoken) for labels (batch, time);
# the ends of some sequences are padding (-100), unevenly, so the two ranks of ddp-2 count different tokens.
TINY_LM = """
import math

import torch
from torch import nn


class Tokens(torch.utils.data.Dataset):
    vocab_size = 11

    def __init__(self, n):
        g = torch.Generator().manual_seed(n)
        self.x = torch.randint(0, self.vocab_size, (n, 12), generator=g)
        self.y = (self.x + 1) % self.vocab_size  # the next token follows from this one
        for i in range(n):
            self.y[i, 12 - i % 5 :] = -100

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def sets():
    return Tokens(48), Tokens(16)


class LM(nn.Module):
    def __init__(self, ntoken, zero=False):
        super().__init__()
        self.ntoken = ntoken
        self.emb = nn.Embedding(ntoken, 8)
        self.out = nn.Linear(8, ntoken)
        if zero:
            nn.init.zeros_(self.out.weight), nn.init.zeros_(self.out.bias)

    def forward(self, x):
        return torch.log_softmax(self.out(self.emb(x)).view(-1, self.ntoken), dim=1)
"""


def test_a_language_models_loss_is_the_token_mean_of_nll_in_none_and_ddp(in_repo: Path, store: str) -> None:
    """PyTorch's F.nll_loss mean over the tokens of the global batch, padding left out, in none and ddp-2 alike."""
    (in_repo / "tiny_lm.py").write_text(TINY_LM)
    spec = in_repo / "lm.toml"
    spec.write_text(
        'name = "tiny-lm"\nseed = 0\n[model]\nname = "tiny_lm:LM"\nkwargs = { ntoken = "${data.vocab_size}" }\n'
        '[data]\ndataset = "tiny_lm:sets"\nbatch_size = 16\n[loss]\nname = "nll"\n'
        '[optim]\nname = "sgd"\nlr = 0.5\n[train]\nepochs = 7\n[devices]\naccelerator = "cpu"\n'
        '[tracking]\nexperiment = "tiny-lm"\n'
    )
    client, (single, _) = _none_and_ddp(str(spec), store, "tiny-lm", [])
    assert single.data.metrics["val/loss"] < math.log(11)  # it learns, on the scale of one token's nll
    assert "data.val_fraction" not in single.data.params  # the factory returned its own validation set
    common = [f'tracking.uri="{store}"', 'train.progress="off"', "train.log_every_n_steps=1"]
    assert main(["exec", str(spec), *_sets([*common, "model.batch_dim=1"])]) == 0  # fed (time, batch): same losses
    _, runs = _runs(store, "tiny-lm")
    a, b = (_history(client, run.info.run_id, "train/loss") for run in (single, runs[-1]))
    assert [s for s, _ in a] == [s for s, _ in b] and all(
        x == pytest.approx(y, rel=1e-5) for (_, x), (_, y) in zip(a, b, strict=True)
    )
    assert main(["exec", str(spec), *_sets([*common, "model.kwargs.zero=true", "train.epochs=1"])]) == 0
    _, runs = _runs(store, "tiny-lm")
    first = _history(client, runs[-1].info.run_id, "train/loss")[0]
    assert first == (1, pytest.approx(math.log(11), rel=1e-6))  # a uniform prediction: ln(ntoken) per token
