"""Semantic segmentation: the loss, the evaluation sums and metrics, the joint transforms and the
padding collate, the shapes and VOC-layout datasets, the models and their weights. Pure functions and
one process: the properties the distributed runs rely on (sums that add up over any split, padding
that counts for nothing, one draw for image and mask) are checked here directly."""

import io
import math
import time

import numpy as np
import pytest
import torch
import torchvision
from omegaconf import OmegaConf
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.nn import functional as F
from torch.utils.data import DataLoader

from data.segmentation_transforms import IGNORE_INDEX, eval_transforms, pad_collate, train_transforms
from data.shapes import build_shapes
from data.voc import build_voc
from conftest import REPO
from ddp.config.checks import validate
from ddp.config.schema import ConfigError
from ddp.distributed.env import DistEnv
from ddp.reporting.rank_zero import RankZeroWriter
from models import build_model
from models.segmentation import TORCHVISION_NAMES, build_segmentation_model, small_segnet
from tasks import build_task
from tasks.segmentation import PALETTE, SegmentationTask, confusion_sums, segmentation_loss, segmentation_metrics
from workers.host_reads import HostReads


# --- loss, sums, metrics ------------------------------------------------------------------------

def test_loss_is_cross_entropy_over_counted_pixels_plus_half_the_aux():
    # Two classes; logits (0, ln 3): p(class 1) = 3/4, so CE is ln 4 for target 0 and ln 4/3 for target 1.
    out = torch.zeros(1, 2, 2, 2)
    out[:, 1] = math.log(3)
    aux = torch.zeros(1, 2, 2, 2)  # CE ln 2 at every pixel
    target = torch.tensor([[[0, 1], [IGNORE_INDEX, 1]]])
    main = (math.log(4) + 2 * math.log(4 / 3)) / 3  # the mean over the 3 counted pixels
    assert segmentation_loss({"out": out, "aux": aux}, target).item() == pytest.approx(main + 0.5 * math.log(2))
    assert segmentation_loss({"out": out, "aux": aux}, target, aux_weight=0.25).item() == pytest.approx(main + 0.25 * math.log(2))
    assert segmentation_loss({"out": out}, target).item() == pytest.approx(main)  # lraspp: no aux head
    assert segmentation_loss(out, target).item() == pytest.approx(main)


def test_a_batch_without_counted_pixels_has_loss_zero_and_a_backward_through_every_logit():
    """All masks ignore_index: no NaN (a mean over no pixel) for the non-finite guard to take for
    divergence, but 0, with zero gradients for `out` and `aux` alike, so DDP's reducer still gets every
    parameter's gradient. Any other batch: F.cross_entropy's mean, bit for bit, forward and backward."""
    generator = torch.Generator().manual_seed(0)
    for blank in (True, False):
        out = torch.randn(2, 3, 4, 5, generator=generator, requires_grad=True)
        aux = torch.randn(2, 3, 4, 5, generator=generator, requires_grad=True)
        target = torch.randint(3, (2, 4, 5), generator=generator)
        target[:, 0] = IGNORE_INDEX
        if blank:
            target[:] = IGNORE_INDEX
        loss = segmentation_loss({"out": out, "aux": aux}, target)
        loss.backward()
        if blank:
            assert loss.item() == 0.0
            assert torch.equal(out.grad, torch.zeros_like(out)) and torch.equal(aux.grad, torch.zeros_like(aux))
            continue
        reference = [tensor.detach().requires_grad_() for tensor in (out, aux)]
        expected = F.cross_entropy(reference[0], target, ignore_index=IGNORE_INDEX) + 0.5 * F.cross_entropy(
            reference[1], target, ignore_index=IGNORE_INDEX)
        expected.backward()
        assert torch.equal(loss, expected)
        assert torch.equal(out.grad, reference[0].grad) and torch.equal(aux.grad, reference[1].grad)


def _one_hot_logits(pred: torch.Tensor, num_classes: int) -> torch.Tensor:
    return 3.0 * F.one_hot(pred, num_classes).permute(0, 3, 1, 2).float()


def test_confusion_sums_and_metrics_by_hand():
    # Two 1x3 images. Counted (target, pred) pairs: (0,0) (0,1) (1,1) (1,1) (2,0); (255,2) is ignored.
    target = torch.tensor([[[0, 0, 1]], [[1, 2, IGNORE_INDEX]]])
    pred = torch.tensor([[[0, 1, 1]], [[1, 0, 2]]])
    sums = confusion_sums({"out": _one_hot_logits(pred, 4), "aux": None}, target, num_classes=4)
    assert sums.dtype == torch.float64 and sums.shape == (2 + 16,)
    expected_confusion = torch.tensor([[1, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.float64)
    assert torch.equal(sums[2:].reshape(4, 4), expected_confusion)
    assert sums[1].item() == 2  # images
    # Logit 3 on the predicted class of 4: CE log(e^3 + 3) - 3 where right (3 pixels), log(e^3 + 3) where wrong (2).
    assert sums[0].item() == pytest.approx(5 * math.log(math.exp(3) + 3) - 3 * 3)

    metrics = segmentation_metrics(sums, ["bg", "a", "b", "never"])
    # IoU = diag / (row + col - diag): bg 1/(2+2-1), a 2/(2+3-2), b 0/(1+0-0); `never` occurs nowhere.
    assert metrics["iou/bg"] == pytest.approx(1 / 3)
    assert metrics["iou/a"] == pytest.approx(2 / 3)
    assert metrics["iou/b"] == 0.0
    assert math.isnan(metrics["iou/never"])
    assert metrics["miou"] == pytest.approx(1 / 3)  # (1/3 + 2/3 + 0) / 3: the absent class is left out
    assert metrics["pixel_accuracy"] == pytest.approx(3 / 5)
    assert metrics["loss"] == pytest.approx(sums[0].item() / 5)  # per counted pixel
    assert metrics["samples"] == 2
    assert set(segmentation_metrics(sums)) == {"loss", "pixel_accuracy", "miou", "samples", "iou/0", "iou/1", "iou/2", "iou/3"}


def test_sums_of_any_split_add_up_to_the_sums_of_the_whole():
    """What exact evaluation at any world size relies on: the data split over ranks and batches in any
    way, the summed per-batch sums equal the whole's; and the confusion part is the reference's bincount."""
    generator = torch.Generator().manual_seed(0)
    num_classes, count = 5, 12
    logits = torch.randn(count, num_classes, 6, 7, generator=generator, dtype=torch.float64)
    target = torch.randint(num_classes, (count, 6, 7), generator=generator)
    target[torch.rand(target.shape, generator=generator) < 0.2] = IGNORE_INDEX
    whole = confusion_sums(logits, target, num_classes)
    counted = target != IGNORE_INDEX
    reference = torch.bincount(num_classes * target[counted] + logits.argmax(1)[counted], minlength=num_classes ** 2)
    assert torch.equal(whole[2:], reference.double())
    for _ in range(5):
        order = torch.randperm(count, generator=generator)
        cuts = sorted(torch.randint(1, count, (3,), generator=generator).tolist())
        parts = [part for part in torch.tensor_split(order, cuts) if len(part)]
        summed = sum(confusion_sums({"out": logits[part]}, target[part], num_classes) for part in parts)
        assert torch.equal(summed[1:], whole[1:])  # counts: exact
        assert summed[0].item() == pytest.approx(whole[0].item(), rel=1e-12)  # float64 sums in another order
    assert segmentation_metrics(summed) == pytest.approx(segmentation_metrics(whole), rel=1e-12)


def test_loss_and_sums_read_nothing_back_to_the_host():
    """Per batch, on a GPU, a host read would make the CPU wait for the device at every eval step."""
    target = torch.randint(3, (2, 5, 5))
    target[0, 0] = IGNORE_INDEX
    output = {"out": torch.randn(2, 3, 5, 5), "aux": torch.randn(2, 3, 5, 5)}
    with HostReads() as reads:
        segmentation_loss(output, target)
        confusion_sums(output, target, num_classes=3)
    assert reads.events == []


# --- transforms and collate ------------------------------------------------------------------------

MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)


def _decode(image: torch.Tensor) -> torch.Tensor:
    """The class an encoded image's pixel shows (value 60 + 40 * class), IGNORE_INDEX where it is 0 (padding)."""
    value = ((image[0] * STD[0] + MEAN[0]) * 255).round()
    return torch.where(value < 30, IGNORE_INDEX, ((value - 60) / 40).round().long())


def _interior(mask: torch.Tensor, radius: int = 2) -> torch.Tensor:
    """Pixels whose (2 radius + 1)^2 neighbourhood holds one mask value: away from the image's blurred edges."""
    m = mask[None, None].double()
    size = 2 * radius + 1
    high = F.max_pool2d(m, size, 1, radius)
    low = -F.max_pool2d(-m, size, 1, radius)
    return (high == low)[0, 0]


def test_train_transform_moves_image_and_mask_alike_and_pads_masks_with_ignore():
    # An image whose pixel value encodes its class: after the joint transform, both must still agree.
    mask = torch.zeros(40, 48, dtype=torch.int64)
    mask[:, 30:] = 1  # asymmetric, so a flip of one but not the other shows
    mask[25:, 5:20] = 2
    image = (60 + 40 * mask).to(torch.uint8).expand(3, -1, -1).clone()
    transform = train_transforms(base_size=40, crop_size=48, mean=MEAN, std=STD)
    padded = flipped_or_moved = 0
    for seed in range(12):
        torch.manual_seed(seed)
        out_image, out_mask = transform(image, mask)
        assert out_image.dtype == torch.float32 and out_image.shape == (3, 48, 48)
        assert out_mask.dtype == torch.int64 and out_mask.shape == (48, 48)
        assert set(out_mask.unique().tolist()) <= {0, 1, 2, IGNORE_INDEX}  # nearest: class ids, never blends
        inside = _interior(out_mask)
        assert inside.float().mean() > 0.5
        assert torch.equal(_decode(out_image)[inside], out_mask[inside]), f"seed {seed}: image and mask moved apart"
        padded += int((out_mask == IGNORE_INDEX).any())
        flipped_or_moved += int(out_mask[0, 0] != 0)
    assert padded >= 3 and flipped_or_moved >= 3  # the draws did pad, and did flip or shift


def test_train_transform_draws_from_torch_global_rng():
    image, mask = torch.rand(3, 20, 20), torch.randint(3, (20, 20))
    transform = train_transforms(base_size=20, crop_size=16, mean=MEAN, std=STD)
    draws = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        draws.append(transform(image, mask))
    assert torch.equal(draws[0][0], draws[1][0]) and torch.equal(draws[0][1], draws[1][1])
    assert not torch.equal(draws[0][0], draws[2][0])


def test_eval_transform_resizes_the_shorter_side_with_nearest_masks():
    mask = torch.zeros(30, 45, dtype=torch.int64)
    mask[10:20, 15:30] = 7
    mask[0] = IGNORE_INDEX
    image = (60 + 40 * (mask == 7)).to(torch.uint8).expand(3, -1, -1).clone()
    out_image, out_mask = eval_transforms(base_size=20, mean=MEAN, std=STD)(image, mask)
    assert out_image.shape == (3, 20, 30) and out_mask.shape == (20, 30)
    assert set(out_mask.unique().tolist()) == {0, 7, IGNORE_INDEX}
    assert (out_mask == 7).sum() == pytest.approx((mask == 7).sum().item() * (20 / 30) ** 2, rel=0.15)


def test_pad_collate_pads_images_with_0_and_masks_with_ignore_so_padding_counts_for_nothing():
    generator = torch.Generator().manual_seed(0)
    items = [(torch.randn(3, h, w, generator=generator), torch.randint(4, (h, w), generator=generator))
             for h, w in ((9, 12), (14, 7), (11, 11))]
    images, masks = pad_collate(items)
    assert images.shape == (3, 3, 14, 12) and masks.shape == (3, 14, 12) and masks.dtype == torch.int64
    for index, (image, mask) in enumerate(items):
        h, w = mask.shape
        assert torch.equal(images[index, :, :h, :w], image) and torch.equal(masks[index, :h, :w], mask)
        assert (images[index, :, h:] == 0).all() and (images[index, :, :, w:] == 0).all()
        assert (masks[index, h:] == IGNORE_INDEX).all() and (masks[index, :, w:] == IGNORE_INDEX).all()
    # A per-pixel model: the padded batch's sums equal the sum of each image's own.
    model = torch.nn.Conv2d(3, 4, 1)
    with torch.no_grad():
        batched = confusion_sums(model(images), masks, 4)
        one_by_one = sum(confusion_sums(model(image[None]), mask[None], 4) for image, mask in items)
    assert torch.equal(batched[1:], one_by_one[1:])
    assert batched[0].item() == pytest.approx(one_by_one[0].item(), rel=1e-9)


# --- datasets ------------------------------------------------------------------------------------

def test_shapes_is_deterministic_per_index_and_trains_with_global_rng_draws():
    splits = build_shapes(num_samples=20, num_val_samples=8, image_size=24, num_classes=4, data_seed=3)
    assert (splits.num_classes, splits.in_channels, len(splits.train), len(splits.val)) == (4, 3, 20, 8)
    torch.manual_seed(0)
    first = splits.val[5]
    torch.manual_seed(1)
    again = build_shapes(20, 8, 24, 4, data_seed=3).val[5]
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])  # whatever the global RNG
    assert first[0].dtype == torch.float32 and first[0].shape == (3, 24, 24)
    assert first[1].dtype == torch.int64 and first[1].shape == (24, 24)
    other_seed = build_shapes(20, 8, 24, 4, data_seed=4).val[5]
    assert not torch.equal(first[1], other_seed[1])
    masks = torch.stack([splits.val[index][1] for index in range(8)])
    assert set(masks.unique().tolist()) == {0, 1, 2, 3}  # background and every shape
    assert not torch.equal(splits.val.draw(0)[1], splits.train.draw(0)[1])  # the splits are different images
    draws = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        draws.append(splits.train[2])
    assert torch.equal(draws[0][1], draws[1][1]) and not torch.equal(draws[0][0], draws[2][0])


def _write_voc(root, sizes: dict[str, tuple[int, int]], splits: dict[str, list[str]]) -> dict[str, np.ndarray]:
    palette = [0, 0, 0, 128, 0, 0, 0, 128, 0, 128, 128, 0] + [0] * (3 * 251) + [224, 224, 192]
    masks = {}
    for folder in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (root / folder).mkdir(parents=True)
    for index, (image_id, (height, width)) in enumerate(sizes.items()):
        values = np.zeros((height, width), dtype=np.uint8)
        values[height // 4: 3 * height // 4, width // 3:] = 1 + index % 3
        values[height // 4, :] = IGNORE_INDEX  # a VOC-style border
        png = Image.fromarray(values, mode="P")
        png.putpalette(palette)
        png.save(root / "SegmentationClass" / f"{image_id}.png")
        Image.fromarray(np.full((height, width, 3), 40 * index, dtype=np.uint8)).save(root / "JPEGImages" / f"{image_id}.jpg")
        masks[image_id] = values
    for split, ids in splits.items():
        (root / "ImageSets" / "Segmentation" / f"{split}.txt").write_text("".join(f"{i}\n" for i in ids))
    return masks


def test_voc_layout_reads_palette_masks_as_class_ids(tmp_path):
    sizes = {"a": (32, 40), "b": (36, 32), "c": (40, 48), "d": (32, 44), "e": (48, 32)}
    masks = _write_voc(tmp_path, sizes, {"train": ["a", "b", "c"], "val": ["d", "e"]})
    assert Image.open(tmp_path / "SegmentationClass" / "d.png").mode == "P"
    splits = build_voc(str(tmp_path), num_classes=4, base_size=32, crop_size=24)
    assert (len(splits.train), len(splits.val), splits.num_classes, splits.in_channels) == (3, 2, 4, 3)
    image, mask = splits.val[0]  # d: its shorter side is already base_size, so the mask is the PNG's values
    assert image.shape == (3, 32, 44) and mask.dtype == torch.int64
    assert torch.equal(mask, torch.from_numpy(masks["d"]).long())
    torch.manual_seed(0)
    for index in range(3):
        image, mask = splits.train[index]
        assert image.shape == (3, 24, 24) and set(mask.unique().tolist()) <= {0, 1, 2, 3, IGNORE_INDEX}
    images, batch_masks = next(iter(DataLoader(splits.val, batch_size=2, collate_fn=pad_collate)))
    assert images.shape == (2, 3, 48, 44) and batch_masks.shape == (2, 48, 44)  # d 32x44 and e 48x32, padded


def test_voc_layout_problems_are_one_line_errors_naming_data_root(tmp_path):
    with pytest.raises(ConfigError, match=r"^data.root=.*not a folder"):
        build_voc(str(tmp_path / "nowhere"))
    _write_voc(tmp_path, {"a": (8, 8)}, {"train": ["a"]})
    with pytest.raises(ConfigError, match=r"^data.root=.*no ImageSets/Segmentation/val.txt"):
        build_voc(str(tmp_path), num_classes=4)
    (tmp_path / "ImageSets" / "Segmentation" / "val.txt").write_text("a\nmissing\n")
    with pytest.raises(ConfigError, match=r"^data.root=.*JPEGImages/missing.jpg is missing"):
        build_voc(str(tmp_path), num_classes=4)


# --- models and weights ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", TORCHVISION_NAMES)
def test_torchvision_segmentation_models_return_out_and_aux_at_input_size(name):
    model = build_segmentation_model(num_classes=5, in_channels=3, name=name).eval()
    with torch.no_grad():
        output = model(torch.randn(2, 3, 64, 64))
    expected = {"out"} if name == "lraspp_mobilenet_v3_large" else {"out", "aux"}
    assert set(output) == expected
    assert all(value.shape == (2, 5, 64, 64) for value in output.values())
    if name != "lraspp_mobilenet_v3_large":
        no_aux = build_segmentation_model(num_classes=5, in_channels=3, name=name, aux_loss=False).eval()
        with torch.no_grad():
            assert set(no_aux(torch.randn(1, 3, 64, 64))) == {"out"}


def test_segmentation_model_names_and_channels():
    with pytest.raises(ConfigError, match=r"^model.name=deeplabv3_resnet18: .*deeplabv3_mobilenet_v3_large"):
        build_segmentation_model(num_classes=5, in_channels=3, name="deeplabv3_resnet18")
    model = build_segmentation_model(num_classes=5, in_channels=1, name="lraspp_mobilenet_v3_large").eval()
    with torch.no_grad():
        assert model(torch.randn(1, 1, 64, 64))["out"].shape == (1, 5, 64, 64)


def test_weights_path_loads_the_whole_model_or_the_backbone_only(tmp_path):
    source = small_segnet(num_classes=4, in_channels=3, width=8)
    for value in source.state_dict().values():
        if value.is_floating_point():  # so that no tensor equals a fresh model's (BatchNorm's ones and zeros)
            value.add_(torch.rand_like(value) + 0.5)
    torch.save(source.state_dict(), tmp_path / "whole.pt")
    cfg = {"_target_": "models.segmentation.small_segnet", "width": 8, "weights_path": str(tmp_path / "whole.pt")}
    whole = build_model(cfg, num_classes=4, in_channels=3)
    for key, value in source.state_dict().items():
        assert torch.equal(whole.state_dict()[key], value), key
    backbone_only = build_model({**cfg, "weights_scope": "backbone"}, num_classes=4, in_channels=3)
    for key, value in source.state_dict().items():
        if not key.endswith("num_batches_tracked"):  # 0 in both
            assert torch.equal(backbone_only.state_dict()[key], value) == key.startswith("backbone."), key
    with pytest.raises(ConfigError, match=r"^model.weights_scope=head: unknown, use one of model, backbone"):
        build_model({**cfg, "weights_scope": "head"}, num_classes=4, in_channels=3)


def test_backbone_weights_from_a_torchvision_classification_state_dict(tmp_path):
    classifier = torchvision.models.mobilenet_v3_large(weights=None)
    torch.save(classifier.state_dict(), tmp_path / "mobilenet.pth")  # features.*, classifier.*
    cfg = {"_target_": "models.segmentation.build_segmentation_model", "name": "deeplabv3_mobilenet_v3_large",
           "weights_path": str(tmp_path / "mobilenet.pth"), "weights_scope": "backbone"}
    model = build_model(cfg, num_classes=3, in_channels=3)
    for key, value in model.backbone.state_dict().items():
        assert torch.equal(value, classifier.state_dict()[f"features.{key}"]), key
    torch.save(small_segnet(3, 3, width=8).state_dict(), tmp_path / "other.pt")
    with pytest.raises(ConfigError, match=r"^model.weights_path=.*other.pt: does not fit this model's backbone"):
        build_model({**cfg, "weights_path": str(tmp_path / "other.pt")}, num_classes=3, in_channels=3)


def _evaluate(model, dataset) -> dict[str, float]:
    model.eval()
    sums = 0
    with torch.no_grad():
        for images, masks in DataLoader(dataset, batch_size=32, collate_fn=pad_collate):
            sums = sums + confusion_sums(model(images), masks, num_classes=4)
    return segmentation_metrics(sums, dataset.classes)


@pytest.fixture
def one_thread():
    """One intra-op thread, as a test process gets on two shared cores (two made each step ~30x slower there)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_small_segnet_learns_shapes_to_miou_above_half_in_seconds(one_thread):
    torch.manual_seed(0)
    splits = build_shapes(num_samples=256, num_val_samples=64, image_size=32, num_classes=4, data_seed=0)
    model = small_segnet(num_classes=4, in_channels=3, width=16)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    before = _evaluate(model, splits.val)["miou"]
    start = time.perf_counter()
    for _ in range(3):
        model.train()
        for images, masks in DataLoader(splits.train, batch_size=16, shuffle=True, collate_fn=pad_collate):
            loss = segmentation_loss(model(images), masks)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    metrics = _evaluate(model, splits.val)
    assert before < 0.3 and metrics["miou"] > 0.5, (before, metrics)
    assert time.perf_counter() - start < 20


# --- the task object (task=segmentation) -------------------------------------------------------------

def _segmentation_config(**settings):
    """The config with conf/task/segmentation.yaml; `settings`: label_smoothing, mixup_alpha or
    cutmix_alpha, set where users set them."""
    from hydra import compose, initialize_config_dir

    from ddp.config.schema import register_configs

    register_configs()
    where = {"label_smoothing": "trainer", "mixup_alpha": "data", "cutmix_alpha": "data", "direction": "task"}
    overrides = ["task=segmentation", "data=shapes", "model=small_segnet",
                 *(f"{where[key]}.{key}={value}" for key, value in settings.items())]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=overrides)


def _task_from_yaml(num_classes: int, class_names=None, **settings):
    """conf/task/segmentation.yaml composed with the rest of the config, and built as the recipe does."""
    return build_task(_segmentation_config(**settings).task, num_classes, class_names)


def test_task_members_are_the_segmentation_loss_sums_and_metrics():
    task = _task_from_yaml(3, ["bg", "disc", "box"])
    cfg = _segmentation_config()  # the objective and its direction are the run's keys, not the task object's
    assert (cfg.task.objective, cfg.task.direction, task.num_images_logged) == ("val_miou", "maximize", 4)
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(2, 3, 4, 5, generator=generator)
    output = {"out": torch.randn(2, 3, 4, 5, generator=generator), "aux": torch.randn(2, 3, 4, 5, generator=generator)}
    target = torch.randint(3, (2, 4, 5), generator=generator)
    target[0, 0] = IGNORE_INDEX
    same_images, same_target = task.train_batch(images, target)
    assert same_images is images and same_target is target  # no batch transforms
    assert task.loss(output, target).item() == pytest.approx(segmentation_loss(output, target, aux_weight=0.5).item())
    assert torch.equal(task.eval_sums(output, target), confusion_sums(output, target, num_classes=3))
    metrics = task.metrics(task.eval_sums(output, target) + task.eval_sums(output, target))
    assert set(metrics) == {"loss", "pixel_accuracy", "miou", "iou/bg", "iou/disc", "iou/box", "samples"}
    assert metrics["samples"] == 4
    assert metrics == segmentation_metrics(2 * confusion_sums(output, target, 3), ["bg", "disc", "box"])


@pytest.mark.parametrize("key", ["label_smoothing", "mixup_alpha", "cutmix_alpha"])
def test_batch_transforms_with_segmentation_are_one_line_errors_naming_the_key(key):
    user_key = {"label_smoothing": "trainer.label_smoothing"}.get(key, f"data.{key}")
    with pytest.raises(ConfigError) as error:
        _task_from_yaml(3, **{key: 0.2})
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"{user_key}=0.2: task=segmentation") and message.endswith(f"set {user_key}=0")


def test_task_settings_are_checked():
    with pytest.raises(ConfigError, match=r"^task.ignore_index=0: .*keep task.ignore_index=255$"):
        SegmentationTask(3, ignore_index=0)
    with pytest.raises(ConfigError, match=r"^task.direction=up: unknown, use one of maximize, minimize$"):
        validate(_segmentation_config(direction="up"), launched=False, world_size=1)
    with pytest.raises(ConfigError, match=r"^data: 2 class names for 3 classes$"):
        SegmentationTask(3, ["a", "b"])


def _image_tiles(events_dir, tag="val/images"):
    """(step, the grid as an H x W x 3 uint8 array) of every `tag` image TensorBoard's reader finds."""
    accumulator = EventAccumulator(str(events_dir), size_guidance={"images": 0})
    accumulator.Reload()
    return [(event.step, event.height, event.width,
             np.asarray(Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB")))
            for event in accumulator.Images(tag)]


def test_log_validation_writes_input_target_prediction_grid_that_tensorboard_reads(tmp_path):
    splits = build_shapes(num_samples=8, num_val_samples=6, image_size=20, num_classes=4, data_seed=0)
    task = SegmentationTask(4, splits.class_names, num_images_logged=4)
    model = small_segnet(4, 3, width=4).eval()
    rng_before = torch.get_rng_state()
    with RankZeroWriter(tmp_path, DistEnv(rank=0, world_size=2)) as writer:
        task.log_validation(writer, model, splits.val, torch.device("cpu"), step=7)
        task.log_validation(writer, model, splits.train, torch.device("cpu"), step=8)  # random transforms
    assert torch.equal(torch.get_rng_state(), rng_before)  # a resumed run's random draws stay in step

    (first, second) = _image_tiles(tmp_path)
    step, height, width, grid = first
    # make_grid: 3 columns (input, target, prediction) x 4 rows of 20 px tiles, 2 px between and around them
    assert (step, height, width, grid.shape) == (7, 4 * 22 + 2, 3 * 22 + 2, (90, 68, 3))
    assert second[0] == 8
    with torch.no_grad():
        for row in range(4):
            image, mask = splits.val[row]
            top = 2 + 22 * row
            target_tile = grid[top:top + 20, 24:44]
            expected = (PALETTE[mask] * 255).round().numpy()
            assert np.abs(target_tile.astype(float) - expected).max() <= 1, f"row {row}: the target isn't its mask's colours"
            prediction = model(image[None])["out"].argmax(1)[0]
            prediction_tile = grid[top:top + 20, 46:66]
            assert np.abs(prediction_tile.astype(float) - (PALETTE[prediction] * 255).round().numpy()).max() <= 1


def test_log_validation_shows_ignored_pixels_white_and_pads_images_of_different_sizes(tmp_path):
    sizes = {"a": (16, 24), "b": (24, 16), "c": (16, 16)}
    _write_voc(tmp_path / "voc", sizes, {"train": ["a"], "val": ["a", "b", "c"]})
    splits = build_voc(str(tmp_path / "voc"), num_classes=4, base_size=16, crop_size=16)
    task = SegmentationTask(4, splits.class_names, num_images_logged=5)  # more than the 3 val images
    with RankZeroWriter(tmp_path / "events", DistEnv()) as writer:
        task.log_validation(writer, small_segnet(4, 3, width=4).eval(), splits.val, torch.device("cpu"), step=1)
    ((_, height, width, grid),) = _image_tiles(tmp_path / "events")
    assert (height, width) == (3 * 26 + 2, 3 * 26 + 2)  # tiles padded to the largest, 24 x 24
    _, mask = splits.val[0]
    target_tile = grid[2:2 + 16, 28:28 + 24]
    assert (mask == IGNORE_INDEX).any()
    assert (target_tile[(mask == IGNORE_INDEX).numpy()] == 255).all()  # ignored: white
    assert not (target_tile[(mask != IGNORE_INDEX).numpy()] == 255).all(axis=-1).any()  # no class is white


def test_log_validation_does_nothing_off_rank_zero(tmp_path):
    def model(images):
        raise AssertionError("rank 1 ran the model for images it doesn't write")

    splits = build_shapes(num_samples=4, num_val_samples=4, image_size=16, num_classes=3, data_seed=0)
    with RankZeroWriter(tmp_path, DistEnv(rank=1, world_size=2)) as writer:
        assert not writer.active
        SegmentationTask(3).log_validation(writer, model, splits.val, torch.device("cpu"), step=1)
    assert list(tmp_path.iterdir()) == []


def test_datasets_name_their_classes_and_voc_collates_its_own_batches(tmp_path):
    assert build_shapes(4, 4, 16, 5, data_seed=0).class_names == ["background", "rectangle", "disc", "triangle", "rectangle1"]
    _write_voc(tmp_path, {"a": (8, 8), "b": (8, 10)}, {"train": ["a"], "val": ["a", "b"]})
    assert build_voc(str(tmp_path)).class_names[:3] == ["background", "aeroplane", "bicycle"]
    assert len(build_voc(str(tmp_path)).class_names) == 21
    splits = build_voc(str(tmp_path), num_classes=3, base_size=8)
    assert splits.class_names == ["class_0", "class_1", "class_2"]
    from ddp.loading.loaders import build_val_loader

    loader = build_val_loader(splits.val, OmegaConf.create({"batch_size": 2, "num_workers": 0}), DistEnv(), pin_memory=False)
    images, masks = next(iter(loader))  # 8 x 8 and 8 x 10: default_collate could not stack them
    assert images.shape == (2, 3, 8, 10) and masks.shape == (2, 8, 10)


def test_voc_evaluation_is_the_same_at_any_world_size_as_shipped(tmp_path):
    """data=voc's images differ in size; evaluated at data.val_batch_size=1 (its default) no image is
    padded, so each rank's shard (ddp/loading/samplers.py) sums to exactly the one-process evaluation."""
    from hydra import compose, initialize_config_dir

    from data import build_datasets
    from ddp.config.schema import register_configs
    from ddp.loading.loaders import build_val_loader

    register_configs()
    sizes = {f"{index}": (16 + 4 * (index % 3), 16 + 4 * (index % 2)) for index in range(7)}
    _write_voc(tmp_path, sizes, {"train": ["0"], "val": list(sizes)})
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["data=voc", f"data.root={tmp_path}", "data.num_classes=4", "data.base_size=16",
                                           "data.num_workers=0", "data.batch_size=4"])
    assert cfg.data.val_batch_size == 1
    splits = build_datasets(cfg.data)
    torch.manual_seed(0)
    model = small_segnet(4, 3, width=4).eval()
    task = SegmentationTask(4, splits.class_names)

    def evaluate(world_size):
        sums = 0
        for rank in range(world_size):
            for images, masks in build_val_loader(splits.val, cfg.data, DistEnv(rank=rank, world_size=world_size), False):
                with torch.no_grad():
                    sums = sums + task.eval_sums(model(images), masks)
        return sums

    one = evaluate(1)
    assert one[1].item() == 7
    for world_size in (2, 3):
        sums = evaluate(world_size)
        assert torch.equal(sums[1:], one[1:]), world_size  # images and every pixel's (target, prediction)
        assert sums[0].item() == pytest.approx(one[0].item(), rel=1e-12)  # float64 loss sums, in another order
