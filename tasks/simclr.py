"""Self-supervised contrastive pretraining, SimCLR (Chen et al. 2020): two augmented views of each
image (data.views=2) through the backbone and a projection head, and NT-Xent, the normalised
temperature-scaled cross-entropy that pulls the two views of an image together and pushes them from
every other view in the batch, the negatives.

The negatives are the global batch's: every rank all-gathers the projections with their gradient
(torch.distributed.nn.functional.all_gather; torch.distributed.all_gather has none), and computes the
mean loss over its own anchors against every rank's candidates. The gather's backward sums each
rank's gradient into the ranks whose projections it used, and DDP averages over the ranks, so the
update is the gradient of the mean over all anchors: N ranks x B train exactly as 1 process x NB
(every rank's batch holds the same number of samples: the training sampler pads the ranks' shares to
equal length). task.global_negatives=false keeps each rank's own batch, the ablation. Under
DataParallel the model's outputs are gathered on one device anyway, so one process holds them all.

An online linear probe, trained with cross-entropy on the detached features (as solo-learn and the
BYOL paper do), follows how linearly separable the features are while they train without changing
them: val_accuracy is the probe's, computed as task=classification computes it (exact at any world
size), and it is the objective by default.

SimCLRModel is what the run trains, checkpoints, exports and evaluates: the model= config's model as
`backbone` (its classifier replaced by the identity), `projector` and `probe`. Its backbone fine-tunes
with task=classification model.weights_path=<checkpoint> (models/weights.py loads backbone.*)."""

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch import nn
from torch.nn import functional as F

from ddp.config.schema import ConfigError
from ddp.loading.batches import images_and_labels
from models.weights import find_classifier
from tasks import Task
from tasks.classification import ClassificationTask


def nt_xent(projections: torch.Tensor, temperature: float, global_negatives: bool = True) -> torch.Tensor:
    """NT-Xent of a batch of view pairs: `projections` is 2B x D, rows i and i + B the two views of one
    sample. Each row is an anchor whose positive is its pair, and whose negatives are every other view:
    of this batch, or with `global_negatives` and a process group, of every rank's batch (all-gathered
    with their gradient; every rank's batch must be as large). Returns the mean over this batch's 2B
    anchors, computed in float32 whatever the autocast precision (exp of cosines / temperature)."""
    with torch.autocast(projections.device.type, enabled=False):
        anchors = F.normalize(projections.float(), dim=1)
        candidates, offset = anchors, 0
        if global_negatives and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            candidates = torch.cat(dist_nn.all_gather(anchors))  # rank r's rows at r * 2B
            offset = dist.get_rank() * len(anchors)
        similarities = anchors @ candidates.T / temperature  # 2B x (world_size x 2B)
        rows = torch.arange(len(anchors), device=anchors.device)
        itself = torch.zeros_like(similarities, dtype=torch.bool)
        itself[rows, rows + offset] = True
        positives = (rows + len(anchors) // 2) % len(anchors) + offset
        return F.cross_entropy(similarities.masked_fill(itself, float("-inf")), positives)


class SimCLRModel(nn.Module):
    """The backbone's features (its classifier replaced by the identity), a projection head (SimCLR's
    MLP: Linear, ReLU, Linear to projection_dim) and a linear probe on the detached features. One
    forward computes both: {"projection": B x projection_dim, "logits": B x num_classes}. Its
    state_dict keys are backbone.*, projector.* and probe.*."""

    def __init__(self, backbone: nn.Module, features: int, num_classes: int, projection_dim: int):
        super().__init__()
        self.backbone = backbone
        self.projector = nn.Sequential(nn.Linear(features, features), nn.ReLU(inplace=True), nn.Linear(features, projection_dim))
        # standardised features (BatchNorm without affine, a linear map at eval, as MAE's linear probe): the
        # backbone's pooled features vary little around their mean, and a bare Linear on them learns slowly
        self.probe = nn.Sequential(nn.BatchNorm1d(features, affine=False), nn.Linear(features, num_classes))

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        features = self.backbone(images)
        return {"projection": self.projector(features), "logits": self.probe(features.detach())}


class SimCLRTask(Task):
    """NT-Xent over the projections of both views, plus the probe's cross-entropy on both views'
    detached features. Logged: train/loss (their sum), train/contrastive_loss, train/probe_loss.
    MixUp, CutMix and label smoothing are refused: the contrastive loss has no labels to mix, and the
    probe measures the features against the plain labels."""

    views = 2

    def __init__(self, num_classes: int, class_names: list[str] | None = None, *, temperature: float = 0.5,
                 projection_dim: int = 128, global_negatives: bool = True, label_smoothing: float = 0.0,
                 mixup_alpha: float = 0.0, cutmix_alpha: float = 0.0):
        for key, value in (("trainer.label_smoothing", label_smoothing), ("data.mixup_alpha", mixup_alpha),
                           ("data.cutmix_alpha", cutmix_alpha)):
            if value != 0:
                raise ConfigError(f"{key}={value}: task=simclr learns from pairs of views, with nothing to mix or smooth; "
                                  f"set {key}=0")
        if temperature <= 0:
            raise ConfigError(f"task.temperature={temperature}: must be > 0 (SimCLR uses 0.1 to 1; 0.5 by default)")
        if projection_dim <= 0:
            raise ConfigError(f"task.projection_dim={projection_dim}: must be > 0 (the projection head's output size, 128 by default)")
        self.num_classes, self.class_names = num_classes, class_names
        self.temperature, self.projection_dim, self.global_negatives = temperature, projection_dim, global_negatives
        self.probe_task = ClassificationTask(num_classes, class_names=class_names)  # the probe's eval sums and metrics

    def with_heads(self, backbone: nn.Module) -> SimCLRModel:
        found = find_classifier(backbone, self.num_classes)
        if found is None:
            raise ConfigError(f"task=simclr: the model ({type(backbone).__name__}) has no nn.Linear classifier with "
                              f"{self.num_classes} outputs to take its features from; use a classification model "
                              "(model=small_cnn, resnet18, torchvision or timm)")
        name, classifier = found
        parent, _, attribute = name.rpartition(".")
        setattr(backbone.get_submodule(parent), attribute, nn.Identity())  # the backbone's output: its features
        return SimCLRModel(backbone, classifier.in_features, self.num_classes, self.projection_dim)

    def training_step(self, model: nn.Module, batch) -> dict[str, torch.Tensor]:
        """One forward over both views at once: BatchNorm (SyncBN) normalises over every view, as SimCLR
        does, and FSDP gathers each block once per micro-batch."""
        (view_1, view_2), labels = images_and_labels(batch)
        output = model(torch.cat([view_1, view_2]))
        contrastive = nt_xent(output["projection"], self.temperature, self.global_negatives)
        probe = F.cross_entropy(output["logits"], torch.cat([labels, labels]))
        return {"loss": contrastive + probe, "contrastive_loss": contrastive, "probe_loss": probe}

    def eval_step(self, model: nn.Module, batch) -> torch.Tensor:
        images, labels = images_and_labels(batch)
        return self.probe_task.eval_sums(model(images)["logits"], labels)

    def metrics(self, sums: torch.Tensor) -> dict[str, float]:
        return self.probe_task.metrics(sums)
