"""Bad command lines fail fast and clearly: a non-zero exit, a message naming the key, no Python
traceback, and nothing trained or saved (no TensorBoard events, no checkpoint).

Our own checks (ddp/config/checks.py `validate`, `resolve_backend`, the data builders) print exactly one
line `error: <message>` on stderr and exit 1; Hydra's composition errors are Hydra's own messages.
"""

import json
import os
import pickle
import socket
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from torch.distributed.checkpoint.metadata import Metadata

from conftest import REPO, TORCHRUN, TRAIN, config_error_in_this_process, launch

# A tiny run where the case allows; a case's own args come after these, and the last override wins.
QUICK = ["trainer.max_epochs=1", "data=synthetic", "data.num_samples=32", "data.num_val_samples=8"]


def _output(result) -> str:
    return result.stdout + result.stderr


def _logs(tmp_path: Path) -> str:
    return "".join(log.read_text() for log in tmp_path.rglob("train_rank*.log"))


def assert_nothing_trained(tmp_path: Path, result, under_torchrun: bool = False) -> None:
    """No traceback, no training started, no process group, no event file, no checkpoint.
    (torchrun prints its own ChildFailedError traceback: under it, none of the frames may be ours.)"""
    text = _output(result) + _logs(tmp_path)
    if under_torchrun:
        assert f'File "{TRAIN}"' not in _output(result), _output(result)
    else:
        assert "Traceback" not in _output(result), _output(result)
    assert "process group up" not in text, text
    assert "global_batch=" not in text, text  # fit()'s first log line: training never began
    assert not list(tmp_path.rglob("events.out.tfevents*")), "a TensorBoard event file was written"
    assert not list(tmp_path.rglob("*.pt")), "a checkpoint was written"


def _imagefolder_without_splits(tmp: Path) -> Path:
    root = tmp / "not_an_imagefolder"
    (root / "images").mkdir(parents=True)
    return root


def _imagefolder_without_val(tmp: Path) -> Path:
    root = tmp / "train_only"
    (root / "train" / "cat").mkdir(parents=True)
    return root


def _imagefolder_without_classes(tmp: Path) -> Path:
    root = tmp / "no_classes"
    (root / "train").mkdir(parents=True)
    (root / "val").mkdir()
    return root


def _imagefolder_with_different_classes(tmp: Path) -> Path:
    from PIL import Image

    root = tmp / "different_classes"
    for split, classes in (("train", ("cat", "dog")), ("val", ("cat", "eel"))):
        for name in classes:
            (root / split / name).mkdir(parents=True)
            Image.new("RGB", (4, 4)).save(root / split / name / "0.png")
    return root


def _coco_that_is_not_coco(tmp: Path) -> Path:
    from test_detection_data import write_small_coco

    root = tmp / "coco"
    write_small_coco(root)
    (root / "annotations" / "instances_val2017.json").write_text('{"images": [], "annotations": {}}')
    return root


def _coco_with_a_box_outside_its_image(tmp: Path) -> Path:
    from test_detection_data import write_small_coco

    root = tmp / "coco"
    path = write_small_coco(root)
    coco = json.loads(path.read_text())
    coco["annotations"][0]["bbox"] = [20, 3, 30, 8]  # x + w = 50 in an image 32 wide
    path.write_text(json.dumps(coco))
    return root


def _empty_dir(tmp: Path) -> Path:
    root = tmp / "cifar_empty"
    root.mkdir()
    return root


def _pickled_model(tmp: Path) -> Path:
    import torch

    from models.small_cnn import SmallCNN

    path = tmp / "whole_model.pth"
    torch.save(SmallCNN(10, 3, [4]), path)  # the module object itself, pickled: loading it would run code
    return path


def _resnet18_weights(tmp: Path) -> Path:
    import torch
    import torchvision

    path = tmp / "resnet18.pth"
    torch.save(torchvision.models.resnet18(num_classes=10).state_dict(), path)
    return path


def _checkpoint_file(tmp: Path) -> Path:
    path = tmp / "step.ckpt"  # not *.pt: the test finds no checkpoint written by the run
    torch.save({"model": {}, "global_step": 1}, path)
    return path


def _sharded_checkpoint(tmp: Path, index: bytes = pickle.dumps(Metadata(state_dict_metadata={}))) -> Path:
    """What resume sees of one: DCP's index (of no tensors) and rank 0's state; beside tmp, whose *.pt
    files would be checkpoints the run wrote."""
    path = tmp.parent / f"{tmp.name}-sharded" / "step-00000001"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(index)
    torch.save({"sharded": True, "global_step": 1}, path / "state.pt")
    return path


def _truncated_sharded_checkpoint(tmp: Path) -> Path:
    return _sharded_checkpoint(tmp, index=b"")


def _sharded_checkpoint_of_another_width(tmp: Path) -> Path:
    """A real DCP index and shards (written by DCP in this one process) of small_cnn at channels [8, 16], and rank 0's
    state as a run of QUICK's settings saves it at an epoch's end."""
    import torch.distributed.checkpoint as dcp

    from models.small_cnn import SmallCNN

    path = tmp.parent / f"{tmp.name}-sharded" / "step-00000001"
    with warnings.catch_warnings():  # no_dist=True is the intent, which DCP warns it assumes
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.save({"model": SmallCNN(10, 3, [8, 16]).state_dict()}, checkpoint_id=path, no_dist=True)
    torch.save({"sharded": True, "global_step": 1, "samples_in_epoch": 0, "batch_in_epoch": 0, "world_size": 2,
                "config": {"data": {"batch_size": 16}}}, path / "state.pt")
    return path


FSDP = ["strategy=fsdp", "strategy.nproc_per_node=2"]  # validated in this process, as the launcher does


# (args, key named in the message, distinctive part(s) of the message, setup); "{tmp}" is tmp_path,
# and "{dir}" is the folder that the case's setup function makes in tmp_path.
DETECTION = ["trainer.max_epochs=1", "task=detection"]
SMALL_FCOS = ["model=detection", "model.name=small_fcos"]
SHAPES = ["data=detection_shapes", "data.num_samples=8", "data.num_val_samples=4"]

OUR_ERRORS = {
    "coco_json_that_is_not_coco": (
        [*DETECTION, *SMALL_FCOS, "data=coco", "data.root={dir}"], "data.root={dir}",
        ("annotations/instances_val2017.json: not a COCO annotation file", "'images', 'annotations' and 'categories' lists"),
        _coco_that_is_not_coco,
    ),
    "coco_box_outside_its_image": (
        [*DETECTION, *SMALL_FCOS, "data=coco", "data.root={dir}"], "data.root={dir}",
        ("annotation 21's bbox", "lies outside its image 000000000011.png (32x24)"), _coco_with_a_box_outside_its_image,
    ),
    "unknown_detector": (
        [*DETECTION, *SHAPES, "model=detection", "model.name=fasterrcnn_resnet_50"], "model.name=fasterrcnn_resnet_50",
        "not a detector here", None,
    ),
    "misspelt_detector_option": (
        [*DETECTION, *SHAPES, *SMALL_FCOS, "+model.kwargs.score_tresh=0.1"], "model.kwargs.score_tresh",
        "not an option of small_fcos (FCOS); did you mean model.kwargs.score_thresh?", None,
    ),
    "detection_with_a_classification_model": (
        [*DETECTION, *SHAPES, "model=small_cnn"], "model", "task=detection trains a detector, and SmallCNN is none; set model=detection",
        None,
    ),
    "classification_with_a_detector": (
        [*QUICK, *SMALL_FCOS], "model", "a detector trains with task=detection, not with ClassificationTask", None,
    ),
    "classification_of_detection_data": (
        ["trainer.max_epochs=1", *SHAPES], "data", "a target dict per image (a detection dataset)", None,
    ),
    "unknown_top_level_key": (QUICK + ["+typo=1"], "typo", "unknown key", None),
    "unknown_nested_key": (QUICK + ["+data.typo=1"], "data.typo", "unknown key", None),
    "unknown_task_key": (QUICK + ["+task.typo=1"], "task.typo", "unknown key", None),
    "unknown_task_direction": (QUICK + ["task.direction=up"], "task.direction=up", "unknown, use one of maximize, minimize", None),
    "nccl_without_cuda": (QUICK + ["backend=nccl"], "backend=nccl", "needs CUDA", None),
    "unknown_backend": (QUICK + ["backend=foo"], "backend=foo", "unknown, use one of auto, nccl, gloo", None),
    "zero_batch_size": (QUICK + ["data.batch_size=0"], "data.batch_size=0", "must be > 0", None),
    "negative_batch_size": (QUICK + ["data.batch_size=-4"], "data.batch_size=-4", "must be > 0", None),
    "zero_lr": (QUICK + ["optim.lr=0"], "optim.lr=0", "must be > 0", None),
    "negative_lr": (QUICK + ["optim.lr=-1"], "optim.lr=-1", "must be > 0", None),
    "negative_num_workers": (QUICK + ["data.num_workers=-1"], "data.num_workers=-1", "must be >= 0", None),
    "negative_shuffle_window": (QUICK + ["data.shuffle_window=-1"], "data.shuffle_window=-1", "must be >= 0", None),
    "shuffle_window_without_shards": (QUICK + ["data.shuffle_window=2"], "data.shuffle_window=2", "has no shards", None),
    "zero_timeout": (QUICK + ["strategy.timeout_s=0"], "strategy.timeout_s=0", "must be > 0", None),
    "zero_max_epochs": (QUICK + ["trainer.max_epochs=0"], "trainer.max_epochs=0", "must be >= 1", None),
    "zero_max_steps": (QUICK + ["trainer.max_steps=0"], "trainer.max_steps=0", "must be -1 (no limit) or >= 1", None),
    "zero_limit_train_batches": (
        QUICK + ["trainer.limit_train_batches=0"], "trainer.limit_train_batches=0", "must be -1 (no limit) or >= 1", None,
    ),
    "zero_log_every": (QUICK + ["trainer.log_every_n_steps=0"], "trainer.log_every_n_steps=0", "must be >= 1", None),
    "log_every_beyond_the_sigterm_grace": (
        QUICK + ["trainer.log_every_n_steps=101"], "trainer.log_every_n_steps=101", "must be <= 100", None,
    ),
    "momentum_of_one_or_more": (QUICK + ["optim.momentum=2"], "optim.momentum=2", "must be in [0, 1)", None),
    "unknown_precision": (QUICK + ["precision=fp8"], "precision=fp8", "unknown, use one of 32, bf16, 16", None),
    "no_micro_batches_per_update": (
        QUICK + ["trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches=0", "must be >= 1", None,
    ),
    "global_batch_not_a_multiple_of_the_batch": (
        QUICK + ["data.batch_size=8", "trainer.global_batch_size=20"], "trainer.global_batch_size=20",
        "must be a multiple of data.batch_size x world size = 8 x 1 = 8", None,
    ),
    "global_batch_and_accumulation_both_set": (
        QUICK + ["trainer.global_batch_size=64", "trainer.accumulate_grad_batches=2"], "trainer.accumulate_grad_batches=2",
        "trainer.global_batch_size=64 sets trainer.accumulate_grad_batches itself", None,
    ),
    "warmup_longer_than_the_run": (
        QUICK + ["scheduler=cosine", "scheduler.warmup_steps=5"], "scheduler.warmup_steps", "but the run has only 1", None,
    ),
    "negative_keep_best": (QUICK + ["checkpoint.keep_best=-1"], "checkpoint.keep_best=-1", "must be >= 0 (0: off)", None),
    "unknown_best_of": (QUICK + ["checkpoint.best_of=emma"], "checkpoint.best_of=emma", "unknown, use one of model, ema", None),
    "best_of_ema_without_ema": (QUICK + ["checkpoint.best_of=ema"], "checkpoint.best_of=ema", "set ema.decay", None),
    "unknown_trainer_objective": (QUICK + ["trainer.objective=last"], "trainer.objective=last", "unknown, use one of final, best", None),
    "zero_early_stop_patience": (
        QUICK + ["trainer.early_stop_patience=0"], "trainer.early_stop_patience=0", "must be >= 1, or null", None,
    ),
    "negative_early_stop_min_delta": (
        QUICK + ["trainer.early_stop_min_delta=-0.1"], "trainer.early_stop_min_delta=-0.1", "must be >= 0", None,
    ),
    "misspelt_objective_metric": (
        QUICK + ["task.objective=val_acuracy"], "task.objective=val_acuracy", ("not a validation metric", "did you mean val_accuracy?"),
        None,
    ),
    "keep_best_without_a_validation_before_the_end": (
        QUICK + ["trainer.max_epochs=2", "trainer.val_every_n_epochs=3"], "trainer.val_every_n_epochs=3",
        ("larger than the run (2 epochs)", "checkpoint.keep_best=1 has nothing to compare"), None,
    ),
    "ema_decay_above_one": (QUICK + ["ema.decay=1.5"], "ema.decay=1.5", "must be in (0, 1)", None),
    "negative_clip_norm": (QUICK + ["trainer.gradient_clip_norm=-1"], "trainer.gradient_clip_norm=-1", "must be > 0", None),
    "unknown_norm": (QUICK + ["model.norm=layer"], "model.norm=layer", "unknown, use one of batch, group, none", None),
    "image_the_model_cannot_take": (
        QUICK + ["data.image_size=0"], "data.image_size", ("the model can't take this data's samples", "[3, 0, 0]"), None,
    ),
    "imagefolder_without_root": (["trainer.max_epochs=1", "data=imagefolder"], "data.root", "data.root is required", None),
    "imagefolder_missing_root": (
        ["trainer.max_epochs=1", "data=imagefolder", "data.root={tmp}/missing"], "data.root={tmp}/missing",
        "no such directory", None,
    ),
    "imagefolder_without_splits": (
        ["trainer.max_epochs=1", "data=imagefolder", "data.root={dir}"], "data.root={dir}", "no train/ folder",
        _imagefolder_without_splits,
    ),
    "imagefolder_without_val": (
        ["trainer.max_epochs=1", "data=imagefolder", "data.root={dir}"], "data.root={dir}", "no val/ folder",
        _imagefolder_without_val,
    ),
    "imagefolder_without_classes": (
        ["trainer.max_epochs=1", "data=imagefolder", "data.root={dir}"], "data.root={dir}",
        "Couldn't find any class folder", _imagefolder_without_classes,
    ),
    "imagefolder_with_different_classes": (
        ["trainer.max_epochs=1", "data=imagefolder", "data.root={dir}"], "data.root={dir}",
        "different class folders", _imagefolder_with_different_classes,
    ),
    "optimizer_rejects_a_value": (QUICK + ["optim.weight_decay=-1"], "optim", "Invalid weight_decay value", None),
    "model_rejects_a_value": (QUICK + ["model.dropout=2"], "model", "dropout probability", None),
    "empty_train_split": (QUICK + ["data.num_samples=0"], "data", "the train split is empty", None),
    "empty_val_split": (["trainer.max_epochs=1", "data.val_fraction=0"], "data", "the val split is empty", None),
    "cifar10_not_downloaded": (
        ["trainer.max_epochs=1", "data=cifar10", "data.root={dir}"], "data.root={dir}",
        ("CIFAR-10 not found", "set data.download=true"), _empty_dir,
    ),
    "ddp_without_torchrun": (QUICK + ["strategy=ddp"], "strategy=ddp", "torchrun --nproc_per_node", None),
    "unknown_mode": (QUICK + ["mode=serve"], "mode=serve", "unknown, use one of train, eval", None),
    "eval_without_a_checkpoint": (QUICK + ["mode=eval"], "mode=eval", "pass resume=<checkpoint file or run dir>", None),
    "eval_of_a_missing_checkpoint": (QUICK + ["mode=eval", "resume={tmp}/missing.pt"], "resume={tmp}/missing.pt", "not found", None),
    "eval_of_a_dir_without_checkpoints": (QUICK + ["mode=eval", "resume={dir}"], "resume={dir}", "no loadable checkpoint", _empty_dir),
    "eval_of_a_split_the_data_lacks": (
        QUICK + ["mode=eval", "resume={dir}", "data.split=test"], "data.split=test", "has no test split", _empty_dir,
    ),
    "test_split_in_training": (QUICK + ["data.split=test"], "data.split=test", "training validates on val", None),
    "unknown_split": (QUICK + ["data.split=holdout"], "data.split=holdout", "unknown, use one of val, test", None),
    "unknown_augment": (
        ["trainer.max_epochs=1", "data=cifar10", "data.root={dir}", "data.augment=heavy"], "data.augment=heavy",
        "unknown, use one of none, standard, randaugment, trivialaugment, autoaugment", _empty_dir,
    ),
    "random_erase_beyond_one": (
        ["trainer.max_epochs=1", "data=cifar10", "data.root={dir}", "data.random_erase=1.5"], "data.random_erase=1.5",
        "must be a probability", _empty_dir,
    ),
    "unknown_interpolation": (
        ["trainer.max_epochs=1", "data=cifar10", "data.root={dir}", "data.interpolation=lanczos"],
        "data.interpolation=lanczos", "unknown, use one of bilinear, bicubic, nearest", _empty_dir,
    ),
    "negative_mixup_alpha": (QUICK + ["data.mixup_alpha=-1"], "data.mixup_alpha=-1", "must be >= 0", None),
    "mixup_with_segmentation": (
        ["trainer.max_epochs=1", "task=segmentation", "data=shapes", "model=small_segnet", "data.num_samples=8",
         "data.num_val_samples=4", "data.image_size=24", "data.mixup_alpha=0.2"], "data.mixup_alpha=0.2",
        "data.mixup_alpha=0.2: task=segmentation trains on hard per-pixel labels; set data.mixup_alpha=0", None,
    ),
    "label_smoothing_of_one": (QUICK + ["trainer.label_smoothing=1"], "trainer.label_smoothing=1", "must be in [0, 1)", None),
    "unknown_torchvision_model": (
        QUICK + ["model=torchvision", "model.name=resnet5"], "model.name=resnet5", "closest: resnet50, ", None,
    ),
    "unknown_timm_model": (QUICK + ["model=timm", "model.name=convnxt_tiny"], "model.name=convnxt_tiny", "closest: convnext_tiny", None),
    "torchvision_weights_to_download": (
        QUICK + ["model=torchvision", "model.weights=IMAGENET1K_V1"], "model.weights=IMAGENET1K_V1", "model.weights_path=<file>", None,
    ),
    "small_input_stem_on_a_vit": (
        QUICK + ["model=torchvision", "model.name=vit_b_16", "model.small_input=true"], "model.small_input=true",
        "applies to ResNet-style models", None,
    ),
    "model_kwarg_the_model_rejects": (
        QUICK + ["model=torchvision", "model.name=resnet18", "+model.kwargs.depth=3"], "model", "unexpected keyword argument 'depth'", None,
    ),
    "ema_with_fsdp": (QUICK + [*FSDP, "ema.decay=0.9"], "ema.decay=0.9", "strategy=fsdp", None),
    "channels_last_with_fsdp": (QUICK + [*FSDP, "channels_last=true"], "channels_last=true", "strategy=fsdp", None),
    "hsdp_shard_size_not_dividing_the_processes": (
        QUICK + ["strategy=hsdp", "strategy.nproc_per_node=4", "strategy.shard_size=3"], "strategy.shard_size=3",
        "doesn't divide the 4 processes into shard groups", None,
    ),
    "unknown_activation_checkpointing": (
        QUICK + ["activation_checkpointing=some"], "activation_checkpointing=some", "use one of none, full, selective", None,
    ),
    "activation_checkpointing_without_blocks": (
        QUICK + ["activation_checkpointing=full", "strategy.block_types=[]"], "activation_checkpointing=full",
        ("no block to checkpoint found in SmallCNN", "strategy.block_types=[...]"), None,
    ),
    "activation_checkpointing_under_dp": (QUICK + ["strategy=dp", "activation_checkpointing=selective"],
                                          "activation_checkpointing=selective", "use strategy=ddp", None),
    "async_save_under_dp": (QUICK + ["strategy=dp", "checkpoint.async_save=true"], "checkpoint.async_save=true",
                            "not with strategy=dp", None),
    "activation_checkpointing_every_zero": (
        QUICK + ["activation_checkpointing=selective", "activation_checkpointing_every=0"], "activation_checkpointing_every=0",
        "must be >= 1", None,
    ),
    "fsdp_block_type_the_model_lacks": (
        QUICK + [*FSDP, "strategy.block_types=[Bottleneck]"], "strategy.block_types=['Bottleneck']", "pick from", None,
    ),
    "fsdp_resuming_a_checkpoint_file": (
        QUICK + [*FSDP, "resume={dir}"], "resume", "strategy=fsdp doesn't resume from yet", _checkpoint_file,
    ),
    "ddp_resuming_a_sharded_checkpoint": (
        QUICK + ["strategy=ddp", "strategy.nproc_per_node=2", "resume={dir}"], "resume", "strategy=ddp doesn't resume from yet",
        _sharded_checkpoint,
    ),
    "fsdp_resuming_a_sharded_checkpoint_of_another_width": (
        QUICK + [*FSDP, "model.channels=[8,32]", "resume={dir}"], "resume",
        ("does not fit this model", "6 reshaped keys ['features.3.weight', 'features.4.bias', 'features.4.running_mean', ...]"),
        _sharded_checkpoint_of_another_width,
    ),
    "eval_of_an_unreadable_sharded_checkpoint": (
        QUICK + ["mode=eval", "resume={dir}"], "resume", "unreadable sharded checkpoint", _truncated_sharded_checkpoint,
    ),
    "missing_fault_plan": (QUICK + ["fault.plan={tmp}/faults.json"], "fault.plan={tmp}/faults.json", "no such file", None),
    "repeated_device": (QUICK + ["devices=[0,0]"], "devices=[0, 0]", "distinct GPU indices", None),
    "negative_device": (QUICK + ["devices=[-1]"], "devices=[-1]", "distinct GPU indices", None),
    "missing_weights_file": (QUICK + ["model.weights_path={tmp}/missing.pt"], "model.weights_path={tmp}/missing.pt", "not found", None),
    "pickled_weights": (QUICK + ["model.weights_path={dir}"], "model.weights_path", "refused, it holds pickled objects", _pickled_model),
    "weights_of_another_model": (
        QUICK + ["model.weights_path={dir}"], "model.weights_path={dir}", ("does not fit this model", "unexpected keys ['bn1.bias'"),
        _resnet18_weights,
    ),
}


@pytest.mark.parametrize("args, key, message, setup", OUR_ERRORS.values(), ids=OUR_ERRORS.keys())
def test_our_config_errors_name_the_key_before_anything_starts(tmp_path, monkeypatch, args, key, message, setup):
    """train.run itself, in this process: each mistake raises ConfigError naming the key, in one
    line, before a process group, an event file or a checkpoint exists. (How the command line turns
    that into one `error:` line and exit 1 is checked below, on a few of these, as real processes.)"""
    monkeypatch.chdir(tmp_path)
    folder = setup(tmp_path) if setup else None
    args = [arg.format(tmp=tmp_path, dir=folder) for arg in args]
    line = config_error_in_this_process(args, tmp_path / "outputs" / "run")  # one line, nothing started or written
    assert key.format(tmp=tmp_path, dir=folder) in line, line
    for part in (message,) if isinstance(message, str) else message:
        assert part in line, line
    assert not list(tmp_path.rglob("*.pt"))


# Every case raises ConfigError out of train.run (above, in process); main turns any of them into one
# `error:` line and exit 1 the same way. Through the command line: the case that gets furthest (the
# config passes its checks, the data and the model are built and run), where a library could print
# more than our line. (A launch costs seconds of start-up.)
CLI_CASES = ["image_the_model_cannot_take", "coco_box_outside_its_image"]


@pytest.mark.parametrize("case", CLI_CASES)
def test_our_config_errors_are_one_line_and_exit_1_on_the_command_line(tmp_path, case):
    result = _refused_on_the_command_line(case, tmp_path)
    assert_nothing_trained(tmp_path, result)
    assert_no_run_dir_left(tmp_path)


def _refused_on_the_command_line(case: str, tmp_path: Path, strategy: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Launch OUR_ERRORS[case] (with `strategy` unless the case picks fsdp): exit 1 and one `error:` line that
    names the case's key and message."""
    args, key, message, setup = OUR_ERRORS[case]
    folder = setup(tmp_path) if setup else None
    args = [arg.format(tmp=tmp_path, dir=folder) for arg in args]
    if "strategy=fsdp" not in args:
        args += strategy
    result = launch(args, cwd=tmp_path, timeout=120)
    assert result.returncode == 1, _output(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert key.format(tmp=tmp_path, dir=folder) in lines[0], lines[0]
    for part in (message,) if isinstance(message, str) else message:
        assert part in lines[0], lines[0]
    return result


def assert_no_run_dir_left(tmp_path: Path) -> None:
    """A refused launch removes the run dir it made (claims of a torchrun launch, in outputs/.launches, are
    pruned by a later launch: ddp/jobs/run_dir.py)."""
    outputs = tmp_path / "outputs"
    left = [path for path in outputs.iterdir() if path.name != ".launches"] if outputs.exists() else []
    assert not left, [sorted(p.relative_to(tmp_path) for p in path.rglob("*")) for path in left]


# One case of each kind of startup check (train.check_startup): the config's values, the model against the
# data, FSDP's blocks, the best/objective settings, the schedule, a resume (here FSDP's DCP shapes).
# mode=eval's checks of its checkpoint run in the workers (evaluate.py): their refusal reaches the
# launcher as a result, and it prints the one line.
SELF_LAUNCHED = ["zero_lr", "image_the_model_cannot_take", "fsdp_block_type_the_model_lacks", "misspelt_objective_metric",
                 "warmup_longer_than_the_run", "fsdp_resuming_a_sharded_checkpoint_of_another_width", "eval_of_a_split_the_data_lacks"]
FOUND_IN_WORKERS = ["eval_of_a_split_the_data_lacks"]


@pytest.mark.parametrize("case", SELF_LAUNCHED)
def test_startup_checks_refuse_a_self_launch_in_one_line_before_any_worker(tmp_path, case):
    """`python train.py strategy=ddp|fsdp strategy.nproc_per_node=2 ...`: the launcher runs the startup checks
    at the launch's world size, so a refused config prints the one `error:` line, exits 1, starts no worker
    (but for a refusal only the workers can find) and leaves no run dir."""
    result = _refused_on_the_command_line(case, tmp_path, strategy=("strategy=ddp", "strategy.nproc_per_node=2"))
    assert ("DDP workers" in result.stdout) == (case in FOUND_IN_WORKERS), result.stdout  # launch_workers' first line
    assert_nothing_trained(tmp_path, result)
    assert_no_run_dir_left(tmp_path)


# One case of each kind of Hydra error: an unknown option of a group, a mistyped value, an undeclared key.
HYDRA_ERRORS = {
    "unknown_model": (["model=nope"], "Could not find 'model/nope'"),
    "batch_size_not_an_int": (QUICK + ["data.batch_size=abc"], "data.batch_size"),
    "override_of_undeclared_key": (QUICK + ["trainer.typo=1"], "trainer.typo"),
}


@pytest.mark.parametrize("args, expected", HYDRA_ERRORS.values(), ids=HYDRA_ERRORS.keys())
def test_composition_errors_name_what_is_wrong(args, expected):
    """Hydra rejects unknown options and mistyped values while composing, naming them, in process."""
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        with pytest.raises(ConfigCompositionException) as error:
            compose("config", overrides=args)
    assert expected in str(error.value), str(error.value)


def test_a_composition_error_fails_before_the_run_dir_exists(tmp_path):
    """On the command line (as Hydra reports any composition error): its message naming the key, no
    traceback, and no run dir made."""
    args, expected = HYDRA_ERRORS["override_of_undeclared_key"]
    result = launch(args, cwd=tmp_path, timeout=120)
    assert result.returncode != 0, _output(result)
    assert expected in result.stderr, result.stderr
    assert "Traceback" not in _output(result), _output(result)
    assert not (tmp_path / "outputs").exists(), "a run dir was created for a config that does not compose"


def _free_port() -> int:
    with socket.socket() as sock:  # a free port, so a concurrent torchrun on 29500 can't collide
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_download_with_several_ranks_is_refused_on_every_rank(tmp_path):
    """Several ranks downloading into one folder would race; each rank stops before any side effect."""
    result = launch(["trainer.max_epochs=1", "strategy=ddp", "data=cifar10", f"data.root={tmp_path / 'cifar'}", "data.download=true"],
                    cwd=tmp_path, nproc=2, env={"PET_MASTER_PORT": str(_free_port())}, timeout=180)
    assert result.returncode != 0, _output(result)
    ours = [line for line in _output(result).splitlines() if line.startswith("error: ")]
    assert len(ours) == 1, _output(result)  # every rank refuses alike: rank 0 says it
    assert ours[0].startswith("error: data.download=true: download with one process first"), ours
    assert not (tmp_path / "cifar").exists()
    assert_nothing_trained(tmp_path, result, under_torchrun=True)
    assert_no_run_dir_left(tmp_path)


def _torchrun(torchrun_args: list[str], args: list[str], cwd: Path, share_store: bool = False) -> subprocess.Popen:
    """torchrun with `torchrun_args` running train.py `args` in cwd, its output piped (stderr into stdout)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env |= {"PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0" if share_store else "1"}
    return subprocess.Popen([str(TORCHRUN), *torchrun_args, str(TRAIN), *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _our_lines_and_no_traceback_of_ours(output: str) -> list[str]:
    """The `error:` lines of a torchrun launch's output, which holds no frame of ours or Hydra's (torchrun's
    own ChildFailedError traceback, which names the failed ranks, is torchrun's)."""
    assert f'File "{TRAIN}"' not in output and "site-packages/hydra/" not in output and "Error executing job" not in output, output
    return [line for line in output.splitlines() if line.startswith("error: ")]


# A slow rank 0 (a busy host): held 2 s inside Hydra's start of the job, after it made the run dir and
# before it opens its log file there (tests/workers/slow_start.py), while rank 1 is refused; torchrun's
# agent looks at its workers every 5 s, so rank 1's exit doesn't get rank 0 stopped before it wakes up.
RANK_0_HELD_BACK = ["+hydra.callbacks.slow_start._target_=tests.workers.slow_start.SlowStart",
                    "+hydra.job_logging.slow_start=${rank_zero_sleeps:2}"]


@pytest.mark.parametrize("torchrun_args, extra, share_store", [
    (["--nproc_per_node=2"], [], True),  # the ranks compare outcomes through torchrun's store
    (["--nproc_per_node=2"], [], False),  # through claim files
    (["--nproc_per_node=2", "--monitor-interval=5"], RANK_0_HELD_BACK, False),
], ids=["shared_store", "claim_files", "rank_0_held_back"])
def test_a_refusal_every_rank_meets_is_one_line_under_torchrun(tmp_path, torchrun_args, extra, share_store):
    """`torchrun --nproc_per_node=2 train.py model.channelz=3`: both ranks are refused alike; rank 0 alone
    prints the line, however the ranks are timed. With rank 0 held back, rank 1 is refused while rank 0 is
    still inside Hydra's start; had rank 1 removed the run dir then, rank 0 would die with Hydra's
    FileNotFoundError traceback instead. No run dir is left."""
    process = _torchrun(torchrun_args, [*QUICK, "strategy=ddp", "model.channelz=3", *extra], tmp_path, share_store)
    output, _ = process.communicate(timeout=180)
    assert process.returncode != 0, output
    assert _our_lines_and_no_traceback_of_ours(output) == [
        "error: model.channelz: unknown key, not an option of models.small_cnn.SmallCNN (did you mean model.channels? "
        "options: channels, dropout, norm); check the spelling"], output
    assert_no_run_dir_left(tmp_path)


def test_a_refusal_on_one_node_only_is_printed_there_once(tmp_path):
    """Two torchrun "nodes" of 2 ranks each (static rendezvous, one working dir: a shared filesystem), whose data
    is node-local (`data.root=.../node${oc.env:GROUP_RANK}`), and node 1 lacks it: node 1's ranks are refused
    alike and rank 2 prints the line once, while node 0's ranks pass their checks and wait for their process
    group, which never comes (the test stops them). No run dir is left."""
    from conftest import free_port, write_imagefolder

    write_imagefolder(tmp_path / "node0")
    port = free_port()
    args = ["strategy=ddp", "data=imagefolder", f"data.root={tmp_path}/node${{oc.env:GROUP_RANK}}", "data.batch_size=2",
            "trainer.max_epochs=1"]
    nodes = [_torchrun(["--nnodes=2", "--nproc-per-node=2", f"--node-rank={node}", "--master-addr=127.0.0.1",
                        f"--master-port={port}"], args, tmp_path, share_store=True) for node in (0, 1)]
    try:
        node_1_output, _ = nodes[1].communicate(timeout=180)
        nodes[0].terminate()
        node_0_output, _ = nodes[0].communicate(timeout=60)
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.communicate()
    assert nodes[1].returncode != 0, node_1_output
    (line,) = _our_lines_and_no_traceback_of_ours(node_1_output)
    assert line == f"error: data.root={tmp_path}/node1: no such directory; point data.root at the dataset's folder", line
    assert not _our_lines_and_no_traceback_of_ours(node_0_output), node_0_output
    assert_no_run_dir_left(tmp_path)


def test_torchrun_without_a_launch_id_or_shared_store_says_how_to_fix_it(tmp_path):
    """--rdzv-endpoint without --rdzv-id gives the launch the id `none`; with the shared store off the
    ranks could not agree on a run dir, so each stops with one line before Hydra makes one. (One rank
    shows it: every rank of such a launch stops the same way.)"""
    command = [str(TORCHRUN), "--nproc_per_node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}", str(TRAIN), *QUICK, "strategy=ddp"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=180,
                            env=os.environ | {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert result.returncode != 0, _output(result)
    ours = [line for line in _output(result).splitlines() if line.startswith("error: ")]
    # torchrun stops the other rank once one has failed, so it may not get to print its own line
    assert 1 <= len(ours) <= 2 and all("pass --rdzv-id=<unique id> to torchrun" in line for line in ours), _output(result)
    assert not list(tmp_path.rglob("*.log"))  # Hydra never got to make the run dir
    assert_nothing_trained(tmp_path, result, under_torchrun=True)


def test_single_strategy_under_torchrun_points_to_ddp(tmp_path, monkeypatch):
    """A rank of `torchrun --nproc_per_node=2` with strategy=single stops with a hint to use strategy=ddp
    (train.run in this process, with the variables torchrun sets for rank 0). The same check as
    data.download's above, which shows how its line reads under torchrun, on every rank."""
    monkeypatch.chdir(tmp_path)
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(name, value)
    line = config_error_in_this_process(QUICK + ["strategy=single"], tmp_path / "outputs" / "run")
    assert "strategy=single runs one process, but 2 were started" in line and "use strategy=ddp" in line, line
    assert not list(tmp_path.rglob("*.pt"))
