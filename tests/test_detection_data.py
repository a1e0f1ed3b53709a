"""Detection data: the generated shapes (data/detection_shapes.py), a local COCO-format folder
(data/coco.py) and the training presets (data/detection_transforms.py). Each test checks what a
detector, its loader or its COCO evaluation relies on."""

import contextlib
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.utils.data import DataLoader

from data.coco import build_coco
from data.detection_shapes import build_detection_shapes
from data.detection_transforms import AUGMENTS, detection_collate, detection_sample, train_transforms
from ddp.config.schema import ConfigError
from ddp.loading.batches import SampleList, batch_size
from ddp.loading.sample_seeds import SeededSamples

SMALL_SIZES = dict(multiscale_sizes=[48, 64], multiscale_max_size=100, lsj_size=56)


@pytest.fixture(scope="module")
def shapes():
    return build_detection_shapes(num_samples=48, num_val_samples=40, image_size=48, crowd_fraction=0.4, empty_fraction=0.15)


def equal_samples(first, second) -> bool:
    return (torch.equal(first[0], second[0]) and torch.equal(first[1]["boxes"], second[1]["boxes"])
            and torch.equal(first[1]["labels"], second[1]["labels"]) and first[1]["image_id"] == second[1]["image_id"])


def xyxy(annotation: dict) -> list[float]:
    x, y, width, height = annotation["bbox"]
    return [x, y, x + width, y + height]


def annotations_of(ground_truth: dict, image_id: int) -> list[dict]:
    return [annotation for annotation in ground_truth["annotations"] if annotation["image_id"] == image_id]


# --- generated shapes ---------------------------------------------------------------------------------

def test_shapes_samples_follow_the_detection_contract(shapes):
    assert (shapes.num_classes, shapes.in_channels) == (4, 3)
    assert shapes.class_names == ["background", "rectangle", "disc", "triangle"]
    for split in (shapes.train, shapes.val):
        assert split.category_ids == [1, 2, 3] and split.sample_ids == list(range(1, len(split) + 1))
        image, target = split[5]
        assert image.dtype == torch.float32 and image.shape[0] == 3 and 0 <= image.min() and image.max() <= 1
        assert type(image) is torch.Tensor and type(target["boxes"]) is torch.Tensor
        assert target["boxes"].dtype == torch.float32 and target["boxes"].shape[1] == 4
        assert target["labels"].dtype == torch.int64 and type(target["image_id"]) is int and target["image_id"] == 6


def test_shapes_are_deterministic_and_ignore_the_global_rng():
    """Two builds give the same images and boxes whatever the global RNG holds; with augmentation, the
    same global seed gives the same draw (as the loader seeds each sample)."""
    first, second = (build_detection_shapes(8, 8, 32, augment="none", data_seed=3) for _ in range(2))
    torch.manual_seed(1)
    drawn = [first.train[index] for index in range(8)] + [first.val[index] for index in range(8)]
    torch.manual_seed(2)
    again = [second.train[index] for index in range(8)] + [second.val[index] for index in range(8)]
    assert all(equal_samples(a, b) for a, b in zip(drawn, again))
    other_seed = build_detection_shapes(8, 8, 32, augment="none", data_seed=4)
    assert not torch.equal(other_seed.val[0][0], first.val[0][0])
    assert first.val.coco_ground_truth() == second.val.coco_ground_truth()
    assert first.val.coco_ground_truth() is first.val.coco_ground_truth()  # cached


def test_aspect_ratios_are_the_drawn_images_and_vary(shapes):
    for split in (shapes.train, shapes.val):
        ground_truth = {image["id"]: image for image in split.coco_ground_truth()["images"]}
        for index in range(len(split)):
            image = split.draw(index)[0]  # untransformed
            height, width = image.shape[-2:]
            assert split.aspect_ratios[index] == width / height
            assert min(height, width) == 48 and max(height, width) <= 96
            assert (ground_truth[split.sample_ids[index]]["width"], ground_truth[split.sample_ids[index]]["height"]) == (width, height)
    ratios = shapes.train.aspect_ratios
    assert min(ratios) < 0.8 and max(ratios) > 1.25  # portrait and landscape, for aspect-ratio grouping


def test_boxes_lie_in_their_image_around_their_shape(shapes):
    """Every box is inside its image with area > 0, and holds its shape: of the pixels in a box, many
    are nearest its category's colour (of the image's background and every category's colour), and
    of the pixels outside all boxes, hardly any are."""
    ground_truth = shapes.val.coco_ground_truth()
    boxes_seen = 0
    for index in range(len(shapes.val)):
        image, target = shapes.val[index]
        height, width = image.shape[-2:]
        boxes = target["boxes"]
        assert (boxes[:, 0] >= 0).all() and (boxes[:, 1] >= 0).all() and (boxes[:, 2] <= width).all() and (boxes[:, 3] <= height).all()
        assert ((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]) > 4).all()
        outside = torch.ones(height, width, dtype=torch.bool)
        for x1, y1, x2, y2 in (xyxy(annotation) for annotation in annotations_of(ground_truth, target["image_id"])):
            outside[max(int(y1) - 1, 0): int(y2) + 2, max(int(x1) - 1, 0): int(x2) + 2] = False
        palette = shapes.val.colours.clone()  # row l: label l's colour
        palette[0] = image[:, outside].median(dim=1).values  # the background's
        nearest = (image.flatten(1).T[:, None, :] - palette[None]).norm(dim=2).argmin(dim=1).view(height, width)
        assert (nearest[outside] != 0).float().mean() < 0.05
        for box, label in zip(boxes.tolist(), target["labels"].tolist()):
            x1, y1, x2, y2 = (round(value) for value in box)
            assert (nearest[y1:y2, x1:x2] == label).float().mean() > 0.3, (index, box, label)  # a triangle fills half
            boxes_seen += 1
    assert boxes_seen > 30


def test_empty_images_and_crowd_regions_are_in_the_ground_truth_and_no_crowd_in_a_target(shapes):
    """A target holds exactly the image's non-crowd ground-truth boxes (val: untransformed); crowd
    regions are there with iscrowd=1; empty images are samples with no boxes."""
    ground_truth = shapes.val.coco_ground_truth()
    assert {category["id"] for category in ground_truth["categories"]} == {1, 2, 3}
    crowded = empty = 0
    for index in range(len(shapes.val)):
        image, target = shapes.val[index]
        annotations = annotations_of(ground_truth, target["image_id"])
        plain = [annotation for annotation in annotations if not annotation["iscrowd"]]
        expected = torch.tensor([xyxy(annotation) for annotation in plain], dtype=torch.float32).reshape(-1, 4)
        torch.testing.assert_close(target["boxes"], expected)
        assert target["labels"].tolist() == [annotation["category_id"] for annotation in plain]
        crowded += len(annotations) > len(plain)
        if not annotations:
            empty += 1
            assert target["boxes"].shape == (0, 4) and target["labels"].shape == (0,)
    assert crowded >= 3 and empty >= 2
    # the training targets too, whatever the augmentation: never more boxes than the non-crowd ones
    for index in range(len(shapes.train)):
        plain = [a for a in annotations_of(shapes.train.coco_ground_truth(), index + 1) if not a["iscrowd"]]
        torch.manual_seed(index)
        assert len(shapes.train[index][1]["labels"]) == len(plain)


def test_ground_truth_evaluates_perfect_predictions_to_ap_1(shapes):
    """pycocotools builds COCO from coco_ground_truth(), and the val targets, given back as
    predictions, score AP 1: targets and ground truth share coordinates, crowd regions are ignored."""
    ground_truth = shapes.val.coco_ground_truth()
    predictions = [{"image_id": target["image_id"], "category_id": shapes.val.category_ids[label - 1],
                    "bbox": [x1, y1, x2 - x1, y2 - y1], "score": 1.0}
                   for _, target in (shapes.val[index] for index in range(len(shapes.val)))
                   for (x1, y1, x2, y2), label in zip(target["boxes"].tolist(), target["labels"].tolist())]
    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO()
        coco.dataset = ground_truth
        coco.createIndex()
        evaluation = COCOeval(coco, coco.loadRes(predictions), "bbox")
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    assert evaluation.stats[0] == pytest.approx(1.0)


def test_shapes_options_are_checked_in_one_line():
    for options, key in ((dict(num_categories=0), "data.num_categories=0"), (dict(image_size=8), "data.image_size=8"),
                         (dict(empty_fraction=1.5), "data.empty_fraction=1.5"), (dict(augment="mosaic"), "data.augment=mosaic"),
                         (dict(multiscale_sizes=[]), "data.multiscale_sizes=[]")):
        with pytest.raises(ConfigError) as error:
            build_detection_shapes(**{"num_samples": 4, "num_val_samples": 4, "image_size": 32, **options})
        message = str(error.value)
        assert message.startswith(key) and "; use" in message and "\n" not in message, message


def test_the_loader_seeds_augmentation_per_sample_and_collates_sample_lists():
    """Augmented samples are the same for the same (seed, epoch, index) whatever ran before (draws from
    torch's global RNG, seeded per sample), and differ across epochs; batches are SampleLists."""
    splits = build_detection_shapes(16, 8, 32, augment="ssd")
    seeded = SeededSamples(splits.train, seed=7, epoch=0)
    first = [seeded[index] for index in range(16)]
    torch.rand(100)
    assert all(equal_samples(a, seeded[index]) for index, a in enumerate(first))
    next_epoch = SeededSamples(splits.train, seed=7, epoch=1)
    assert not all(equal_samples(a, next_epoch[index]) for index, a in enumerate(first))
    images, targets = next(iter(DataLoader(splits.val, batch_size=3, collate_fn=splits.val.collate_fn)))
    assert type(images) is SampleList and type(targets) is SampleList and batch_size((images, targets)) == 3
    assert [target["image_id"] for target in targets] == [1, 2, 3]
    assert all(torch.equal(image, splits.val[index][0]) for index, image in enumerate(images))
    assert detection_collate([splits.val[0]])[1][0]["image_id"] == 1


# --- presets ------------------------------------------------------------------------------------------

def a_sample():
    """A 40 x 60 uint8 image, one bright box at x 10-25, y 5-30, label 2."""
    image = torch.zeros(3, 40, 60, dtype=torch.uint8)
    image[:, 5:30, 10:25] = 200
    return image, torch.tensor([[10.0, 5.0, 25.0, 30.0]]), torch.tensor([2])


def test_hflip_maps_a_box_to_width_minus_x():
    image, boxes, labels = a_sample()
    transform = train_transforms("hflip")
    outcomes = set()
    for seed in range(12):
        torch.manual_seed(seed)
        out, target = detection_sample(transform, image, boxes, labels, 9)
        pixels = (out * 255).round().to(torch.uint8)
        flipped = not torch.equal(pixels, image)
        outcomes.add(flipped)
        expected_boxes = torch.tensor([[60 - 25.0, 5.0, 60 - 10.0, 30.0]]) if flipped else boxes
        assert torch.equal(pixels, image.flip(-1) if flipped else image) and torch.equal(target["boxes"], expected_boxes)
        assert target["labels"].tolist() == [2] and target["image_id"] == 9
    assert outcomes == {True, False}


@pytest.mark.parametrize("augment", ["multiscale", "lsj", "ssd", "ssdlite"])
def test_resizing_presets_keep_boxes_on_their_pixels(augment):
    """After any preset, each box still frames the bright patch: its inside is bright and the image
    outside it is not; multiscale's shorter side is one of its sizes and its boxes scale with the image
    (flipped or not), lsj's output is its size. Filled with black here, so the fill isn't the patch."""
    image, boxes, labels = a_sample()
    transform = train_transforms(augment, **SMALL_SIZES, fill=(0, 0, 0))
    checked = 0
    for seed in range(20):
        torch.manual_seed(seed)
        out, target = detection_sample(transform, image, boxes, labels, 1)
        height, width = out.shape[-2:]
        assert target["labels"].tolist() == [2] * len(target["boxes"])
        if augment == "multiscale":
            scale = height / 40
            assert height in (48, 64) and width == 60 * scale
            flipped = torch.tensor([[60 - 25.0, 5.0, 60 - 10.0, 30.0]])
            assert any(torch.allclose(target["boxes"], expected * scale) for expected in (boxes, flipped))
        if augment == "lsj":
            assert (height, width) == (56, 56)
        bright = out.max(0).values > 0.3
        for x1, y1, x2, y2 in target["boxes"].tolist():
            assert 0 <= x1 < x2 <= width and 0 <= y1 < y2 <= height
            if min(x2 - x1, y2 - y1) < 6:  # too small to tell blurred edges from pixels
                continue
            assert bright[round(y1) + 1: round(y2) - 1, round(x1) + 1: round(x2) - 1].float().mean() > 0.9
            bright[max(round(y1) - 1, 0): round(y2) + 1, max(round(x1) - 1, 0): round(x2) + 1] = False
            assert bright.float().mean() < 0.02
            checked += 1
    assert checked >= 10


def test_an_unknown_preset_names_data_augment_and_the_choices():
    with pytest.raises(ConfigError, match=r"^data\.augment=mosaic: .*use one of none \| hflip \| multiscale \| lsj \| ssd \| ssdlite$"):
        train_transforms("mosaic")
    assert AUGMENTS == ("none", "hflip", "multiscale", "lsj", "ssd", "ssdlite")


# --- a local COCO folder ------------------------------------------------------------------------------

CATEGORIES = [{"id": 7, "name": "dog"}, {"id": 3, "name": "cat"}]  # out of order, with gaps


def write_coco(root, split: str, images: dict[int, tuple[int, int]], annotations: list[dict], categories=CATEGORIES):
    """root/annotations/instances_<split>2017.json and root/<split>2017/<id>.png, images of (width, height)."""
    (root / f"{split}2017").mkdir(parents=True, exist_ok=True)
    (root / "annotations").mkdir(exist_ok=True)
    for image_id, (width, height) in images.items():
        pixels = np.full((height, width, 3), 10 * image_id, dtype=np.uint8)
        Image.fromarray(pixels).save(root / f"{split}2017" / f"{image_id:012d}.png")
    coco = {"images": [{"id": image_id, "file_name": f"{image_id:012d}.png", "width": width, "height": height}
                       for image_id, (width, height) in images.items()],
            "annotations": [{"area": a["bbox"][2] * a["bbox"][3], "iscrowd": 0, **a} for a in annotations],
            "categories": categories}
    path = root / "annotations" / f"instances_{split}2017.json"
    path.write_text(json.dumps(coco))
    return path


def write_small_coco(root):
    write_coco(root, "train", {4: (40, 30), 2: (30, 50)}, [
        {"id": 1, "image_id": 4, "category_id": 7, "bbox": [5, 5, 10, 10]},
        {"id": 2, "image_id": 2, "category_id": 3, "bbox": [0, 10, 30, 20]}])
    return write_coco(root, "val", {11: (32, 24), 12: (20, 20), 13: (24, 32)}, [
        {"id": 21, "image_id": 11, "category_id": 3, "bbox": [2, 3, 10, 8]},
        {"id": 22, "image_id": 11, "category_id": 7, "bbox": [14, 4, 16, 18.5]},  # x + w = 30 in 32
        {"id": 23, "image_id": 11, "category_id": 7, "bbox": [0, 0, 32, 12], "iscrowd": 1},
        {"id": 24, "image_id": 13, "category_id": 3, "bbox": [1, 2, 23.5, 30.5]}])  # 12: no annotations


def test_a_coco_folder_loads_with_contiguous_labels_and_crowd_in_the_ground_truth_only(tmp_path):
    write_small_coco(tmp_path)
    splits = build_coco(root=str(tmp_path), augment="none")
    assert (splits.num_classes, splits.in_channels, splits.class_names) == (3, 3, ["background", "cat", "dog"])
    val = splits.val
    assert val.category_ids == [3, 7] and val.sample_ids == [11, 12, 13] and splits.train.sample_ids == [2, 4]
    assert val.aspect_ratios == [32 / 24, 1.0, 24 / 32]
    image, target = val[0]
    assert image.shape == (3, 24, 32) and image.dtype == torch.float32
    assert torch.allclose(image, torch.full_like(image, 110 / 255))
    assert target["image_id"] == 11 and target["labels"].tolist() == [1, 2]  # cat (id 3) -> 1, dog (id 7) -> 2; no crowd
    assert target["boxes"].tolist() == [[2, 3, 12, 11], [14, 4, 30, 22.5]]
    assert val[2][1]["boxes"].tolist() == [[1, 2, 24, 32]]  # 24.5 x 32.5 in a 24 x 32 image: within the tolerance, clipped
    empty = val[1][1]
    assert empty["image_id"] == 12 and empty["boxes"].shape == (0, 4) and empty["labels"].shape == (0,)
    ground_truth = val.coco_ground_truth()
    crowd = [a for a in ground_truth["annotations"] if a["iscrowd"]]
    assert [(a["id"], a["image_id"], a["category_id"], a["bbox"]) for a in crowd] == [(23, 11, 7, [0, 0, 32, 12])]
    assert {(i["id"], i["width"], i["height"]) for i in ground_truth["images"]} == {(11, 32, 24), (12, 20, 20), (13, 24, 32)}
    assert {c["id"]: c["name"] for c in ground_truth["categories"]} == {3: "cat", 7: "dog"}
    assert {a["id"] for a in ground_truth["annotations"]} == {21, 22, 23, 24} and val.coco_ground_truth() is ground_truth
    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO()
        coco.dataset = ground_truth
        coco.createIndex()
    assert coco.getAnnIds(imgIds=[11], iscrowd=None) == [21, 22, 23]
    images, targets = val.collate_fn([val[0], val[2]])
    assert isinstance(images, SampleList) and [t["image_id"] for t in targets] == [11, 13]


def test_explicit_paths_override_the_root(tmp_path):
    write_small_coco(tmp_path / "coco")
    other = tmp_path / "elsewhere"
    write_coco(other, "val", {5: (16, 16)}, [{"id": 1, "image_id": 5, "category_id": 3, "bbox": [1, 1, 4, 4]}])
    splits = build_coco(root=str(tmp_path / "coco"), val_annotations=str(other / "annotations" / "instances_val2017.json"),
                        val_images=str(other / "val2017"))
    assert splits.val.sample_ids == [5] and splits.train.sample_ids == [2, 4]
    alone = build_coco(train_annotations=str(other / "annotations" / "instances_val2017.json"), train_images=str(other / "val2017"),
                       val_annotations=str(other / "annotations" / "instances_val2017.json"), val_images=str(other / "val2017"))
    assert alone.train.sample_ids == alone.val.sample_ids == [5]


def bad_inputs(root):
    """(what to change, the options that build_coco is called with, the key its error names)."""
    val = root / "annotations" / "instances_val2017.json"
    yield "nothing set", {}, "data.train_annotations: not set"
    yield "no root", {"root": str(root / "nowhere")}, "data.root="
    yield "no file", {"root": str(root), "val_annotations": str(root / "missing.json")}, f"data.val_annotations={root / 'missing.json'}"
    yield "no folder", {"root": str(root), "val_images": str(root / "nowhere")}, f"data.val_images={root / 'nowhere'}"
    for problem, content in (("not json", "{images"), ("not an object", "[]"),
                             ("no lists", json.dumps({"images": [], "annotations": {}, "categories": []}))):
        yield problem, {"root": str(root), "val_annotations": str(_write(root / f"{problem}.json", content))}, "data.val_annotations="
    coco = json.loads(val.read_text())
    for problem, change, needle in (
            ("no bbox", lambda c: c["annotations"][0].pop("bbox"), "annotations[0] has no bbox"),
            ("no image_id", lambda c: c["annotations"][0].pop("image_id"), "annotations[0] has no image_id"),
            ("unknown image", lambda c: c["annotations"][0].update(image_id=99), "annotation 21 is of image_id 99"),
            ("unknown category", lambda c: c["annotations"][0].update(category_id=5), "annotation 21 is of category_id 5"),
            ("box outside", lambda c: c["annotations"][1].update(bbox=[14, 4, 19.5, 18]), "annotation 22's bbox"),
            ("negative x", lambda c: c["annotations"][1].update(bbox=[-2, 4, 10, 10]), "annotation 22's bbox"),
            ("other categories", lambda c: c["categories"].append({"id": 9, "name": "bird"}), "its categories differ")):
        changed = json.loads(json.dumps(coco))
        change(changed)
        path = _write(root / f"{problem}.json", json.dumps(changed))
        yield problem, {"root": str(root), "val_annotations": str(path)}, f"data.val_annotations={path}: {needle}"
    coco["images"].append({"id": 14, "file_name": "gone.png", "width": 4, "height": 4})
    path = _write(root / "missing image.json", json.dumps(coco))  # the folder is root's: its key is data.root
    yield "missing image", {"root": str(root), "val_annotations": str(path)}, f"data.root={root}: val2017: 1 image(s)"


def _write(path, text: str):
    path.write_text(text)
    return path


def test_each_bad_coco_input_is_one_line_naming_its_key_and_a_fix(tmp_path):
    write_small_coco(tmp_path)
    problems = list(bad_inputs(tmp_path))
    assert len(problems) == 15
    for problem, options, needle in problems:
        with pytest.raises(ConfigError) as error:
            build_coco(**options)
        message = str(error.value)
        assert message.startswith(needle.split(": ")[0]) and needle in message, (problem, message)
        assert "\n" not in message and any(fix in message for fix in ("; set", "; point", "; fix", "; add", "need")), (problem, message)
    (tmp_path / "val2017" / "000000000011.png").unlink()
    Image.new("RGB", (8, 8)).save(tmp_path / "val2017" / "000000000011.png")
    with pytest.raises(ConfigError, match=r"^data\.root=.*val2017: 000000000011\.png is 8x8, its annotation file says 32x24"):
        build_coco(root=str(tmp_path)).val[0]
