"""Object detection (task=detection): a torchvision detector's summed losses, and the COCO metrics of
its predictions, computed by pycocotools (the reference every published number uses).

Training: the detector takes the batch's images (a list, any sizes) and targets (a dict per image:
`boxes` XYXY, `labels`) and returns its named losses (Faster R-CNN: loss_classifier, loss_box_reg,
loss_objectness, loss_rpn_box_reg; RetinaNet: classification, bbox_regression; FCOS adds bbox_ctrness).
Their sum trains; each is logged as train/<name>.

Evaluation can't be sums that add up across ranks: COCO's AP ranks every detection of the split by
score. So this task gathers (Task.gathers_predictions): each val batch gives one record per image (its
image id and its detections), evaluate() gathers the records of every rank to rank 0, checks that each
val image is there exactly once, and this task scores them there, once; every rank gets the metrics.
The ground truth is the val dataset's own (`coco_ground_truth()`: crowd regions included, which
pycocotools ignores as it does for COCO), so the metrics are those of pycocotools on the whole split,
at any world size and batch size."""

import contextlib
import io
import math

import torch
from torchvision.utils import draw_bounding_boxes, make_grid

from ddp.config.schema import ConfigError
from ddp.distributed.dtensor import is_sharded
from models.detection import seed_samplers
from tasks import Task, is_detector

# pycocotools' COCOeval.stats, in its order, by the names results.json and TensorBoard give them
COCO_STATS = ("map", "map50", "map75", "map_small", "map_medium", "map_large", "mar_1", "mar_10", "mar_100",
              "mar_small", "mar_medium", "mar_large")


def prediction_records(outputs: list[dict], targets: list[dict]) -> list[dict]:
    """One picklable record per image: its `id` (the COCO image id) and its detections on the CPU."""
    return [{"id": int(target["image_id"]), "boxes": output["boxes"].detach().float().cpu(),
             "scores": output["scores"].detach().float().cpu(), "labels": output["labels"].detach().cpu()}
            for output, target in zip(outputs, targets)]


def coco_results(records: list[dict], category_ids: list[int]) -> list[dict]:
    """The records' detections in COCO's result format: bbox [x, y, width, height], the category's COCO id."""
    results = []
    for record in records:
        boxes = record["boxes"].clone()
        boxes[:, 2:] -= boxes[:, :2]
        for box, score, label in zip(boxes.tolist(), record["scores"].tolist(), record["labels"].tolist()):
            results.append({"image_id": record["id"], "category_id": category_ids[label - 1], "bbox": box, "score": score})
    return results


def coco_metrics(ground_truth: dict, records: list[dict], category_ids: list[int]) -> dict[str, float]:
    """pycocotools' bbox evaluation of the records' images (those only: a limited validation scores what
    it evaluated) against `ground_truth`, a COCO-format dict. A statistic with no ground truth to rank
    (say, no small boxes), which pycocotools reports as -1, is NaN here: not a score of 0 or below."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints its progress and its table
        truth = COCO()
        truth.dataset = ground_truth
        truth.createIndex()
        results = coco_results(records, category_ids)
        if results:
            detected = truth.loadRes(results)
        else:  # loadRes can't take an empty list
            detected = COCO()
            detected.dataset = {"images": ground_truth["images"], "categories": ground_truth["categories"], "annotations": []}
            detected.createIndex()
        evaluation = COCOeval(truth, detected, "bbox")
        evaluation.params.imgIds = sorted(record["id"] for record in records)
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    return {name: (math.nan if value < 0 else float(value)) for name, value in zip(COCO_STATS, evaluation.stats)}


def drawn(pixels: torch.Tensor, boxes: torch.Tensor, labels: list[str] | None, colour: str) -> torch.Tensor:
    """`pixels` (uint8 3 x H x W) with `boxes` drawn on (none: the image as it is)."""
    return draw_bounding_boxes(pixels, boxes.cpu(), labels=labels, colors=colour, width=1) if len(boxes) else pixels


def detection_batch(batch) -> tuple[list, list[dict]]:
    """A batch's images and their target dicts; a one-line error for a batch of another task's data."""
    images, targets = batch
    if not (isinstance(targets, list) and all(isinstance(target, dict) and "boxes" in target for target in targets)):
        raise ConfigError("data: task=detection needs samples of (image, {boxes, labels, image_id}), and this data's "
                          "aren't; use a detection dataset (data=detection_shapes, data=coco)")
    return images, targets


class DetectionTask(Task):
    """The detector's summed losses; COCO metrics of the gathered predictions (val_map first). No batch
    transforms: MixUp, CutMix and label smoothing are refused."""

    gathers_predictions = True

    def __init__(self, num_classes: int, class_names: list[str] | None = None, *, label_smoothing: float = 0.0,
                 mixup_alpha: float = 0.0, cutmix_alpha: float = 0.0, num_images_logged: int = 4, score_threshold_logged: float = 0.3):
        for key, value in (("trainer.label_smoothing", label_smoothing), ("data.mixup_alpha", mixup_alpha),
                           ("data.cutmix_alpha", cutmix_alpha)):
            if value != 0:
                raise ConfigError(f"{key}={value}: task=detection trains on boxes, which can't be mixed or smoothed; set {key}=0")
        if num_images_logged < 0:
            raise ConfigError(f"task.num_images_logged={num_images_logged}: must be >= 0 (0: no images)")
        if not 0 <= score_threshold_logged <= 1:
            raise ConfigError(f"task.score_threshold_logged={score_threshold_logged}: a score, between 0 and 1")
        try:
            import pycocotools  # noqa: F401 (the metrics' evaluator: its absence is a line now, not a traceback at the first validation)
        except ImportError:
            raise ConfigError("task=detection: pycocotools is not installed, and it computes the COCO metrics; "
                              "pip install pycocotools==2.0.11 (make install does)") from None
        self.num_classes, self.class_names = num_classes, class_names
        self.num_images_logged, self.score_threshold_logged = num_images_logged, score_threshold_logged

    def with_heads(self, backbone):
        if not is_detector(backbone):
            raise ConfigError(f"model: task=detection trains a detector, and {type(backbone).__name__} is none; "
                              "set model=detection (model.name: any torchvision detector, or small_fcos)")
        return backbone

    def training_step(self, model, batch) -> dict[str, torch.Tensor]:
        images, targets = detection_batch(batch)
        seeds = [target.get("seed") for target in targets]  # Faster R-CNN's samplers draw per image from these
        seed_samplers(model, None if None in seeds else seeds, images[0].device)
        losses = model(list(images), [{"boxes": target["boxes"], "labels": target["labels"]} for target in targets])
        return {"loss": sum(losses.values()), **losses}

    def eval_step(self, model, batch) -> tuple[torch.Tensor, list[dict]]:
        """(sums: the batch's image count, records: one per image, prediction_records)."""
        images, targets = detection_batch(batch)
        outputs = model(list(images))
        device = outputs[0]["boxes"].device if outputs else torch.device("cpu")
        return torch.tensor([float(len(images))], dtype=torch.float64, device=device), prediction_records(outputs, targets)

    def metrics(self, sums: torch.Tensor, records: list[dict] | None = None, dataset=None) -> dict[str, float]:
        """COCO's metrics of the records against the dataset's ground truth; `loss` is NaN (a detector
        computes no loss in eval mode), `samples` the images scored."""
        metrics = coco_metrics(dataset.coco_ground_truth(), records, dataset.category_ids)
        return {"loss": math.nan, **metrics, "samples": int(sums[0].item())}

    @torch.no_grad()
    def log_validation(self, writer, model, dataset, device: torch.device, step: int) -> None:
        """`val/images`: the first num_images_logged val images (the same ones at every validation), each with
        its ground-truth boxes (green) beside its detections scoring at least task.score_threshold_logged
        (red, labelled with the class and score). Each image goes through the model alone, as at batch 1."""
        count = min(self.num_images_logged, len(dataset))
        if count == 0 or not (writer.active or is_sharded(model)):
            return
        with torch.random.fork_rng(devices=[]):  # loading a sample must not move the training run's RNG
            samples = [dataset[index] for index in range(count)]
        names = self.class_names or [str(label) for label in range(self.num_classes)]
        panels = []
        for image, target in samples:
            output = model([image.to(device)])[0]
            keep = output["scores"] >= self.score_threshold_logged
            pixels = (image.clamp(0, 1) * 255).round().to(torch.uint8).cpu()
            labels = [f"{names[label]} {score:.2f}" for label, score in zip(output["labels"][keep].tolist(), output["scores"][keep].tolist())]
            panels += [drawn(pixels, target["boxes"], None, "lime"), drawn(pixels, output["boxes"][keep], labels, "red")]
        if not writer.active:
            return
        height, width = max(panel.shape[1] for panel in panels), max(panel.shape[2] for panel in panels)
        panels = [torch.nn.functional.pad(panel, (0, width - panel.shape[2], 0, height - panel.shape[1])).float() / 255 for panel in panels]
        writer.add_image("val/images", make_grid(panels, nrow=2, padding=2, pad_value=0.5), step)
