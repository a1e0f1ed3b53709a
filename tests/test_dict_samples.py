"""A dataset whose samples are dicts, {"image": ..., "label": ...}, in a user's own module (docs/tasks.md,
Batches): it trains, resumes and evaluates as the same samples as (image, label) tuples do, bit for bit,
through the command line: 2 DDP ranks stopped by trainer.max_steps and resumed, every sample trained
once per epoch (fault.record_samples_dir), then mode=eval of the run; MixUp/CutMix, task=simclr's
two views (data.views=2), and task=segmentation with the mask as the label. A dict without the "image" (or, for the default task steps, "label") key
is refused in one line that names its keys, with no run dir left behind."""

import json
import os
from pathlib import Path

import pytest

from conftest import EXACT_DDP, TINY, check, last_checkpoint, launch, results_of, run_dirs, run_in_this_process
from test_bad_input import assert_no_run_dir_left, assert_nothing_trained
from test_fault_tolerance import assert_bit_identical

# A user's dataset module, as a user would write one: the synthetic data (data/synthetic.py, so the
# data=synthetic keys are its options) with each sample a dict; image_key and label_key name its keys.
DICT_SAMPLES = '''
import dataclasses

from torch.utils.data import Dataset

from data import DataSplits
from data.shapes import build_shapes
from data.synthetic import build_synthetic


class DictSamples(Dataset):
    """Each (image, label) of `base` as {image_key: image, label_key: label}."""

    def __init__(self, base, image_key, label_key):
        self.base, self.image_key, self.label_key = base, image_key, label_key

    def __len__(self):
        return len(self.base)

    def __getitem__(self, index):
        image, label = self.base[index]
        return {self.image_key: image, self.label_key: label}


def as_dicts(splits: DataSplits, image_key: str, label_key: str) -> DataSplits:
    return dataclasses.replace(splits, train=DictSamples(splits.train, image_key, label_key),
                               val=DictSamples(splits.val, image_key, label_key))


def build(num_samples: int, num_val_samples: int, image_size: int, num_classes: int, channels: int, data_seed: int,
          augment: bool = False, views: int = 1, image_key: str = "image", label_key: str = "label") -> DataSplits:
    """data=synthetic's samples as dicts."""
    splits = build_synthetic(num_samples, num_val_samples, image_size, num_classes, channels, data_seed, augment, views)
    return as_dicts(splits, image_key, label_key)


def build_masks(num_samples: int, num_val_samples: int, image_size: int, num_classes: int, data_seed: int,
                augment: bool = True, max_shapes: int = 3) -> DataSplits:
    """data=shapes' samples (image, mask) as dicts, the mask as the label."""
    splits = build_shapes(num_samples, num_val_samples, image_size, num_classes, data_seed, augment, max_shapes)
    return as_dicts(splits, "image", "label")
'''
DICT_DATA = "data._target_=dict_samples.build"  # on top of data=synthetic (TINY), whose keys are its options
DICT_MASKS = "data._target_=dict_samples.build_masks"  # on top of data=shapes


def user_module(directory: Path) -> dict:
    """dict_samples.py written in `directory`; the env that puts it on a launch's path."""
    (directory / "dict_samples.py").write_text(DICT_SAMPLES)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(directory), os.environ.get("PYTHONPATH")]))}


def trained_ids_per_epoch(directory: Path) -> dict[int, list[int]]:
    """The dataset indices every rank trained, per epoch, over every launch that recorded into `directory`."""
    epochs: dict[int, list[int]] = {}
    for path in directory.glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            epochs.setdefault(record["epoch"], []).extend(record["ids"])
    return epochs


def test_dict_samples_train_resume_and_evaluate_on_2_ranks_as_tuple_samples_do(exact_ddp_reference, tmp_path):
    """EXACT_DDP (2 ranks, SyncBN, dropout, augmentation in 2 loader workers per rank) on dict samples,
    stopped at step 5 by trainer.max_steps and resumed by torchrun: bit-identical to the tuple-sample
    run (exact_ddp_reference), each sample trained once per epoch; mode=eval of its run dir reports the
    run's val metrics."""
    env = user_module(tmp_path)
    args = [*EXACT_DDP, DICT_DATA, "fault.record_samples_dir=samples"]
    check(launch([*args, "trainer.max_steps=5"], tmp_path, nproc=2, env=env))
    (run_dir,) = run_dirs(tmp_path)
    check(launch([*args, f"resume={run_dir}"], tmp_path, nproc=2, env=env))
    assert_bit_identical(last_checkpoint(run_dir), exact_ddp_reference[1])
    trained = trained_ids_per_epoch(tmp_path / "samples")
    assert {epoch: sorted(ids) for epoch, ids in trained.items()} == {0: list(range(128)), 1: list(range(128))}

    check(launch([*TINY, DICT_DATA, "mode=eval", f"resume={run_dir}"], tmp_path, env=env))
    evaluated = json.loads(next((tmp_path / "outputs").rglob("eval.json")).read_text())
    results = results_of(run_dir)
    assert (evaluated["val_accuracy"], evaluated["val_samples"]) == (results["val_accuracy"], 37)
    assert evaluated["val_loss"] == pytest.approx(results["val_loss"], rel=1e-6)


ONE_PROCESS = [*TINY, "trainer.max_epochs=1"]
FEATURES = {
    "mixup_and_cutmix": ([*ONE_PROCESS, "data.mixup_alpha=0.4", "data.cutmix_alpha=1.0"], DICT_DATA),
    "simclr_views": ([*ONE_PROCESS, "task=simclr", "data.views=2", "data.augment=true"], DICT_DATA),
    # the masks as labels, and the image grid of each validation (log_validation reads val samples)
    "segmentation": (["task=segmentation", "data=shapes", "model=small_segnet", "model.width=8", "data.image_size=24",
                      "data.num_samples=32", "data.num_val_samples=8", "trainer.max_epochs=1"], DICT_MASKS),
}


@pytest.mark.parametrize("args, dict_data", FEATURES.values(), ids=FEATURES.keys())
def test_dict_samples_train_as_tuple_samples_do(args, dict_data, tmp_path, monkeypatch):
    """One process on the command line, the dict samples; the same samples as tuples in this process:
    the same final weights, optimizer state, RNG states and position."""
    env = user_module(tmp_path)
    check(launch([*args, dict_data], tmp_path, env=env))
    (dict_run,) = run_dirs(tmp_path)
    monkeypatch.chdir(tmp_path)
    run_in_this_process(args, tmp_path / "tuple_run")
    assert_bit_identical(last_checkpoint(dict_run), last_checkpoint(tmp_path / "tuple_run"))


REFUSED = {
    "no_image_key": ([], "+data.image_key=img", "data: a sample is a dict with keys ['img', 'label'], and its image is "
                     "looked for as element 0 of a tuple or list, or as a dict's 'image'; "),
    "no_label_key": ([], "+data.label_key=y", "data: a batch is a dict with keys ['image', 'y']; the task reads a dict "
                     "batch's 'image' and 'label': "),
    "no_image_key_in_mode_eval": (["mode=eval"], "+data.image_key=img", "data: a sample is a dict with keys ['img', 'label']"),
}


@pytest.mark.parametrize("mode, keys, message", REFUSED.values(), ids=REFUSED.keys())
def test_a_dict_sample_without_its_image_or_label_is_one_line_and_leaves_no_run_dir(mode, keys, message, tmp_path,
                                                                                      monkeypatch):
    env = user_module(tmp_path)
    if mode:  # a checkpoint to evaluate, from the same data as tuples
        monkeypatch.chdir(tmp_path)
        run_in_this_process([*ONE_PROCESS, "trainer.max_steps=1"], tmp_path / "trained")
        mode = [*mode, f"resume={tmp_path / 'trained'}"]
    cwd = tmp_path / "launch"
    cwd.mkdir()
    result = launch([*ONE_PROCESS, DICT_DATA, keys, *mode], cwd, env=env)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), result.stderr
    assert lines[0].endswith("(docs/tasks.md#batches)"), lines[0]
    assert_nothing_trained(cwd, result)
    assert_no_run_dir_left(cwd)
