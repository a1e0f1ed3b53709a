"""Real models and real data: torchvision and timm models by name, local pretrained weights, the
standard train and eval transforms, MixUp/CutMix and label smoothing, and mode=eval on a checkpoint."""

import json
import logging
import re
from pathlib import Path

import numpy as np

import pytest
import torch
import torch.nn.functional as F
import torchvision
from hydra import compose, initialize_config_dir
from PIL import Image
from safetensors.torch import save_file

import train
from conftest import (REPO, TINY, check, last_checkpoint, launch, load_results, run_dirs, run_in_this_process, shared_run,
                      write_imagefolder)
from data import build_datasets
from data.mix import build_batch_mix
from data.presets import AUGMENTS, cifar10_transforms, imagefolder_transforms
from data.vision import BadSample
from ddp.config.schema import ConfigError, register_configs
from ddp.distributed.env import DistEnv
from ddp.jobs.run_dir import SWEPT_KEYS_ENV, _job_dir_name, register_resolvers, swept_keys
from ddp.loading.loaders import build_train_loader, start_epoch
from ddp.training.update import UpdateStep
from models import build_model
from tasks.classification import ClassificationTask

register_configs()
register_resolvers()
CPU = torch.device("cpu")


def compose_config(*overrides: str):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


# --- models by name --------------------------------------------------------------------------

ZOO = {
    "torchvision resnet50": ["model=torchvision", "model.name=resnet50"],
    "torchvision convnext_tiny": ["model=torchvision", "model.name=convnext_tiny"],
    "torchvision vit_b_16": ["model=torchvision", "model.name=vit_b_16", "+model.kwargs.image_size=32"],
    "torchvision mobilenet_v3_small": ["model=torchvision", "model.name=mobilenet_v3_small"],
    "timm resnet10t": ["model=timm", "model.name=resnet10t", "model.drop_path_rate=0.1"],
    "timm vit_tiny_patch16_224": ["model=timm", "model.name=vit_tiny_patch16_224", "+model.kwargs.img_size=32"],
}


@pytest.mark.parametrize("overrides", ZOO.values(), ids=ZOO.keys())
def test_a_model_by_name_builds_and_trains_one_step(overrides):
    """Built from its name with the data's classes and channels (1 here: the stem adapts), two
    optimizer updates on a tiny batch (a ViT's head starts at zero, so the first trains only the
    head) give finite losses and change most of the weights."""
    torch.manual_seed(0)
    model = build_model(compose_config(*overrides).model, num_classes=5, in_channels=1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    update = UpdateStep(model, torch.optim.SGD(model.parameters(), lr=0.1), task=ClassificationTask(), precision="32")
    for _ in range(2):
        loss = update.micro_step((torch.randn(2, 1, 32, 32), torch.tensor([0, 4])), micro_index=0, group_size=1)
        assert torch.isfinite(loss)
    assert model(torch.randn(2, 1, 32, 32)).shape == (2, 5)
    unchanged = [name for name, p in model.named_parameters() if torch.equal(p, before[name])]
    assert len(unchanged) < len(before) / 2, unchanged


def test_small_input_stem_keeps_32px_images_whole():
    """resnet-style models: a 3x3 stride-1 stem without the max-pool, so the last stage still sees 4x4."""
    model = build_model(compose_config("model=torchvision", "model.name=resnet50", "model.small_input=true").model, 10, 3)
    features = torch.nn.Sequential(*list(model.children())[:-2])
    assert features(torch.randn(1, 3, 32, 32)).shape[-2:] == (4, 4)
    assert isinstance(model.maxpool, torch.nn.Identity) and model.conv1.kernel_size == (3, 3)


# --- local weights ----------------------------------------------------------------------------

def torchvision_resnet18(weights_path, num_classes: int = 10):
    overrides = ["model=torchvision", "model.name=resnet18", f"model.weights_path={weights_path}"]
    return build_model(compose_config(*overrides).model, num_classes=num_classes, in_channels=3)


def test_a_torchvision_state_dict_loads_into_model_torchvision(tmp_path):
    reference = torchvision.models.resnet18(num_classes=10)
    torch.save(reference.state_dict(), tmp_path / "resnet18.pth")
    loaded = torchvision_resnet18(tmp_path / "resnet18.pth").state_dict()
    assert all(torch.equal(loaded[key], value) for key, value in reference.state_dict().items())


def test_the_head_is_skipped_and_logged_when_num_classes_differs(tmp_path, caplog):
    reference = torchvision.models.resnet18(num_classes=1000)
    torch.save(reference.state_dict(), tmp_path / "imagenet.pth")
    with caplog.at_level(logging.WARNING):
        loaded = torchvision_resnet18(tmp_path / "imagenet.pth", num_classes=7).state_dict()
    assert "skipped the classifier head ['fc.bias', 'fc.weight']" in caplog.text
    assert loaded["fc.weight"].shape == (7, 512)
    assert all(torch.equal(loaded[key], value) for key, value in reference.state_dict().items() if not key.startswith("fc."))


def test_safetensors_weights_load(tmp_path):
    reference = torchvision.models.resnet18(num_classes=10)
    save_file(reference.state_dict(), tmp_path / "resnet18.safetensors")
    loaded = torchvision_resnet18(tmp_path / "resnet18.safetensors").state_dict()
    assert all(torch.equal(loaded[key], value) for key, value in reference.state_dict().items())


def test_our_own_checkpoint_gives_its_model_weights(single_run):
    """A run's last.pt as model.weights_path: its `model` entry, into a fresh model of the same config."""
    checkpoint = last_checkpoint(single_run)
    cfg = compose_config("model.channels=[8,16]", f"model.weights_path={single_run / 'checkpoints' / 'last.pt'}")
    loaded = build_model(cfg.model, num_classes=10, in_channels=3).state_dict()
    assert all(torch.equal(loaded[key], value) for key, value in checkpoint["model"].items())


WRAPPERS = {
    "DataParallel": torch.nn.DataParallel,
    "compile": torch.compile,
    "compile(DataParallel)": lambda model: torch.compile(torch.nn.DataParallel(model)),
    "DataParallel(compile)": lambda model: torch.nn.DataParallel(torch.compile(model)),
}


@pytest.mark.parametrize("wrap", WRAPPERS.values(), ids=WRAPPERS.keys())
def test_weights_saved_from_a_wrapped_model_load_whatever_the_wrapper_order(tmp_path, wrap):
    """`module.` (DDP, DataParallel) and `_orig_mod.` (torch.compile) prefixes, nested in either order."""
    cfg = compose_config("model.channels=[8,16]")
    torch.manual_seed(1)
    reference = build_model(cfg.model, num_classes=10, in_channels=3)
    torch.save(wrap(reference).state_dict(), tmp_path / "wrapped.pt")
    cfg = compose_config("model.channels=[8,16]", f"model.weights_path={tmp_path / 'wrapped.pt'}")
    torch.manual_seed(2)  # another initialisation: only a load gives the reference's weights
    loaded = build_model(cfg.model, num_classes=10, in_channels=3).state_dict()
    assert loaded.keys() == reference.state_dict().keys()
    assert all(torch.equal(loaded[key], value) for key, value in reference.state_dict().items())


def test_a_pickled_object_is_refused_and_never_run(tmp_path):
    torch.save(torchvision.models.resnet18(num_classes=10), tmp_path / "whole_model.pth")
    with pytest.raises(ConfigError, match="refused, it holds pickled objects"):
        torchvision_resnet18(tmp_path / "whole_model.pth")


# --- transforms -------------------------------------------------------------------------------

def first_batch(dataset, data_cfg, rank: int, epoch: int) -> torch.Tensor:
    loader = build_train_loader(dataset, data_cfg, DistEnv(rank=rank, world_size=2), seed=0, pin_memory=False)
    start_epoch(loader, epoch)
    return next(iter(loader))[0]


def test_train_augmentation_differs_across_epochs_and_ranks_and_repeats_exactly(tmp_path):
    """Eight copies of one image, read by 2 workers: each sample of each (rank, epoch) gets its own
    augmentation, the same (rank, epoch) again gives the same pixels (exact resume relies on it), and
    the eval transform of the image is always the same."""
    image = tmp_path / "one.png"
    write_imagefolder(tmp_path / "source", classes=("a",), per_class=1, splits=("x",), size=(40, 36))
    (tmp_path / "source" / "x" / "a" / "0.png").rename(image)
    for split in ("train", "val"):
        (tmp_path / "tree" / split / "a").mkdir(parents=True)
        for i in range(8):
            (tmp_path / "tree" / split / "a" / f"{i}.png").symlink_to(image)
    cfg = compose_config("data=imagefolder", f"data.root={tmp_path / 'tree'}", "data.image_size=16", "data.augment=randaugment",
                         "data.random_erase=0.5", "data.num_workers=2", "data.batch_size=4")
    splits = build_datasets(cfg.data)
    batches = {(rank, epoch): first_batch(splits.train, cfg.data, rank, epoch) for rank in (0, 1) for epoch in (0, 1)}
    assert batches[0, 0].shape == (4, 3, 16, 16)
    pairs = list(batches.values())
    assert all(not torch.equal(a, b) for i, a in enumerate(pairs) for b in pairs[i + 1:])
    assert torch.equal(first_batch(splits.train, cfg.data, 1, 1), batches[1, 1])
    assert torch.equal(splits.val[0][0], splits.val[1][0])


# The datasets' published per-channel statistics, stated here again so that the test sees a change.
IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
CIFAR10 = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))


@pytest.mark.parametrize("augment", AUGMENTS)
def test_every_preset_gives_normalised_crops_of_the_configured_size(augment):
    """A constant colour c gives (c / 255 - mean) / std per channel, with the dataset's own statistics,
    in a crop of the configured size; augment=none trains on exactly the eval transform."""
    colour = (120, 30, 200)
    image = Image.new("RGB", (50, 40), color=colour)
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 50, 3), dtype=np.uint8))
    presets = {
        "imagefolder": (lambda erase: imagefolder_transforms(24, augment, random_erase=erase, interpolation="bicubic"), 24, IMAGENET),
        "cifar10": (lambda erase: cifar10_transforms(augment, random_erase=erase, interpolation="bilinear"), 32, CIFAR10),
    }
    for name, (transforms, size, (mean, std)) in presets.items():
        source, noisy = (image, noise) if name == "imagefolder" else (image.resize((32, 32)), noise.resize((32, 32)))
        expected = ((torch.tensor(colour) / 255 - torch.tensor(mean)) / torch.tensor(std)).view(3, 1, 1).expand(3, size, size)
        train, evaluate, _ = transforms(0.25)
        assert train(source).shape == (3, size, size) and train(source).dtype == torch.float32
        train, evaluate, _ = transforms(0.0)
        assert torch.allclose(evaluate(source), expected, atol=1e-5), name
        if augment == "none":
            assert torch.equal(train(noisy), evaluate(noisy)), name


def test_eval_resizes_to_crop_over_0_875_then_centre_crops():
    """The ImageNet convention: a 224 crop comes from the image resized to 256 on its short side."""
    _, evaluate, _ = imagefolder_transforms(224, "standard", random_erase=0.0, interpolation="bilinear")
    resize, crop = evaluate.transforms[:2]
    assert (list(resize.size), list(crop.size)) == ([256], [224, 224])


def test_images_decode_to_the_pixels_of_torchvisions_imagefolder_loader(tmp_path):
    """An image file or its bytes decode as torchvision's default ImageFolder loader reads the file: the same
    RGB pixels, whatever the file's own mode (an RGB image is kept as decoded rather than copied)."""
    from torchvision.datasets.folder import pil_loader

    from data.encoded import decode_image
    from data.vision import CheckedImageFolder, rgb_image

    pixels = np.random.default_rng(0).integers(0, 256, (30, 40, 4), dtype=np.uint8)
    images = {"rgb.jpg": Image.fromarray(pixels[..., :3]), "cmyk.jpg": Image.fromarray(pixels, "CMYK"),
              "gray.png": Image.fromarray(pixels[..., 0]), "rgba.png": Image.fromarray(pixels, "RGBA"),
              "palette.png": Image.fromarray(pixels[..., :3]).quantize(16), "bits.png": Image.fromarray(pixels[..., 0] > 127)}
    for name, image in images.items():
        path = tmp_path / "cls" / name
        path.parent.mkdir(exist_ok=True)
        image.save(path)
        expected = np.asarray(pil_loader(str(path)))
        for decoded in (rgb_image(str(path)), decode_image(path.read_bytes())):
            assert decoded.mode == "RGB" and np.array_equal(np.asarray(decoded), expected), name
    assert CheckedImageFolder(str(tmp_path), None, "train", "error").loader is rgb_image


# --- unreadable images ------------------------------------------------------------------------

def add_unreadable_images(root) -> dict[str, str]:
    """A truncated JPEG and a zero-byte PNG in train/, a text file named .jpg in val/: {kind: path}."""
    truncated = root / "train" / "cat" / "1_truncated.jpg"
    pixels = np.random.default_rng(0).integers(0, 256, (20, 24, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(truncated, quality=95)
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    empty, text = root / "train" / "dog" / "1_empty.png", root / "val" / "dog" / "0_text.jpg"
    empty.write_bytes(b"")
    text.write_text("not an image")
    return {"truncated": str(truncated), "zero-byte": str(empty), "not an image": str(text)}


@pytest.mark.parametrize("kind", ["truncated", "zero-byte", "not an image"])
def test_an_unreadable_image_is_named_with_its_index_in_one_line(tmp_path, kind):
    """data.on_bad_sample=error (the default): read by a DataLoader worker, the error still comes back as
    one line naming the file and its index in its split."""
    root = write_imagefolder(tmp_path / "images", per_class=4)
    path = add_unreadable_images(root)[kind]
    cfg = compose_config("data=imagefolder", f"data.root={root}", "data.image_size=16", "data.num_workers=1")
    assert cfg.data.on_bad_sample == "error"
    splits = build_datasets(cfg.data)
    dataset = splits.train if "/train/" in path else splits.val
    index = [sample for sample, _ in dataset.samples].index(path)
    loader = torch.utils.data.DataLoader(dataset, sampler=[index], num_workers=1)
    with pytest.raises(BadSample) as error:
        next(iter(loader))
    split = "train" if dataset is splits.train else "val"
    assert str(error.value).startswith(f"{path} (index {index} of the {split} split): unreadable image (")
    assert "data.on_bad_sample=skip" in str(error.value) and "\n" not in str(error.value)


def test_unreadable_images_end_the_run_in_one_line(tmp_path):
    """The first unreadable image a DataLoader worker reads ends the run: one line on stderr, exit 1.
    One worker: how many there are changes nothing of the error's way back (two read in the test below)."""
    root = write_imagefolder(tmp_path / "images", per_class=4)
    add_unreadable_images(root)
    result = launch(["data=imagefolder", f"data.root={root}", "data.image_size=16", "data.batch_size=4", "data.num_workers=1",
                     "model.channels=[8,16]", "trainer.max_epochs=1"], tmp_path)
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    assert re.fullmatch(r"error: \S+/train/\w+/1_\w+\.(jpg|png) \(index \d+ of the train split\): unreadable image .*", line), line


def test_unreadable_images_skipped_are_counted_and_resume_stays_exact(tmp_path, monkeypatch, caplog):
    """data.on_bad_sample=skip: each unreadable image is replaced by the next one of its split, the same
    on every read, so a run resumed from the step-3 checkpoint of another ends with the very weights of
    that run never stopped (random augmentation, two DataLoader workers); both count the 3 files, and
    each logs them. Both runs are train.run in this process (a launch costs seconds of start-up; how the
    command line ends on an unreadable image: above)."""
    root = write_imagefolder(tmp_path / "images", per_class=6)
    paths = add_unreadable_images(root)
    args = ["data=imagefolder", f"data.root={root}", "data.image_size=16", "data.batch_size=4", "data.num_workers=2",
            "data.augment=trivialaugment", "data.on_bad_sample=skip", "model.channels=[8,16]", "trainer.max_epochs=2",
            "checkpoint.every_n_steps=3", "checkpoint.keep_last=10"]  # all kept: step 3's too
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    monkeypatch.chdir(tmp_path)
    logs = {}
    for run_dir, resume in ((straight_dir, []), (resumed_dir, [f"resume={straight_dir / 'checkpoints' / 'step-00000003.pt'}"])):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            results = run_in_this_process([*args, *resume], run_dir)
        assert results["bad_samples_skipped"] == 3
        logs[run_dir] = caplog.text
        assert "replaced 3 unreadable image(s)" in logs[run_dir] and all(path in logs[run_dir] for path in paths.values())
    straight, resumed = last_checkpoint(straight_dir), last_checkpoint(resumed_dir)
    assert straight["global_step"] == resumed["global_step"] == 8  # 14 training images: 4 batches, 2 epochs
    assert all(torch.equal(value, resumed["model"][key]) for key, value in straight["model"].items())
    assert "at epoch 0, batch 3, step 3" in logs[resumed_dir]


# --- loss-side regularisation -----------------------------------------------------------------

@pytest.mark.parametrize("mixup_alpha, cutmix_alpha", [(0.2, 0.0), (0.0, 1.0), (0.2, 1.0)])
def test_mixed_batches_train_on_soft_targets_with_label_smoothing(mixup_alpha, cutmix_alpha):
    """The update's loss is the label-smoothed cross-entropy of the mixed images against the mixed
    (soft) targets, drawn from torch's RNG as seeded."""
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 4))
    images, labels = torch.randn(6, 3, 8, 8), torch.tensor([0, 1, 2, 3, 0, 1])
    mix = build_batch_mix(mixup_alpha, cutmix_alpha, num_classes=4)
    torch.manual_seed(5)
    mixed, targets = mix(images, labels)
    assert targets.shape == (6, 4) and torch.allclose(targets.sum(dim=1), torch.ones(6))
    assert not torch.equal(targets, F.one_hot(labels, 4).float())  # soft, not the hard labels
    expected = F.cross_entropy(model(mixed), targets, label_smoothing=0.1)
    task = ClassificationTask(4, label_smoothing=0.1, mixup_alpha=mixup_alpha, cutmix_alpha=cutmix_alpha)
    update = UpdateStep(model, torch.optim.SGD(model.parameters(), lr=0.0), task=task, precision="32")
    torch.manual_seed(5)
    assert torch.equal(update.micro_step((images, labels), micro_index=0, group_size=1), expected.detach())


def test_no_mixing_by_default():
    assert build_batch_mix(0.0, 0.0, num_classes=4) is None


# --- sweeps name their runs -------------------------------------------------------------------

def test_a_sweep_job_dir_is_named_after_its_swept_values_and_fits_a_file_name(monkeypatch):
    swept = swept_keys(["data=synthetic", "data.batch_size=16,32", "optim.lr=0.1,0.2"])
    assert swept == {"data.batch_size", "optim.lr"}
    monkeypatch.setenv(SWEPT_KEYS_ENV, ",".join(swept))
    task = ["data=synthetic", "data.batch_size=16", "optim.lr=0.1"]
    assert _job_dir_name(0, task) == "0_data.batch_size=16,optim.lr=0.1"
    monkeypatch.setenv(SWEPT_KEYS_ENV, "")  # an Optuna search: the sweeper picks the values
    assert _job_dir_name(3, ["optim.lr=0.05", "data.root=/datasets/imagenet"]) == "3_data.root=_datasets_imagenet,optim.lr=0.05"
    # too long for a file name: cut where an override ends, and the job number stays
    long_values = [f"k{i}=" + "v" * 30 for i in range(6)]  # 33 characters each
    assert _job_dir_name(7, long_values) == "7_" + ",".join(long_values[:3])  # 4 would make 137 > 120
    assert _job_dir_name(12, ["x" * 300]) == "12"


# --- mode=eval --------------------------------------------------------------------------------

EVAL = ["mode=eval", *[arg for arg in TINY if arg.startswith("data")]]


@pytest.fixture(scope="module")
def evaluated(plain_ddp_run, tmp_path_factory):
    """plain_ddp_run's checkpoint (2-rank DDP, no SyncBN, with EMA) evaluated by 1 process and by 3 ranks.
    The 3 ranks run under torchrun, in the run dir their launch makes; the 1 process is train.run in this
    one, in a dir made here (a launch would cost seconds of start-up; mode=eval launched in one process:
    tests/test_trainer.py and tests/test_best.py). Once for all test processes (shared_run)."""
    cwd, _ = plain_ddp_run
    (trained,) = run_dirs(cwd)

    def evaluate(eval_cwd: Path) -> dict:
        checkpoint_mtime = (trained / "checkpoints" / "last.pt").stat().st_mtime_ns
        (eval_cwd / "ddp").mkdir()
        check(launch([*EVAL, "strategy=ddp", f"resume={trained}"], eval_cwd / "ddp", nproc=3))
        (three_ranks,) = run_dirs(eval_cwd / "ddp")
        single = eval_cwd / "single" / "outputs" / "run"
        single.mkdir(parents=True)
        train.run(compose_config(*EVAL, "strategy=single", f"resume={trained}"), single, relaunch="")
        return {"checkpoint_mtime": checkpoint_mtime, "single": str(single), "ddp": str(three_ranks)}

    _, evaluation = shared_run("eval_plain_ddp_run", evaluate, tmp_path_factory)
    return trained, evaluation["checkpoint_mtime"], {name: Path(evaluation[name]) for name in ("single", "ddp")}


def test_eval_of_a_checkpoint_is_exact_for_any_world_size_and_matches_training(evaluated):
    trained, _, runs = evaluated
    single, three_ranks = (json.loads((runs[s] / "eval.json").read_text()) for s in ("single", "ddp"))
    training = load_results(trained.parents[1])
    assert (single["world_size"], three_ranks["world_size"]) == (1, 3)
    assert single["val_samples"] == three_ranks["val_samples"] == training["val_samples"] == 37
    assert single["val_accuracy"] == three_ranks["val_accuracy"] == training["val_accuracy"]
    assert single["val_ema_accuracy"] == three_ranks["val_ema_accuracy"] == training["val_ema_accuracy"]  # its EMA too
    for result in (single, three_ranks):  # float32 loss sums over other batch groupings
        assert result["val_loss"] == pytest.approx(training["val_loss"], rel=1e-6)
        assert result["val_ema_loss"] == pytest.approx(training["val_ema_loss"], rel=1e-6)
        assert result["step"] == training["steps"] and result["checkpoint"].endswith("last.pt")


def test_eval_writes_a_new_run_dir_and_no_checkpoint(evaluated):
    trained, checkpoint_mtime, runs = evaluated
    for run_dir in runs.values():
        assert run_dir != trained
        assert not (run_dir / "checkpoints").exists() and not list(run_dir.rglob("events.out.tfevents*"))
    assert (trained / "checkpoints" / "last.pt").stat().st_mtime_ns == checkpoint_mtime
