"""Detection datasets as shards: `python -m data.shards` converts data=coco and data=detection_shapes, and
data=webdataset reads them back as the dataset gave them. A COCO folder (generated shapes saved as PNGs,
crowd regions, empty images, category ids out of order with gaps, a box past its image's edge) converted
by the real command gives data=coco's samples, ids, aspect ratios, categories and ground truth, and
trains to its bit-identical weights, optimizer state and COCO metrics with augmentation on; the
generated shapes convert to their own samples; a changed byte is named by --verify; an option of the
other kind of shards is one line. The folder's own properties: tests/test_detection_data.py."""

import copy
import json
import math
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from PIL import Image

from conftest import REPO, check, last_checkpoint, results_of, run_in_this_process
from data.coco import build_coco
from data.detection_shapes import build_detection_shapes
from data.shards import convert
from data.webdataset import build_webdataset
from ddp.config.schema import ConfigError

CATEGORY_IDS = {1: 7, 2: 3, 3: 12}  # the shapes' categories as COCO ids: out of order, with gaps
SHAPES = dict(image_size=32, crowd_fraction=0.4, empty_fraction=0.15)
DETECTION = ["task=detection", "model=detection", "model.name=small_fcos"]
# 12 training images, 3 steps an epoch, 2 epochs, augmentation on; validation at batch 1, as data=coco's
TRAIN = ["data.augment=hflip", "data.batch_size=4", "data.val_batch_size=1", "data.num_workers=0", "trainer.max_epochs=2",
         "checkpoint.keep_best=0"]


def write_shapes_coco(root: Path) -> None:
    """root in COCO 2017's layout: generated shapes, each image a PNG of its drawn pixels, the ground
    truth its annotation file (val image ids from 1001), and one val box reaching half a pixel past its
    image (within data/coco.py's tolerance: clipped in the target, as stored in the ground truth)."""
    shapes = build_detection_shapes(num_samples=12, num_val_samples=8, augment="none", **SHAPES)
    (root / "annotations").mkdir(parents=True)
    for split, dataset, first_id in (("train", shapes.train, 0), ("val", shapes.val, 1000)):
        ground_truth = copy.deepcopy(dataset.coco_ground_truth())
        (root / f"{split}2017").mkdir()
        for index, image in enumerate(ground_truth["images"]):
            image["id"] += first_id
            image["file_name"] = f"{image['id']:012d}.png"
            Image.fromarray(dataset.draw(index)[0].permute(1, 2, 0).numpy()).save(root / f"{split}2017" / image["file_name"])
        for annotation in ground_truth["annotations"]:
            annotation["image_id"] += first_id
            annotation["category_id"] = CATEGORY_IDS[annotation["category_id"]]
        ground_truth["categories"] = [{**category, "id": CATEGORY_IDS[category["id"]]} for category in ground_truth["categories"]]
        if split == "val":
            widths = {image["id"]: image["width"] for image in ground_truth["images"]}
            past = next(a for a in ground_truth["annotations"] if not a["iscrowd"])
            past["bbox"][2] = widths[past["image_id"]] - past["bbox"][0] + 0.5
        (root / "annotations" / f"instances_{split}2017.json").write_text(json.dumps(ground_truth))


@pytest.fixture(scope="module")
def coco(tmp_path_factory) -> dict:
    """The folder, and its shards as the real command writes them (5 samples a shard: 3 train shards, 2 val)."""
    root = tmp_path_factory.mktemp("coco")
    write_shapes_coco(root / "coco")
    result = subprocess.run([sys.executable, "-m", "data.shards", str(root / "shards"), "data=coco", f"data.root={root / 'coco'}",
                             "--samples-per-shard=5"], cwd=REPO, capture_output=True, text=True, timeout=180)
    check(result)
    shards = {"train_shards": f"{root}/shards/train-{{000000..000002}}.tar", "val_shards": f"{root}/shards/val-{{000000..000001}}.tar"}
    return {"root": root / "coco", "shards": root / "shards", "patterns": shards, "printed": result.stdout.strip().splitlines()[-1]}


def assert_same_samples(first, second) -> None:
    """Every sample of two detection datasets equal: images and targets (boxes, labels, image_id, the
    seed drawn after the transform), each loaded with the same seed of torch's RNG, as the loader seeds it."""
    assert len(first) == len(second)
    for index in range(len(first)):
        torch.manual_seed(index)
        image, target = first[index]
        torch.manual_seed(index)
        other_image, other_target = second[index]
        assert torch.equal(image, other_image) and target.keys() == other_target.keys(), index
        assert all(torch.equal(value, other_target[key]) if isinstance(value, torch.Tensor) else value == other_target[key]
                   for key, value in target.items()), (index, target, other_target)


def test_coco_shards_give_data_coco_samples_ids_and_ground_truth(coco):
    presets = {"hflip": {}, "lsj": {"lsj_size": 40}, "multiscale": {"multiscale_sizes": [24, 40], "multiscale_max_size": 60}}
    for augment, sizes in presets.items():
        folder = build_coco(root=str(coco["root"]), augment=augment, **sizes)
        shards = build_webdataset(**coco["patterns"], augment=augment, **sizes)
        assert_same_samples(shards.train, folder.train)
    assert_same_samples(shards.val, folder.val)
    assert (shards.num_classes, shards.in_channels) == (folder.num_classes, folder.in_channels)
    assert shards.class_names == folder.class_names == ["background", "disc", "rectangle", "triangle"]
    for split in ("train", "val"):
        ours, theirs = getattr(shards, split), getattr(folder, split)
        assert ours.sample_ids == theirs.sample_ids and ours.aspect_ratios == theirs.aspect_ratios
        assert ours.category_ids == theirs.category_ids == [3, 7, 12]
        assert ours.coco_ground_truth() == theirs.coco_ground_truth() and ours.coco_ground_truth() is ours.coco_ground_truth()
        assert ours.collate_fn is theirs.collate_fn
    assert any(a["iscrowd"] for a in shards.val.coco_ground_truth()["annotations"])  # in the ground truth, in no target


def test_the_shards_hold_each_file_and_its_annotations_and_the_manifest_what_the_reader_needs(coco):
    shards, root = coco["shards"], coco["root"]
    manifest = json.loads((shards / "dataset.json").read_text())
    assert manifest["task"] == "detection" and manifest["num_classes"] == 4
    assert manifest["categories"] == [{"id": 3, "name": "disc"}, {"id": 7, "name": "rectangle"}, {"id": 12, "name": "triangle"}]
    val = json.loads((root / "annotations" / "instances_val2017.json").read_text())
    assert manifest["splits"]["val"]["image_ids"] == list(range(1001, 1009)) and manifest["splits"]["val"]["samples"] == [5, 3]
    assert manifest["splits"]["val"]["image_sizes"] == [[image["width"], image["height"]] for image in val["images"]]
    with tarfile.open(shards / "val-000001.tar") as archive:  # sample 6: image 1007
        assert archive.getnames() == [f"00000000{key}.{extension}" for key in (5, 6, 7) for extension in ("json", "png")]
        assert archive.extractfile("000000006.png").read() == (root / "val2017" / "000000001007.png").read_bytes()
        target = json.loads(archive.extractfile("000000006.json").read())
    assert target["image_id"] == 1007 and (target["width"], target["height"], target["file_name"]) == (
        val["images"][6]["width"], val["images"][6]["height"], "000000001007.png")
    assert [{**a, "image_id": 1007} for a in target["annotations"]] == [a for a in val["annotations"] if a["image_id"] == 1007]
    assert "task=detection model=detection data.augment=hflip data.val_batch_size=1" in coco["printed"]


def metrics_of(results: dict) -> dict:
    """The val metrics, NaN (a statistic with nothing to rank) as a string, so that == compares them."""
    return {key: "nan" if isinstance(value, float) and math.isnan(value) else value
            for key, value in results.items() if key.startswith("val_")}


def assert_equal_states(first, second, where: str = "") -> None:
    if isinstance(first, torch.Tensor):
        assert torch.equal(first, second), where
    elif isinstance(first, dict):
        assert first.keys() == second.keys(), where
        for key in first:
            assert_equal_states(first[key], second[key], f"{where}.{key}")
    elif isinstance(first, (list, tuple)):
        assert len(first) == len(second), where
        for position, (a, b) in enumerate(zip(first, second)):
            assert_equal_states(a, b, f"{where}[{position}]")
    else:
        assert first == second, where


def test_coco_and_its_shards_train_bit_identically_with_augmentation_on(coco, tmp_path, monkeypatch):
    """small_fcos, 6 updates with hflip on: the same model and optimizer states, bit for bit, and the same COCO metrics."""
    monkeypatch.chdir(tmp_path)
    run_in_this_process([*DETECTION, "data=coco", f"data.root={coco['root']}", *TRAIN], tmp_path / "folder")
    run_in_this_process([*DETECTION, "data=webdataset", *(f"data.{key}='{value}'" for key, value in coco["patterns"].items()),
                         *TRAIN], tmp_path / "shards")
    folder, shards = results_of(tmp_path / "folder"), results_of(tmp_path / "shards")
    assert folder["steps"] == shards["steps"] == 6 and folder["val_samples"] == shards["val_samples"] == 8
    assert metrics_of(folder) == metrics_of(shards)
    ours, theirs = last_checkpoint(tmp_path / "shards"), last_checkpoint(tmp_path / "folder")
    assert_equal_states(ours["model"], theirs["model"], "model")
    assert_equal_states(ours["optimizer"], theirs["optimizer"], "optimizer")
    assert any(value.abs().sum() > 0 for value in ours["optimizer"]["state"][0].values() if isinstance(value, torch.Tensor))


def test_generated_shapes_convert_to_their_own_samples(tmp_path):
    overrides = ["data=detection_shapes", "data.num_samples=10", "data.num_val_samples=6", "data.image_size=32",
                 "data.crowd_fraction=0.4"]
    printed = convert(tmp_path / "shards", overrides, samples_per_shard=4, progress_bar=False)
    assert "data.augment=hflip" in printed and "data.augment=none" not in printed  # stored as tensors, still augmented
    patterns = {"train_shards": f"{tmp_path}/shards/train-{{000000..000002}}.tar",
                "val_shards": f"{tmp_path}/shards/val-{{000000..000001}}.tar"}
    sizes = {"multiscale_sizes": [24, 32, 40], "multiscale_max_size": None}
    generated = build_detection_shapes(10, 6, 32, crowd_fraction=0.4, augment="multiscale", **sizes)
    shards = build_webdataset(**patterns, augment="multiscale", **sizes)
    assert_same_samples(shards.train, generated.train)
    assert_same_samples(shards.val, generated.val)
    for split in ("train", "val"):
        ours, theirs = getattr(shards, split), getattr(generated, split)
        assert ours.sample_ids == theirs.sample_ids and ours.aspect_ratios == theirs.aspect_ratios
        assert ours.category_ids == theirs.category_ids
        assert ours.coco_ground_truth() == theirs.coco_ground_truth()
    assert shards.class_names == generated.class_names and shards.num_classes == generated.num_classes == 4


def test_a_changed_byte_in_a_detection_shard_is_named_by_verify(coco, tmp_path):
    copied = tmp_path / "shards"
    copied.mkdir()
    for path in coco["shards"].iterdir():
        (copied / path.name).write_bytes(path.read_bytes())
    data = bytearray((copied / "val-000001.tar").read_bytes())
    data[1000] ^= 0x01
    (copied / "val-000001.tar").write_bytes(data)
    result = subprocess.run([sys.executable, "-m", "data.shards", "--verify", str(copied)], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert [line.split()[1] for line in result.stdout.splitlines() if line.startswith("corrupt")] == [f"{copied}/val-000001.tar:"]


def test_an_option_of_the_other_kind_of_shards_is_one_line(coco, tmp_path):
    with pytest.raises(ConfigError, match=r"^data\.views=2: these shards hold detection samples, which don't take it .*; remove data\.views$"):
        build_webdataset(**coco["patterns"], augment="hflip", views=2)
    with pytest.raises(ConfigError, match=r"^data\.augment=standard: not a detection preset"):
        build_webdataset(**coco["patterns"])
    digits = ["data=digits", "data.augment=false"]
    convert(tmp_path / "digits", digits, samples_per_shard=2000, progress_bar=False)
    shards = {"train_shards": f"{tmp_path}/digits/train-000000.tar", "val_shards": f"{tmp_path}/digits/val-000000.tar"}
    with pytest.raises(ConfigError, match=r"^data\.lsj_size=512: these shards hold classification samples, .*; remove data\.lsj_size$"):
        build_webdataset(**shards, augment="none", lsj_size=512)
