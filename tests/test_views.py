"""data.views: each training sample as several independently augmented views, `((view_1, view_2), label)`,
for the four classification datasets; validation stays one eval-transformed image; data.views=1 is
every sample exactly as before; the draws come from torch's global RNG, so loading resumes exactly."""

import os
import pickle

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from PIL import Image
from torch.utils.data import TensorDataset, default_collate
from torchvision.transforms import v2

from conftest import REPO, config_error_in_this_process, launch, write_imagefolder
from data import build_datasets
from ddp.config.schema import ConfigError, register_configs
from ddp.distributed.env import DistEnv
from ddp.jobs.run_dir import register_resolvers
from ddp.loading.batches import batch_size, to_device
from ddp.loading.loaders import build_train_loader, iterate_from, start_epoch

register_configs()
register_resolvers()

DATASETS = ["synthetic", "digits", "imagefolder", "cifar10"]
IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
CIFAR10 = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
CIFAR10_FILES = ["data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5", "test_batch"]


def write_cifar10(root, per_file: int = 2):
    """CIFAR-10's python layout (cifar-10-batches-py: pickled batches of 3072-byte rows, batches.meta)
    holding random images: 5 training batches and a test batch of `per_file` images each."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for index, name in enumerate(CIFAR10_FILES):
        batch = {"data": rng.integers(0, 256, (per_file, 3 * 32 * 32), dtype=np.uint8),
                 "labels": [(index + i) % 10 for i in range(per_file)]}
        (folder / name).write_bytes(pickle.dumps(batch))
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": [f"class_{i}" for i in range(10)]}))
    return root


@pytest.fixture
def data_root(tmp_path, monkeypatch):
    """A root for each dataset that reads files. torchvision checks CIFAR-10's files against the real
    ones' MD5 sums, which no file made here can match (and nothing is downloaded): that check alone is
    made to look at the files' presence; the rest, reading and transforming them, is torchvision's and ours."""
    monkeypatch.setattr("torchvision.datasets.cifar.check_integrity", lambda path, md5=None: os.path.isfile(path))
    return {"imagefolder": write_imagefolder(tmp_path / "images", per_class=3, splits=("train", "val", "test")),
            "cifar10": write_cifar10(tmp_path / "cifar")}


def data_overrides(name: str, roots: dict, *extra: str) -> list[str]:
    small = {
        "synthetic": ["data.num_samples=16", "data.num_val_samples=4", "data.image_size=8"],
        "digits": [],
        "imagefolder": [f"data.root={roots['imagefolder']}", "data.image_size=16"],
        "cifar10": [f"data.root={roots['cifar10']}"],
    }
    return [f"data={name}", *small[name], *extra]


def compose_data(overrides: list[str]):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=overrides).data


def splits_of(name: str, roots: dict, *extra: str):
    """The dataset as the run builds it: composed from conf/data/<name>.yaml and the overrides."""
    return build_datasets(compose_data(data_overrides(name, roots, *extra)))


def eval_view(splits, index: int) -> torch.Tensor:
    """Training sample `index`'s image as evaluation transforms it: the tensor itself for the tensor
    datasets (their tensors are what the val split holds too), the val split's transform of the file
    for ImageFolder and CIFAR-10."""
    train = splits.train
    if hasattr(train, "loader"):  # ImageFolder
        return splits.val.transform(train.loader(train.samples[index][0]))
    if hasattr(train, "data"):  # CIFAR-10
        return splits.val.transform(Image.fromarray(train.data[index]))
    return train.base.tensors[0][index]


@pytest.mark.parametrize("name", DATASETS)
def test_views_are_independent_draws_of_one_sample_and_the_eval_image_without_augmentation(name, data_root):
    """data.views=2: each training sample is ((view_1, view_2), label). With augmentation on, the two
    views differ; with data.augment=false (a bool also for the string-valued imagefolder/cifar10
    option) both are exactly the sample's eval-transformed image."""
    plain = splits_of(name, data_root, "data.views=2", "data.augment=false")
    for index in (0, 3):
        (first, second), label = plain.train[index]
        expected = eval_view(plain, index)
        assert torch.equal(first, expected) and torch.equal(second, expected), (name, index)
    augmented = splits_of(name, data_root, "data.views=2", "data.augment=true")
    for index in (0, 3):
        views, label = augmented.train[index]
        assert len(views) == 2 and label == plain.train[index][1]
        assert views[0].shape == views[1].shape == eval_view(augmented, index).shape
        assert views[0].dtype == torch.float32
        assert not torch.equal(views[0], views[1]), (name, index)


@pytest.mark.parametrize("name", DATASETS)
def test_any_number_of_views(name, data_root):
    """data.views=3 gives three views, and views the same draws as views=2 for its first two."""
    torch.manual_seed(0)
    three, label = splits_of(name, data_root, "data.views=3", "data.augment=true").train[1]
    torch.manual_seed(0)
    two, _ = splits_of(name, data_root, "data.views=2", "data.augment=true").train[1]
    assert len(three) == 3 and all(torch.equal(a, b) for a, b in zip(three, two))


@pytest.mark.parametrize("name", DATASETS)
def test_views_are_drawn_from_torchs_global_rng(name, data_root):
    """The same seed of torch's global RNG gives the same views, another seed others: the RNG that the
    loaders seed per (rank, epoch) in workers and the checkpoint holds without them."""
    splits = splits_of(name, data_root, "data.views=2", "data.augment=true")

    def views(seed: int):
        torch.manual_seed(seed)
        return splits.train[2][0]

    first, again, other = views(0), views(0), views(1)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not any(torch.equal(a, b) for a, b in zip(first, other))


@pytest.mark.parametrize("name", DATASETS)
def test_validation_stays_one_eval_view(name, data_root):
    """With data.views=2, val (and ImageFolder's test split) samples are one eval-transformed image
    and its label, the same as with views=1."""
    views, single = (splits_of(name, data_root, f"data.views={n}") for n in (2, 1))
    for split in ("val", "test"):
        if getattr(views, split) is None:
            continue
        image, label = getattr(views, split)[1]
        expected_image, expected_label = getattr(single, split)[1]
        assert isinstance(image, torch.Tensor) and torch.equal(image, expected_image) and label == expected_label


# --- data.views=1: every sample exactly as before ----------------------------------------------------

def _old_synthetic(num_samples: int, num_val_samples: int, image_size: int, num_classes: int, channels: int,
                   data_seed: int) -> TensorDataset:
    """data/synthetic.py's training split as it was computed before views existed."""
    generator = torch.Generator().manual_seed(data_seed)
    prototypes = torch.randn(num_classes, channels, image_size, image_size, generator=generator)
    labels = torch.randint(num_classes, (num_samples,), generator=generator)
    noise = torch.randn(num_samples, channels, image_size, image_size, generator=generator)
    return TensorDataset(prototypes[labels] + 2.0 * noise, labels)


def _old_digits_train() -> TensorDataset:
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    x = (x - x.mean()) / x.std()
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train = order[int(len(x) * 0.2):]
    return TensorDataset(x[train], torch.tensor(labels, dtype=torch.long)[train])


def _standard_train(geometry: list, statistics) -> v2.Compose:
    """data/presets.py's standard training transform as it was before views existed."""
    return v2.Compose([*geometry, v2.PILToTensor(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(*statistics)])


@pytest.mark.parametrize("name", DATASETS)
@pytest.mark.parametrize("augment", [False, True], ids=["augment_off", "augment_on"])
def test_one_view_is_the_sample_exactly_as_before(name, augment, data_root):
    """data.views=1 (the default) gives `(image, label)`, bit-identical to the sample as computed before
    views existed, random augmentation included (same seed, same draws). digits has no single-image
    augmentation: data.augment=true needs views (test_bad_values_are_one_line_errors)."""
    if name == "digits" and augment:
        return
    flag = str(augment).lower()
    splits = splits_of(name, data_root, f"data.augment={flag}")
    assert compose_data(data_overrides(name, data_root)).views == 1
    index = 3
    torch.manual_seed(7)
    image, label = splits.train[index]
    torch.manual_seed(7)
    if name == "synthetic":
        expected_image, expected_label = _old_synthetic(16, 4, 8, 10, 3, 0)[index]
        if augment:  # RandomFlipAndNoise
            if torch.rand(()) < 0.5:
                expected_image = expected_image.flip(-1)
            expected_image = expected_image + 0.1 * torch.randn_like(expected_image)
    elif name == "digits":
        expected_image, expected_label = _old_digits_train()[index]
    elif name == "imagefolder":
        path, expected_label = splits.train.samples[index]
        geometry = ([v2.RandomResizedCrop(16, antialias=True), v2.RandomHorizontalFlip()] if augment
                    else [v2.Resize(int(16 / 0.875), antialias=True), v2.CenterCrop(16)])
        expected_image = _standard_train(geometry, IMAGENET)(Image.open(path).convert("RGB"))
    else:
        expected_label = splits.train.targets[index]
        geometry = [v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip()] if augment else []
        expected_image = _standard_train(geometry, CIFAR10)(Image.fromarray(splits.train.data[index]))
    assert isinstance(image, torch.Tensor) and torch.equal(image, expected_image), name
    assert label == expected_label


# --- loading: collation, and the views' draws resumed exactly --------------------------------------

@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_views_batch_collates_and_resumes_mid_epoch_with_the_same_draws(num_workers, data_root):
    """A train loader over data.views=2 yields [[view_1, view_2], labels] (default_collate makes the
    tuples lists): two B x C x H x W batches and B labels, counted and moved as one batch. Resumed after
    3 batches as train.py resumes (the epoch's loader started at the position, nothing before it
    loaded, and the checkpointed global RNG restored), it yields the uninterrupted epoch's remaining
    views exactly: each sample's views are drawn from its own seed."""
    cfg = compose_data(data_overrides("synthetic", data_root, "data.num_samples=40", "data.views=2", "data.augment=true",
                                      "data.batch_size=4", f"data.num_workers={num_workers}"))
    train = build_datasets(cfg).train
    env, stop = DistEnv(rank=1, world_size=2), 3

    def epoch_loader(samples_in_epoch: int = 0):
        loader = build_train_loader(train, cfg, env, seed=0, pin_memory=False)
        start_epoch(loader, 1, samples_in_epoch)
        return loader

    torch.manual_seed(0)
    uninterrupted, rng_at_stop = [], None
    for index, batch in iterate_from(epoch_loader(), 0):
        uninterrupted.append(batch)
        if index == stop - 1:
            rng_at_stop = torch.get_rng_state()  # what a checkpoint saved after `stop` batches holds
    assert len(uninterrupted) == 5  # 20 samples a rank, in batches of 4
    (first, second), labels = uninterrupted[0]
    assert first.shape == second.shape == (4, 3, 8, 8) and labels.shape == (4,) and not torch.equal(first, second)
    assert batch_size(uninterrupted[0]) == 4
    moved = to_device(uninterrupted[0], torch.device("cpu"), torch.channels_last)
    assert all(view.is_contiguous(memory_format=torch.channels_last) for view in moved[0])

    torch.manual_seed(1)  # the resumed process's own state, until the checkpoint's is restored
    resumed = list(iterate_from(epoch_loader(stop * 4 * env.world_size), stop, on_resume=lambda: torch.set_rng_state(rng_at_stop)))
    assert [index for index, _ in resumed] == list(range(stop, len(uninterrupted)))
    for index, ((first, second), labels) in resumed:
        (expected_first, expected_second), expected_labels = uninterrupted[index]
        assert torch.equal(first, expected_first) and torch.equal(second, expected_second), index
        assert torch.equal(labels, expected_labels)


# --- refusals ------------------------------------------------------------------------------------

BAD_VALUES = {
    "no_views": (["data.views=0"], "data.views=0: must be >= 1"),
    "negative_views": (["data.views=-1"], "data.views=-1: must be >= 1"),
}


@pytest.mark.parametrize("name", DATASETS)
@pytest.mark.parametrize("case", BAD_VALUES, ids=BAD_VALUES)
def test_bad_values_are_one_line_errors(name, case, data_root):
    overrides, message = BAD_VALUES[case]
    with pytest.raises(ConfigError) as error:
        splits_of(name, data_root, *overrides)
    assert str(error.value).startswith(message) and "\n" not in str(error.value), str(error.value)


@pytest.mark.parametrize("overrides, message", [
    (["data=digits", "data.augment=true"], "data.augment=true: data=digits augments only the views of data.views >= 2"),
    (["data=cifar10", "data.views=2", "data.augment=randaugment"],
     "data.augment=randaugment: with data.views=2 each view gets SimCLR's augmentation"),
    (["data=shapes", "task=segmentation", "model=small_segnet", "data.views=2"],
     "data.views: unknown key, not an option of data.shapes.build_shapes"),
], ids=["digits_augment_without_views", "cifar10_policy_with_views", "segmentation_has_no_views"])
def test_options_that_views_do_not_take_are_refused_in_one_line(overrides, message, data_root, tmp_path):
    """Refused by train.run before anything starts, in one line naming the key."""
    if "data=cifar10" in overrides:
        overrides = [*overrides, f"data.root={data_root['cifar10']}"]
    assert config_error_in_this_process(overrides, tmp_path / "run").startswith(message)


def test_views_for_a_task_that_trains_on_one_image_are_refused_on_the_command_line(tmp_path):
    """`python train.py data.views=2` with task=classification: exit 1, one `error:` line naming
    data.views and the fix, no run dir left."""
    result = launch(["data.views=2", "trainer.max_epochs=1"], cwd=tmp_path, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0] == "error: data.views=2: ClassificationTask trains on 1 view(s) of each sample; set data.views=1"
    outputs = tmp_path / "outputs"
    assert not outputs.exists() or not [p for p in outputs.iterdir() if p.name != ".launches"]
