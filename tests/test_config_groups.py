"""Every config group option composes against its schema and builds what it names; the set of keys
is frozen; the schema rejects mistyped values when the config is composed."""

import inspect
import runpy
import subprocess
import sys
from typing import Literal

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ValidationError
from sklearn.datasets import load_digits

import ddp.config.schema as schema
from conftest import REPO, config_error_in_this_process, run_in_this_process, write_imagefolder
from data import build_datasets
from data.digits import build_digits
from data.shapes import build_shapes
from data.synthetic import build_synthetic
from data.hf import build_hf
from data.vision import build_cifar10, build_imagefolder
from data.webdataset import build_webdataset
from data.voc import build_voc
from data.coco import build_coco
from data.detection_shapes import build_detection_shapes
from models import build_model
from models.resnet import build_resnet18
from models.detection import build_detection_model
from models.segmentation import build_segmentation_model, small_segnet
from models.small_cnn import SmallCNN
from models.zoo import build_timm, build_torchvision
from ddp.config.builder_options import builder_options
from ddp.config.checks import validate
from ddp.config.schema import MULTI_PROCESS, ConfigError, register_configs
from ddp.jobs.run_dir import register_resolvers
from ddp.training.optimizer import optimizer_node
from tasks.classification import ClassificationTask
from tasks.segmentation import SegmentationTask
from tasks.distillation import DistillationTask
from tasks.simclr import SimCLRTask
from tasks.detection import DetectionTask

register_configs()
register_resolvers()

# Every option of every group, with its schema: a dataclass its yaml starts from, or for a model, a
# dataset or a task the builder its yaml names, whose signature is the schema of its options.
OPTIONS = {
    "strategy": {"single": schema.StrategyConfig, "dp": schema.StrategyConfig, "ddp": schema.StrategyConfig,
                 "fsdp": schema.FSDPStrategyConfig, "hsdp": schema.HSDPStrategyConfig},
    "model": {"small_cnn": SmallCNN, "resnet18": build_resnet18, "torchvision": build_torchvision, "timm": build_timm,
              "small_segnet": small_segnet, "segmentation": build_segmentation_model, "detection": build_detection_model},
    "data": {
        "digits": build_digits,
        "synthetic": build_synthetic,
        "imagefolder": build_imagefolder,
        "cifar10": build_cifar10,
        "shapes": build_shapes,
        "voc": build_voc,
        "detection_shapes": build_detection_shapes,
        "coco": build_coco,
        "hf": build_hf,
        "webdataset": build_webdataset,
    },
    "optim": {"sgd": schema.SGDConfig, "adam": schema.AdamConfig, "adamw": schema.AdamConfig},
    "scheduler": {"none": schema.SchedulerConfig, "cosine": schema.CosineSchedulerConfig, "step": schema.StepSchedulerConfig},
    "task": {"classification": ClassificationTask, "segmentation": SegmentationTask, "simclr": SimCLRTask,
             "distillation": DistillationTask, "detection": DetectionTask},
    "logger": {"tensorboard": schema.TensorBoardConfig, "mlflow": schema.MLflowConfig, "wandb": schema.WandbConfig},
}
ALL_OPTIONS = [(group, option) for group, options in OPTIONS.items() for option in options]

# `python train.py` with no overrides. Update this list deliberately when adding an option.
DEFAULT_KEYS = {
    "strategy.name", "strategy.timeout_s", "strategy.bucket_cap_mb", "strategy.find_unused_parameters",
    "strategy.nproc_per_node", "strategy.max_restarts", "strategy.block_types",
    "model._target_", "model.weights_path", "model.weights_scope", "model.channels", "model.dropout", "model.norm",
    "data._target_", "data.batch_size", "data.num_workers", "data.mixup_alpha", "data.cutmix_alpha", "data.split", "data.val_batch_size",
    "data.shuffle_window", "data.aspect_ratio_groups",
    "data.val_fraction", "data.split_seed", "data.views", "data.augment",
    "optim._target_", "optim.lr", "optim.lr_scaling", "optim.reference_batch_size", "optim.momentum", "optim.weight_decay",
    "optim.nesterov", "scheduler.name", "scheduler.warmup_steps", "scheduler.warmup_epochs",
    "task._target_", "task.objective", "task.direction", "task.label_smoothing", "task.mixup_alpha", "task.cutmix_alpha",
    "trainer.max_epochs", "trainer.max_steps", "trainer.accumulate_grad_batches", "trainer.global_batch_size",
    "trainer.gradient_clip_norm",
    "trainer.label_smoothing",
    "trainer.log_every_n_steps", "trainer.stop_deadline_s", "trainer.val_every_n_epochs",
    "trainer.limit_train_batches", "trainer.limit_val_batches", "trainer.warmup_steps",
    "trainer.objective", "trainer.early_stop_patience", "trainer.early_stop_min_delta",
    "checkpoint.every_n_steps", "checkpoint.keep_last", "checkpoint.keep_best", "checkpoint.best_of", "checkpoint.async_save",
    "fault.kill_rank", "fault.raise_rank", "fault.stall_rank", "fault.at_step", "fault.every_attempt",
    "fault.record_samples_dir", "fault.slow_rank", "fault.slow_ms", "fault.slow_val_ms", "fault.slow_save_step", "fault.slow_save_s", "fault.plan",
    "profiler.enabled", "profiler.wait", "profiler.warmup", "profiler.active", "profiler.table_rows",
    "profiler.memory_history", "profiler.memory_snapshot_step",
    "ema.decay", "devices", "backend", "syncbn", "deterministic", "precision", "channels_last", "keep_freed_host_memory", "compile",
    "compile_mode", "seed", "mode", "resume", "activation_checkpointing", "activation_checkpointing_every",
}

STRATEGY = {"name", "timeout_s", "bucket_cap_mb", "find_unused_parameters", "nproc_per_node", "max_restarts", "block_types"}
LOADING = {"_target_", "batch_size", "num_workers", "mixup_alpha", "cutmix_alpha", "split", "val_batch_size", "shuffle_window",
           "aspect_ratio_groups"}
# The keys each option adds to its group. Update this list deliberately when adding an option.
OPTION_KEYS = {
    ("strategy", "single"): STRATEGY,
    ("strategy", "dp"): STRATEGY,
    ("strategy", "ddp"): STRATEGY,
    ("strategy", "fsdp"): {*STRATEGY, "reshard_after_forward"},
    ("strategy", "hsdp"): {*STRATEGY, "reshard_after_forward", "shard_size"},
    ("model", "small_cnn"): {"_target_", "weights_path", "weights_scope", "channels", "dropout", "norm"},
    ("model", "resnet18"): {"_target_", "weights_path", "weights_scope", "small_input"},
    ("model", "torchvision"): {"_target_", "weights_path", "weights_scope", "name", "weights", "small_input", "kwargs"},
    ("model", "timm"): {"_target_", "weights_path", "weights_scope", "name", "drop_path_rate", "kwargs"},
    ("model", "small_segnet"): {"_target_", "weights_path", "weights_scope", "width", "aux_loss"},
    ("model", "segmentation"): {"_target_", "weights_path", "weights_scope", "name", "aux_loss"},
    ("model", "detection"): {"_target_", "weights_path", "weights_scope", "name", "min_size", "max_size", "frozen_batchnorm", "kwargs"},
    ("data", "digits"): {*LOADING, "val_fraction", "split_seed", "views", "augment"},
    ("data", "synthetic"): {
        *LOADING, "num_samples", "num_val_samples", "image_size", "num_classes", "channels", "data_seed", "augment", "views",
    },
    ("data", "imagefolder"): {*LOADING, "root", "image_size", "augment", "views", "random_erase", "interpolation",
                              "on_bad_sample"},
    ("data", "cifar10"): {*LOADING, "root", "download", "augment", "views", "random_erase", "interpolation"},
    ("data", "shapes"): {*LOADING, "num_samples", "num_val_samples", "image_size", "num_classes", "data_seed", "augment",
                         "max_shapes"},
    ("data", "voc"): {*LOADING, "root", "num_classes", "base_size", "crop_size", "class_names"},
    ("data", "detection_shapes"): {*LOADING, "num_samples", "num_val_samples", "image_size", "num_categories", "data_seed", "augment",
                                   "max_shapes", "empty_fraction", "crowd_fraction", "multiscale_sizes", "multiscale_max_size", "lsj_size"},
    ("data", "coco"): {*LOADING, "root", "train_annotations", "train_images", "val_annotations", "val_images", "augment",
                       "multiscale_sizes", "multiscale_max_size", "lsj_size"},
    ("data", "hf"): {*LOADING, "path", "image_column", "label_column", "train_split", "val_split", "image_size", "augment",
                     "views", "random_erase", "interpolation", "on_bad_sample"},
    ("data", "webdataset"): {*LOADING, "train_shards", "val_shards", "test_shards", "num_classes", "cache_dir", "cache_limit_gb",
                             "image_size", "augment",
                             "views", "random_erase", "interpolation", "on_bad_sample", "multiscale_sizes", "multiscale_max_size",
                             "lsj_size"},
    ("optim", "sgd"): {"_target_", "lr", "lr_scaling", "reference_batch_size", "momentum", "weight_decay", "nesterov"},
    ("optim", "adam"): {"_target_", "lr", "lr_scaling", "reference_batch_size", "weight_decay"},
    ("optim", "adamw"): {"_target_", "lr", "lr_scaling", "reference_batch_size", "weight_decay"},
    ("scheduler", "none"): {"name", "warmup_steps", "warmup_epochs"},
    ("scheduler", "cosine"): {"name", "warmup_steps", "warmup_epochs", "min_lr"},
    ("scheduler", "step"): {"name", "warmup_steps", "warmup_epochs", "milestones", "gamma"},
    ("task", "classification"): {"_target_", "objective", "direction", "label_smoothing", "mixup_alpha", "cutmix_alpha"},
    ("task", "detection"): {"_target_", "objective", "direction", "label_smoothing", "mixup_alpha", "cutmix_alpha",
                            "num_images_logged", "score_threshold_logged"},
    ("task", "segmentation"): {"_target_", "objective", "direction", "aux_weight", "ignore_index", "label_smoothing",
                               "mixup_alpha", "cutmix_alpha", "num_images_logged"},
    ("task", "distillation"): {"_target_", "_recursive_", "objective", "direction", "teacher", "teacher_model", "alpha",
                               "temperature", "precision", "label_smoothing", "mixup_alpha", "cutmix_alpha"},
    ("task", "simclr"): {"_target_", "objective", "direction", "temperature", "projection_dim", "global_negatives",
                         "label_smoothing", "mixup_alpha", "cutmix_alpha"},
    # the logger group's options are picked several at a time (logger=[tensorboard,mlflow]): each fills logger.<option>
    ("logger", "tensorboard"): set(),
    ("logger", "mlflow"): {"tracking_uri", "experiment"},
    ("logger", "wandb"): {"project", "entity", "mode"},
}

OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def compose_config(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def flat_keys(node, prefix: str = "") -> set[str]:
    keys = set()
    for key in node:
        value = node._get_node(key)
        if isinstance(value, DictConfig):
            keys |= flat_keys(value, f"{prefix}{key}.")
        else:
            keys.add(f"{prefix}{key}")
    return keys


def test_every_option_file_is_covered():
    """The options tested here are exactly the yaml files in conf/<group>/, so a new one can't go untested."""
    on_disk = {group: {p.stem for p in (REPO / "conf" / group).glob("*.yaml")} for group in OPTIONS}
    assert on_disk == {group: set(options) for group, options in OPTIONS.items()}


@pytest.mark.parametrize("group, option", ALL_OPTIONS, ids=[f"{g}={o}" for g, o in ALL_OPTIONS])
def test_option_composes_against_its_schema(group, option):
    """Each option yaml extends the schema it is registered with, and has exactly its frozen keys; a
    model's or dataset's yaml names its builder, and sets every option of the builder's signature."""
    cfg = compose_config(f"{group}={option}")
    assert OmegaConf.get_type(cfg) is schema.TrainConfig
    if group in schema.BUILDERS:
        group_schema, run_args = schema.BUILDERS[group]
        builder = OPTIONS[group][option]
        assert OmegaConf.get_type(cfg[group]) is group_schema
        assert cfg[group]._target_ == f"{builder.__module__}.{builder.__qualname__}"
        options = set(inspect.signature(builder).parameters) - set(run_args) - set(schema.OPTIONAL_RUN_ARGS.get(group, ()))
        assert set(builder_options(cfg[group], group)) - {"_recursive_"} == {"_target_", *options}
    elif group == "logger":
        assert OmegaConf.get_type(cfg.logger[option]) is OPTIONS[group][option]
        assert [name for name in cfg.logger if cfg.logger[name] is not None] == [option]
        assert set(cfg.logger[option]) == OPTION_KEYS[group, option], "update OPTION_KEYS deliberately when adding an option"
        return
    else:
        assert OmegaConf.get_type(cfg[group]) is OPTIONS[group][option]
    assert set(cfg[group]) == OPTION_KEYS[group, option], "update OPTION_KEYS deliberately when adding an option"
    if group == "strategy":
        assert cfg.strategy.name == option


def command_line(args: list[str], cwd, monkeypatch) -> None:
    """`python train.py <args>`, run as __main__ in this process, where torch is imported already (a
    launch would cost seconds of start-up)."""
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", [str(REPO / "train.py"), *args])
    runpy.run_path(str(REPO / "train.py"), run_name="__main__")


def test_help_lists_every_user_group_and_option_and_no_schema(tmp_path, monkeypatch, capsys):
    """`python train.py --help`: its first line names every task; each group a user picks from, with
    each of its options; not the internal schema/ groups."""
    with pytest.raises(SystemExit) as exit_:
        command_line(["--help"], tmp_path, monkeypatch)
    assert exit_.value.code == 0
    stdout = capsys.readouterr().out
    assert "schema" not in stdout
    opening = stdout.splitlines()[0]
    assert all(task.stem in opening for task in (REPO / "conf" / "task").glob("*.yaml")), opening
    groups = {p.name for p in (REPO / "conf").iterdir() if p.is_dir() and p.name != "hydra"} | {"hydra/launcher"}
    for group in groups:
        (line,) = [line for line in stdout.splitlines() if line.strip().startswith(f"{group}=")]
        options = {p.stem for p in (REPO / "conf" / group).glob("*.yaml")}
        assert options <= set(line.replace("|", " ").replace(":", " ").split()), (line, options)
    assert not (tmp_path / "outputs").exists()


def test_hydra_config_prints_resolved(tmp_path, monkeypatch, capsys):
    """`--cfg hydra --resolve` prints Hydra's node alone, without the job's keys its interpolations read."""
    command_line(["--cfg", "hydra", "--resolve"], tmp_path, monkeypatch)
    stdout = capsys.readouterr().out
    run_dir = [line.split()[-1] for line in stdout.splitlines() if line.strip().startswith("dir:")][0]
    assert run_dir.startswith("outputs/") and "$" not in run_dir


# imagefolder and voc ship data.root as MISSING (test_imagefolder_requires_a_root, tests/test_segmentation.py), hf data.path
# and webdataset its shards (tests/test_hf_data.py, tests/test_webdataset.py)
@pytest.mark.parametrize("group, option", [(g, o) for g, o in ALL_OPTIONS if (g, o) not in
                                           {("data", "imagefolder"), ("data", "voc"), ("data", "hf"), ("data", "webdataset"),
                                            ("data", "coco")}])
def test_option_passes_validation(group, option, tmp_path, monkeypatch):
    """Every option's defaults are valid as shipped (cifar10's default root is relative to the working dir)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "datasets" / "cifar10").mkdir(parents=True)
    cfg = compose_config(f"{group}={option}")
    distributed = cfg.strategy.name in MULTI_PROCESS
    validate(cfg, launched=distributed, world_size=2 if distributed else 1)


def test_imagefolder_requires_a_root():
    """data=imagefolder ships data.root as MISSING, and validation names the key to pass."""
    cfg = compose_config("data=imagefolder")
    assert OmegaConf.missing_keys(cfg) == {"data.root"}
    with pytest.raises(ConfigError, match=r"data\.root is required"):
        validate(cfg, launched=False, world_size=1)


@pytest.mark.parametrize("size", [16, 32])
@pytest.mark.parametrize("model", ["small_cnn", "resnet18", "torchvision", "timm"])
def test_model_builds_and_runs_forward(model, size):
    """Each model option builds with the data's num_classes/in_channels and maps (N, C, H, W) to (N, classes)."""
    cfg = compose_config(f"model={model}")
    net = build_model(cfg.model, num_classes=10, in_channels=3).eval()
    with torch.no_grad():
        logits = net(torch.randn(2, 3, size, size))
    assert logits.shape == (2, 10)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("small_input", [True, False])
def test_resnet18_accepts_one_channel_input(small_input):
    """resnet18 adapts its stem to in_channels, with the small-input stem and with the ImageNet one."""
    cfg = compose_config("model=resnet18", f"model.small_input={small_input}")
    net = build_model(cfg.model, num_classes=7, in_channels=1).eval()
    with torch.no_grad():
        assert net(torch.randn(2, 1, 32, 32)).shape == (2, 7)


def test_small_cnn_channels_come_from_the_config():
    """model.channels sets the conv widths, and the head follows the last one."""
    cfg = compose_config("model=small_cnn", "model.channels=[4,6]")
    net = build_model(cfg.model, num_classes=3, in_channels=1)
    convs = [m for m in net.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [(c.in_channels, c.out_channels) for c in convs] == [(1, 4), (4, 6)]
    assert net(torch.randn(2, 1, 8, 8)).shape == (2, 3)


@pytest.mark.parametrize("option", list(OPTIONS["optim"]))
def test_optimizer_builds_from_config_and_steps(option):
    """Each optim option builds its torch.optim class with the configured hyperparameters, and can step."""
    cfg = compose_config(f"optim={option}", "model=small_cnn", "model.channels=[4]")
    model = build_model(cfg.model, num_classes=3, in_channels=1)
    optimizer = instantiate(optimizer_node(cfg.optim), params=model.parameters())
    assert type(optimizer) is OPTIMIZERS[option]
    group = optimizer.param_groups[0]
    for key, value in optimizer_node(cfg.optim).items():
        if key != "_target_":
            assert group[key] == value, key
    before = [p.detach().clone() for p in model.parameters()]
    torch.nn.functional.cross_entropy(model(torch.randn(4, 1, 8, 8)), torch.tensor([0, 1, 2, 0])).backward()
    optimizer.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def _raw_rows(images: torch.Tensor) -> list[tuple[int, ...]]:
    """Undo the global normalisation: the 17 distinct values are the raw 0..16 pixel levels, in order."""
    levels = torch.unique(images)
    assert len(levels) == 17
    return [tuple(row) for row in torch.searchsorted(levels, images.reshape(len(images), -1)).tolist()]


def test_digits_is_a_fixed_partition_of_all_1797_images():
    """train + val hold every digits image exactly once with its label, val_fraction sets the sizes,
    and the split depends on split_seed only, not on the global seed."""
    cfg = compose_config("data=digits")
    torch.manual_seed(1)
    splits = build_datasets(cfg.data)
    torch.manual_seed(2)
    again = build_datasets(cfg.data)
    assert (splits.num_classes, splits.in_channels) == (10, 1)
    (train_x, train_y), (val_x, val_y) = splits.train.tensors, splits.val.tensors
    assert train_x.shape[1:] == (1, 8, 8)
    assert len(train_x) + len(val_x) == 1797
    assert len(val_x) == int(1797 * cfg.data.val_fraction)

    raw_x, raw_y = load_digits(return_X_y=True)
    expected = sorted(zip(map(tuple, raw_x.astype(int).tolist()), raw_y.tolist()))
    rows = _raw_rows(torch.cat([train_x, val_x]))
    assert sorted(zip(rows, torch.cat([train_y, val_y]).tolist())) == expected

    for a, b in zip(splits.train.tensors + splits.val.tensors, again.train.tensors + again.val.tensors):
        assert torch.equal(a, b)
    other = build_datasets(compose_config("data=digits", "data.split_seed=1").data)
    assert not torch.equal(other.val.tensors[0], val_x)


def test_the_recipe_and_digits_never_import_scikit_learn():
    """Its import, scipy's with it, costs about 1.5 s of CPU in every rank of every run: digits reads the file it
    bundles instead (the test above: the same images and labels as load_digits)."""
    code = ("import sys, train; from data.digits import build_digits; build_digits(0.2, 0); "
            "print(sorted(name for name in sys.modules if name.split('.')[0] in ('sklearn', 'scipy')))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


def test_synthetic_is_deterministic_with_configured_shapes():
    """data_seed alone fixes the samples; the counts, image size, channels and classes come from the config."""
    overrides = ["data=synthetic", "data.num_samples=40", "data.num_val_samples=12", "data.image_size=6",
                 "data.channels=2", "data.num_classes=4"]
    cfg = compose_config(*overrides)
    torch.manual_seed(1)
    splits = build_datasets(cfg.data)
    torch.manual_seed(2)
    again = build_datasets(cfg.data)
    assert (splits.num_classes, splits.in_channels) == (4, 2)
    assert splits.train.tensors[0].shape == (40, 2, 6, 6)
    assert splits.val.tensors[0].shape == (12, 2, 6, 6)
    for labels in (splits.train.tensors[1], splits.val.tensors[1]):
        assert labels.dtype == torch.long and 0 <= labels.min() and labels.max() < 4
    for a, b in zip(splits.train.tensors + splits.val.tensors, again.train.tensors + again.val.tensors):
        assert torch.equal(a, b)
    other = build_datasets(compose_config(*overrides, "data.data_seed=1").data)
    assert not torch.equal(other.train.tensors[0], splits.train.tensors[0])


def test_imagefolder_reads_a_real_tree(tmp_path):
    """ImageFolder finds the class folders, and every image comes out (3, image_size, image_size)."""
    root = write_imagefolder(tmp_path / "images")
    cfg = compose_config("data=imagefolder", f"data.root={root}", "data.image_size=16")
    validate(cfg, launched=False, world_size=1)
    splits = build_datasets(cfg.data)
    assert (splits.num_classes, splits.in_channels) == (2, 3)
    assert (len(splits.train), len(splits.val)) == (6, 6)
    image, label = splits.train[0]
    assert image.shape == (3, 16, 16) and image.dtype == torch.float32
    assert splits.train.classes == splits.val.classes == ["cat", "dog"]
    assert sorted(label for _, label in splits.val.samples) == [0, 0, 0, 1, 1, 1]


def test_cifar10_without_data_is_a_config_error(tmp_path):
    """With download off and nothing at data.root, the builder raises our ConfigError, not torchvision's."""
    cfg = compose_config("data=cifar10", f"data.root={tmp_path}")
    assert cfg.data.download is False
    with pytest.raises(ConfigError, match="CIFAR-10 not found") as error:
        build_datasets(cfg.data)
    assert f"data.root={tmp_path}" in str(error.value)


def test_default_config_keys_are_frozen():
    """The default config's flattened keys; adding or dropping one must be a deliberate change here."""
    keys = flat_keys(compose_config())
    assert keys == DEFAULT_KEYS, (
        f"added: {sorted(keys - DEFAULT_KEYS)}, removed: {sorted(DEFAULT_KEYS - keys)}; "
        "update this list deliberately when adding an option"
    )
    assert isinstance(compose_config().model._get_node("channels"), ListConfig)
    # the logger group picks TensorBoard alone by default; several by a list
    assert {name for name, node in compose_config().logger.items() if node is not None} == {"tensorboard"}
    assert {name for name, node in compose_config("logger=[tensorboard,mlflow,wandb]").logger.items()
            if node is not None} == {"tensorboard", "mlflow", "wandb"}


@pytest.mark.parametrize("override, key", [
    ("trainer.max_epochs=abc", "trainer.max_epochs"),
    ("data.batch_size=1.5", "data.batch_size"),
    ("optim.lr=fast", "optim.lr"),
    ("syncbn=maybe", "syncbn"),
    ("strategy.timeout_s=soon", "strategy.timeout_s"),
])
def test_schema_rejects_wrong_types_at_compose_time(override, key):
    """A mistyped value fails while composing: the schema's type check, naming the key, before any code sees it."""
    with pytest.raises(ConfigCompositionException) as error:
        compose_config(override)
    assert isinstance(error.value.__cause__, ValidationError), repr(error.value.__cause__)
    assert error.value.__cause__.full_key == key


def test_schema_converts_typed_strings():
    """Command-line strings become the schema's types: ints, floats and bools, not str."""
    cfg = compose_config("trainer.max_epochs=3", "optim.lr=1", "syncbn=true", "data.batch_size=8")
    assert cfg.trainer.max_epochs == 3 and type(cfg.trainer.max_epochs) is int
    assert cfg.optim.lr == 1.0 and type(cfg.optim.lr) is float
    assert cfg.syncbn is True
    assert type(cfg.data.batch_size) is int


@pytest.mark.parametrize("override, message", [
    ("model.channels=[a,b]", "model.channels[0]: Value 'a' of type 'str' could not be converted to Integer; "
                             "models.small_cnn.SmallCNN takes channels: list[int]"),
    ("data.val_fraction=most", "data.val_fraction: Value 'most' of type 'str' could not be converted to Float; "
                               "data.digits.build_digits takes val_fraction: float"),
    ("model.chanels=[4]", "model.chanels: unknown key, not an option of models.small_cnn.SmallCNN (did you mean "
                          "model.channels? options: channels, dropout, norm); check the spelling"),
    ("+model.in_channels=3", "model.in_channels: the run passes in_channels to models.small_cnn.SmallCNN itself"),
    ("model._target_=models.small_cnn.SmallCN", "model._target_=models.small_cnn.SmallCN: can't be imported"),
    ("model._target_=models.zoo.check_name", "model._target_=models.zoo.check_name: must take num_classes, in_channels"),
    ("task.smoothing=0.1", "task.smoothing: unknown key, not an option of tasks.classification.ClassificationTask (did "
                           "you mean task.label_smoothing? options: label_smoothing, mixup_alpha, cutmix_alpha)"),
    ("task.label_smoothing=some", "task.label_smoothing: Value 'some' of type 'str' could not be converted to Float"),
    ("+task.class_names=[a]", "task.class_names: the run passes class_names to tasks.classification.ClassificationTask itself"),
])
def test_builder_options_are_checked_against_its_signature_in_one_line(override, message):
    """A model's, dataset's or task's options compose (the group is open to them), then validation checks them
    against the builder's signature: an unknown key, a run argument or a mistyped value is one line."""
    cfg = compose_config(override)
    with pytest.raises(ConfigError) as error:
        validate(cfg, launched=False, world_size=1)
    assert str(error.value).startswith(message) and "\n" not in str(error.value), str(error.value)


def choice_builder(num_classes: int, in_channels: int, width: int, act: Literal["relu", "gelu"] = "relu", note=None):
    return width, act, note


def test_builder_options_are_converted_to_the_annotations():
    """Command-line strings become the builder's types; Literal lists the allowed values; an option
    without an annotation takes any value; a parameter without a default is required."""
    node = {"_target_": f"{__name__}.choice_builder", "width": "8", "act": "gelu", "note": [1, "a"], "weights_path": None}
    assert builder_options(node, "model") == {"_target_": f"{__name__}.choice_builder", "width": 8, "act": "gelu", "note": [1, "a"]}
    dropout = builder_options(compose_config("model.dropout=0").model, "model")["dropout"]
    assert dropout == 0.0 and type(dropout) is float
    with pytest.raises(ConfigError, match=r"^model.act=tanh: unknown, use one of relu, gelu$"):
        builder_options({**node, "act": "tanh"}, "model")
    with pytest.raises(ConfigError, match=r"^model.width is required: .*choice_builder has no default for it"):
        builder_options({"_target_": node["_target_"]}, "model")


# A user's model module in the common typing style: postponed annotations, and a name imported for them only.
POSTPONED_NET = """\
from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from collections.abc import Sequence


def build(num_classes: int, in_channels: int, widths: Sequence[int], dropout: float = 0.0) -> nn.Module:
    layers, previous = [], in_channels
    for width in widths:
        layers += [nn.Conv2d(previous, width, 3, padding=1), nn.ReLU()]
        previous = width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout), nn.Linear(previous, num_classes))
"""


def test_a_builder_with_postponed_annotations_trains(tmp_path, monkeypatch):
    """`widths: Sequence[int]` can't be evaluated at run time (Sequence is imported under TYPE_CHECKING),
    yet the module imports fine: the builder is taken and trains, with widths unchecked; dropout's
    annotation evaluates, so a mistyped dropout is still one line."""
    (tmp_path / "postponed_net.py").write_text(POSTPONED_NET)
    monkeypatch.syspath_prepend(tmp_path)
    monkeypatch.chdir(tmp_path)
    overrides = ["data=synthetic", "data.num_samples=16", "data.num_val_samples=8", "data.image_size=8", "data.batch_size=8",
                 "trainer.max_epochs=1", "model._target_=postponed_net.build", "~model.channels", "~model.norm", "+model.widths=[4]"]
    line = config_error_in_this_process([*overrides, "model.dropout=lots"], tmp_path / "refused")
    assert line.startswith("model.dropout: Value 'lots' of type 'str' could not be converted to Float; "
                           "postponed_net.build takes dropout: float"), line
    results = run_in_this_process(overrides, tmp_path / "run")
    assert results["steps"] == 2 and results["val_samples"] == 8
