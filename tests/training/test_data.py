"""Tests for runner.training.data and runner.training.sampling: dataset sources, the seeded split and per-rank loaders."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from runner.errors import SpecError
from runner.spec.loading import load_spec
from runner.spec.schema import ExperimentSpec
from runner.training.data import build_datasets, split_indices
from runner.training.sampling import build_loaders
from runner.training.sources import load_source, sklearn_table
from tests.helpers import spec_object

ASSETS = Path(__file__).parents[1] / "assets"


def make_spec(seed: int = 0, accum: int = 1, **data) -> ExperimentSpec:
    return spec_object(seed=seed, data={"batch_size": 32, **data}, train={"grad_accum_steps": accum})


def only_issue(err: pytest.ExceptionInfo):
    assert len(err.value.issues) == 1
    return err.value.issues[0]


@pytest.fixture(scope="module")
def digits():
    return build_datasets(make_spec(dataset="sklearn.digits"), None)


def test_digits_shapes_classes_and_split(digits):
    info = digits.info
    assert info.input_shape == (1, 8, 8) and info.num_classes == 10 and info.name == "sklearn.digits"
    assert info.num_train + info.num_val == 1797 and info.num_val == int(1797 * 0.2)
    assert len(digits.train) == info.num_train and len(digits.val) == info.num_val
    x, y = digits.train[0]
    assert x.dtype == torch.float32 and x.shape == (1, 8, 8)
    assert y.dtype == torch.int64 and y.dim() == 0
    allx = torch.cat([digits.train.x, digits.val.x])
    assert abs(float(allx.mean())) < 1e-4 and abs(float(allx.std()) - 1) < 1e-3  # normalised
    assert set(torch.cat([digits.train.y, digits.val.y]).tolist()) == set(range(10))


def test_digits_raw_range():
    bundle = build_datasets(make_spec(dataset="sklearn.digits", kwargs={"normalize": False}, val_fraction=0.0), None)
    assert bundle.val is None and bundle.info.num_val == 0 and bundle.info.num_train == 1797
    x = bundle.train.x
    assert float(x.min()) == 0.0 and float(x.max()) == 1.0


def test_digits_resize_and_channels():
    bundle = build_datasets(make_spec(dataset="sklearn.digits", image_size=32, num_channels=3), None)
    assert bundle.info.input_shape == (3, 32, 32)
    x, _ = bundle.train[5]
    assert x.shape == (3, 32, 32)
    assert torch.equal(x[0], x[1]) and torch.equal(x[1], x[2])


def test_bundled_sets_equal_scikit_learns_loaders_and_do_not_import_it():
    """The digits and diabetes are read from scikit-learn's data files, value for value as its loaders give them."""
    from sklearn.datasets import load_diabetes, load_digits

    digits = load_source(make_spec(dataset="sklearn.digits", kwargs={"normalize": False}).data, None).train
    bunch = load_digits()
    assert torch.equal(digits.x, torch.as_tensor(bunch.images, dtype=torch.float32).div_(16.0).unsqueeze(1))
    assert torch.equal(digits.y, torch.as_tensor(bunch.target))
    diabetes = load_source(make_spec(dataset="sklearn.diabetes", kwargs={"standardize": False}).data, None).train
    raw = load_diabetes(scaled=False)
    assert torch.equal(diabetes.x, torch.as_tensor(raw.data, dtype=torch.float32))
    assert torch.equal(diabetes.y, torch.as_tensor(raw.target, dtype=torch.float32))
    code = (
        "import sys; from runner.training.sources import sklearn_table; "
        "t = sklearn_table('digits.csv.gz', ','); print(tuple(t.shape), 'sklearn' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["(1797,", "65)", "False"]


def test_a_missing_scikit_learn_data_file_is_a_spec_error_with_the_fix():
    with pytest.raises(SpecError) as err:
        sklearn_table("no_such_set.csv.gz")
    assert only_issue(err).key == "data.dataset" and "pip install scikit-learn" in str(err.value)


def test_digits_rejects_unknown_kwargs():
    with pytest.raises(SpecError) as err:
        build_datasets(make_spec(dataset="sklearn.digits", kwargs={"normalise": True}), None)
    assert only_issue(err).key == "data.kwargs" and "normalize" in str(err.value)


def test_synthetic_is_deterministic_and_learnable_shape():
    spec = make_spec(dataset="synthetic", num_samples=200, input_shape=[3, 4, 4], num_classes=5, seed=3)
    a, b = build_datasets(spec, None), build_datasets(spec, None)
    assert torch.equal(a.train.x, b.train.x) and torch.equal(a.train.y, b.train.y)
    assert torch.equal(a.val.x, b.val.x)
    assert a.info.input_shape == (3, 4, 4) and a.info.num_classes == 5
    assert a.info.num_train == 160 and a.info.num_val == 40
    assert len(set(a.train.y.tolist())) > 1 and int(a.train.y.max()) < 5
    c = build_datasets(
        make_spec(dataset="synthetic", num_samples=200, input_shape=[3, 4, 4], num_classes=5, split_seed=4), None
    )
    assert not torch.equal(a.train.x[:10], c.train.x[:10])  # the samples follow data.split_seed
    same = build_datasets(
        make_spec(dataset="synthetic", num_samples=200, input_shape=[3, 4, 4], num_classes=5, seed=4), None
    )
    assert torch.equal(a.train.x, same.train.x) and torch.equal(a.val.y, same.val.y)  # not seed
    resized = build_datasets(
        make_spec(dataset="synthetic", num_samples=20, input_shape=[1, 4, 4], image_size=8, num_channels=3), None
    )
    assert resized.info.input_shape == (3, 8, 8)


def test_synthetic_flat_samples_reject_image_options():
    with pytest.raises(SpecError) as err:
        build_datasets(make_spec(dataset="synthetic", input_shape=[16], image_size=8), None)
    assert only_issue(err).key == "data.image_size"


def test_split_is_stable_disjoint_and_seeded():
    tr, va, te = split_indices(103, 0.25, seed=9)
    assert (tr, va, te) == split_indices(103, 0.25, seed=9) and te == []
    assert sorted(tr + va) == list(range(103)) and len(va) == 25
    assert split_indices(103, 0.25, seed=10)[1] != va
    assert split_indices(10, 0.0, seed=0) == (list(range(10)), [], [])
    assert len(split_indices(3, 0.1, seed=0)[1]) == 1  # at least one validation sample
    with pytest.raises(SpecError):
        split_indices(1, 0.5, seed=0)


def test_a_test_split_is_disjoint_and_leaves_the_validation_split_as_it_was():
    _, plain_val, _ = split_indices(103, 0.25, seed=9)
    tr, va, te = split_indices(103, 0.25, seed=9, test_fraction=0.1)
    assert va == plain_val and len(te) == 10 and sorted(tr + va + te) == list(range(103))
    assert len(split_indices(3, 0.0, seed=0, test_fraction=0.1)[2]) == 1  # at least one test sample
    with pytest.raises(SpecError, match="val_fraction = 0.5 and test_fraction = 0.5 leave no training sample"):
        split_indices(2, 0.5, seed=0, test_fraction=0.5)


def test_imagefolder_reads_test_beside_train_and_a_factory_may_return_three_sets(tmp_path):
    write_images(tmp_path / "imgs" / "train", {"cat": 4, "dog": 3})
    write_images(tmp_path / "imgs" / "test", {"cat": 2, "dog": 1})
    bundle = build_datasets(make_spec(dataset="imagefolder", root="imgs", image_size=8, val_fraction=0.3), tmp_path)
    assert (bundle.info.num_train, bundle.info.num_val, bundle.info.num_test) == (5, 2, 3)
    (tmp_path / "three.py").write_text(
        "import torch\nfrom torch.utils.data import TensorDataset\n"
        "def sets():\n    part = lambda n: TensorDataset(torch.zeros(n, 4), torch.zeros(n, dtype=torch.long))\n"
        "    return part(6), part(2), part(3)\n"
    )
    three = build_datasets(make_spec(dataset="three:sets"), tmp_path)
    assert (three.info.num_train, three.info.num_val, three.info.num_test) == (6, 2, 3)


def test_digits_split_is_stable_across_builds(digits):
    again = build_datasets(make_spec(dataset="sklearn.digits"), None)
    assert torch.equal(again.val.x, digits.val.x) and torch.equal(again.train.y, digits.train.y)
    other = build_datasets(make_spec(dataset="sklearn.digits", split_seed=1), None)
    assert not torch.equal(other.val.y, digits.val.y)
    assert other.info.val_split_sha256 != digits.info.val_split_sha256


def write_images(folder: Path, classes: dict[str, int], size: tuple[int, int] = (10, 12)) -> None:
    rng = np.random.default_rng(0)
    for name, count in classes.items():
        (folder / name).mkdir(parents=True)
        for i in range(count):
            pixels = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / name / f"{i}.png")


def test_imagefolder_with_explicit_val(tmp_path):
    write_images(tmp_path / "imgs" / "train", {"cat": 4, "dog": 3})
    write_images(tmp_path / "imgs" / "val", {"cat": 1, "dog": 2})
    bundle = build_datasets(make_spec(dataset="imagefolder", root="imgs", image_size=8), tmp_path)
    info = bundle.info
    assert (info.num_train, info.num_val, info.num_classes, info.input_shape) == (7, 3, 2, (3, 8, 8))
    x, y = bundle.train[0]
    assert x.dtype == torch.float32 and float(x.min()) >= 0.0 and float(x.max()) <= 1.0
    assert y.dtype == torch.int64 and y.dim() == 0
    assert sorted(int(bundle.val[i][1]) for i in range(3)) == [0, 1, 1]


def test_imagefolder_without_val_splits_train(tmp_path):
    write_images(tmp_path / "train", {"a": 5, "b": 5})
    bundle = build_datasets(make_spec(dataset="imagefolder", root=str(tmp_path), val_fraction=0.2), None)
    assert (bundle.info.num_train, bundle.info.num_val) == (8, 2)
    assert bundle.info.input_shape == (3, 12, 10)


def test_imagefolder_errors(tmp_path):
    with pytest.raises(SpecError) as err:
        build_datasets(make_spec(dataset="imagefolder", root="missing"), tmp_path)
    assert only_issue(err).key == "data.root" and str(tmp_path / "missing" / "train") in str(err.value)
    write_images(tmp_path / "d" / "train", {"a": 1, "b": 1})
    write_images(tmp_path / "d" / "val", {"a": 1, "c": 1})
    with pytest.raises(SpecError, match="classes"):
        build_datasets(make_spec(dataset="imagefolder", root="d"), tmp_path)


def test_torchvision_missing_files_name_the_path_and_the_fix(tmp_path):
    with pytest.raises(SpecError) as err:
        build_datasets(make_spec(dataset="torchvision.MNIST", root="data"), tmp_path)
    issue = only_issue(err)
    assert issue.key == "data.root"
    assert str(tmp_path / "data" / "MNIST" / "raw") in issue.message
    assert "download = true" in issue.message


@pytest.mark.parametrize(
    ("name", "suggestion"),
    [
        ("sklearn.digit", '"sklearn.digits"'),
        ("torchvision.MNSIT", '"torchvision.MNIST"'),
        ("syntetic", '"synthetic"'),
        ("torchvision.mnist", '"torchvision.MNIST"'),
    ],
)
def test_unknown_dataset_did_you_mean(name, suggestion, tmp_path):
    with pytest.raises(SpecError) as err:
        build_datasets(make_spec(dataset=name, root="x"), tmp_path)
    issue = only_issue(err)
    assert issue.key == "data.dataset" and suggestion in issue.message


def test_factory_dataset_is_split_and_infers_classes():
    bundle = build_datasets(make_spec(dataset="factories:build_dataset", kwargs={"num_samples": 50}), ASSETS)
    assert (bundle.info.num_train, bundle.info.num_val) == (40, 10)
    assert bundle.info.input_shape == (8,) and bundle.info.num_classes == 3


def test_factory_train_val_pair_is_used_as_is():
    bundle = build_datasets(make_spec(dataset="factories:build_split"), ASSETS)
    assert (bundle.info.num_train, bundle.info.num_val) == (40, 10)


def test_factory_errors():
    with pytest.raises(SpecError) as err:
        build_datasets(make_spec(dataset="factories:build_dataset", kwargs={"bogus": 1}), ASSETS)
    assert only_issue(err).key == "data.kwargs"
    with pytest.raises(SpecError) as err:
        build_datasets(make_spec(dataset="factories:no_such"), ASSETS)
    assert only_issue(err).key == "data.dataset"
    with pytest.raises(SpecError, match="not a Dataset"):
        build_datasets(make_spec(dataset="factories:not_a_model"), ASSETS)


def test_loaders_layout_and_eval_exactly_once(digits):
    spec = make_spec(dataset="sklearn.digits", batch_size=60, accum=2, eval_batch_size=50)
    world = 3
    seen_val: list[float] = []
    for rank in range(world):
        loaders = build_loaders(spec, digits, rank, world)
        assert loaders.micro_batch == 10
        assert loaders.global_batch_sizes == [60] * 23 + [58]  # 1438 = 23 * 60 + 58
        assert loaders.steps_per_epoch == 24
        loaders.train_sampler.set_epoch(0)
        sizes = [len(y) for _, y in loaders.train]
        assert sizes[:2] == [10, 10] and sum(sizes) == len(loaders.train_sampler)
        for _x, y in loaders.val:
            assert len(y) <= 17  # ceil(50 / 3)
            seen_val += y.tolist()
    assert len(seen_val) == digits.info.num_val


def test_loaders_with_workers_are_reproducible(digits):
    spec = make_spec(dataset="sklearn.digits", batch_size=64, num_workers=2)
    first = build_loaders(spec, digits, 0, 1)
    second = build_loaders(spec, digits, 0, 1)
    for loaders in (first, second):
        loaders.train_sampler.set_epoch(1)
    a = [y for _, y in first.train]
    b = [y for _, y in second.train]
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=False)) and len(a) == first.steps_per_epoch


def test_loaders_errors(digits, write_spec):
    # A batch that does not divide by world size x grad_accum_steps never reaches build_loaders:
    # the spec is refused when it is loaded (the one place that rule is checked).
    with pytest.raises(SpecError) as err:
        load_spec(write_spec(), ["data.batch_size=32", 'parallel.mode="ddp"', "parallel.nproc_per_node=3"])
    assert only_issue(err).key == "data.batch_size"
    with pytest.raises(SpecError) as err:
        build_loaders(make_spec(dataset="sklearn.digits", batch_size=2000, drop_last=True), digits, 0, 1)
    assert only_issue(err).key == "data.batch_size"


def write_fake_mnist(raw: Path, n_train: int = 20, n_test: int = 5) -> None:
    """Write tiny MNIST idx files (uint8 images 28x28, labels 0..9) where torchvision looks for them."""
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) % 10).astype(np.uint8)
        header = bytes([0, 0, 8, 3]) + b"".join(int(d).to_bytes(4, "big") for d in (n, 28, 28))
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(header + images.tobytes())
        header = bytes([0, 0, 8, 1]) + int(n).to_bytes(4, "big")
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(header + labels.tobytes())


def test_torchvision_mnist_from_local_files(tmp_path):
    write_fake_mnist(tmp_path / "data" / "MNIST" / "raw")
    bundle = build_datasets(make_spec(dataset="torchvision.MNIST", root="data"), tmp_path)
    info = bundle.info
    assert (info.num_train, info.num_val, info.num_classes, info.input_shape) == (16, 4, 10, (1, 28, 28))
    x, y = bundle.train[0]
    assert x.dtype == torch.float32 and float(x.min()) >= 0.0 and float(x.max()) <= 1.0
    assert y.dtype == torch.int64 and y.dim() == 0
    resized = build_datasets(
        make_spec(dataset="torchvision.MNIST", root="data", image_size=14, num_channels=3), tmp_path
    )
    assert resized.info.input_shape == (3, 14, 14)
    loaders = build_loaders(make_spec(dataset="torchvision.MNIST", root="data", batch_size=4), resized, 0, 1)
    xb, yb = next(iter(loaders.train))
    assert xb.shape == (4, 3, 14, 14) and yb.dtype == torch.int64


def test_an_rgb_image_folder_feeds_a_one_channel_model_as_grayscale(tmp_path):
    write_images(tmp_path / "train", {"a": 3, "b": 3})
    bundle = build_datasets(make_spec(dataset="imagefolder", root=str(tmp_path), num_channels=1, image_size=6), None)
    x, _ = bundle.train[0]
    assert bundle.info.input_shape == (1, 6, 6) and x.shape == (1, 6, 6)
    rgb = build_datasets(make_spec(dataset="imagefolder", root=str(tmp_path), image_size=6), None).train[0][0]
    weights = torch.tensor([0.2989, 0.587, 0.114]).view(3, 1, 1)  # ITU-R 601-2 luma, as torchvision weighs it
    assert torch.allclose(x, (rgb * weights).sum(0, keepdim=True), atol=1e-5)


def test_transforms_change_training_samples_and_eval_transforms_the_held_out_ones(tmp_path):
    """A grayscale folder for a 1-channel model, flipped for training and normalised everywhere, with no factory."""
    write_images(tmp_path / "train", {"a": 4, "b": 4})
    write_images(tmp_path / "val", {"a": 1, "b": 1})
    normalize = {"name": "Normalize", "kwargs": {"mean": [0.5], "std": [0.25]}}
    options = {"dataset": "imagefolder", "root": str(tmp_path), "num_channels": 1, "image_size": 6}
    plain = build_datasets(make_spec(**options), None)
    bundle = build_datasets(
        make_spec(
            **options,
            transforms=[{"name": "RandomHorizontalFlip", "kwargs": {"p": 1.0}}, normalize],
            eval_transforms=[normalize],
        ),
        None,
    )
    (x, y), (raw, raw_y) = bundle.train[0], plain.train[0]
    assert y == raw_y and x.shape == raw.shape == (1, 6, 6) and bundle.info.input_shape == (1, 6, 6)
    assert torch.allclose(x, (raw.flip(-1) - 0.5) / 0.25)
    assert torch.allclose(bundle.val[0][0], (plain.val[0][0] - 0.5) / 0.25)  # normalised, not flipped
    digits = build_datasets(make_spec(dataset="sklearn.digits", transforms=["RandomVerticalFlip"]), None)
    assert digits.info.input_shape == (1, 8, 8) and digits.val is not None  # a bare name works; val untouched
    assert torch.equal(digits.val[0][0], build_datasets(make_spec(dataset="sklearn.digits"), None).val[0][0])


@pytest.mark.parametrize(
    ("transforms", "key", "fragment"),
    [
        (["RandomHorizontalFlp"], "data.transforms[0]", 'did you mean "RandomHorizontalFlip"'),
        ([{"name": "Resize", "kwargs": {"sise": 4}}], "data.transforms[0].kwargs", "Resize rejected"),
        (
            [{"name": "RandomErasing", "kwargs": {"p": 1.0, "value": [1, 2, 3]}}],  # 3 values, 1 channel
            "data.transforms",
            "sample 0 of the data cannot go through data.transforms",
        ),
    ],
)
def test_a_transform_that_cannot_apply_is_a_spec_error_at_its_entry(transforms, key, fragment):
    with pytest.raises(SpecError) as err:
        build_datasets(make_spec(dataset="sklearn.digits", transforms=transforms), None)
    issue = only_issue(err)
    assert issue.key == key and fragment in issue.message
