"""data=hf: a Hugging Face `datasets` DatasetDict saved with save_to_disk, or Parquet files, read from local
disk as a map-style dataset. Made of a JPEG ImageFolder's files in ImageFolder's order, it trains to
bit-identical weights as data=imagefolder with augmentation on (the same bytes decoded the same way, the
same per-sample draws); its Parquet files train the same; mode=eval of its val split is exact at 1 and 3
ranks; bad input is one `error:` line naming the key, before anything starts."""

import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import (REPO, TRAIN, assert_same_weights, check, final_weights, launch, results_of, run_dirs,
                      run_in_this_process, shared_run)
from test_bad_input import assert_no_run_dir_left, assert_nothing_trained
from test_sample_seeds import write_photo_imagefolder

# 32 training JPEGs (16 a class), 14 for validation (7 a class: uneven over 3 ranks)
PER_CLASS = {"train": 16, "val": 7}
# augment=standard (random resized crop and flip), 2 epochs of 4 steps, as in tests/test_sample_seeds.py
TRAINING = ["data.image_size=16", "data.batch_size=8", "model.channels=[8,16]", "trainer.max_epochs=2",
            "checkpoint.keep_best=0", "trainer.log_every_n_steps=1"]


def hf_splits(imagefolder: Path, label_shift: int = 0):
    """{"train", "validation"} Datasets of the ImageFolder's files (their bytes, in ImageFolder's order)
    and labels, with a ClassLabel of its class folders, as a user would convert one."""
    import datasets
    from torchvision.datasets import ImageFolder

    splits = {}
    for folder, name in (("train", "train"), ("val", "validation")):
        images = ImageFolder(str(imagefolder / folder))
        features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=images.classes)})
        splits[name] = datasets.Dataset.from_dict(
            {"image": [{"bytes": Path(path).read_bytes(), "path": None} for path, _ in images.samples],
             "label": [label - label_shift * (name == "validation") for _, label in images.samples]},
            features=features)
    return splits


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[str, Path]:
    """The ImageFolder, its DatasetDict saved with save_to_disk, and the same as Parquet files (train in
    two shards, validation in one file), once for all test processes."""
    def produce(cwd: Path) -> dict:
        import datasets

        write_photo_imagefolder(cwd / "imagefolder", PER_CLASS)
        splits = hf_splits(cwd / "imagefolder")
        datasets.DatasetDict(splits).save_to_disk(str(cwd / "saved"))
        (cwd / "parquet").mkdir()
        for shard in range(2):
            file = cwd / "parquet" / f"train-0000{shard}-of-00002.parquet"
            splits["train"].shard(2, shard, contiguous=True).to_parquet(str(file))
        splits["validation"].to_parquet(str(cwd / "parquet" / "validation.parquet"))
        return {}

    cwd, _ = shared_run("hf_stores", produce, tmp_path_factory)
    return {name: cwd / name for name in ("imagefolder", "saved", "parquet")}


@pytest.fixture(scope="module")
def trained(stores, tmp_path_factory) -> dict[str, Path]:
    """Each store trained with the same seed, by train.run in a test process (a launch costs seconds of
    start-up), data=hf in 2 DataLoader workers (the dataset pickled to them), data=imagefolder in none;
    the Parquet files launched, with datasets' cache (where Parquet becomes Arrow) in the run's folder.
    Their run dirs."""
    def produce(cwd: Path) -> dict:
        with pytest.MonkeyPatch.context() as monkeypatch:
            monkeypatch.chdir(cwd)
            run_in_this_process(["data=imagefolder", f"data.root={stores['imagefolder']}", "data.num_workers=0", *TRAINING],
                                cwd / "imagefolder")
            run_in_this_process(["data=hf", f"data.path={stores['saved']}", "data.num_workers=2", *TRAINING], cwd / "saved")
        (cwd / "parquet").mkdir()
        check(launch(["data=hf", f"data.path={stores['parquet']}", "data.num_workers=0", *TRAINING], cwd / "parquet",
                     env={"HF_DATASETS_CACHE": str(cwd / "parquet" / "cache")}))
        return {}

    cwd, _ = shared_run("hf_trained", produce, tmp_path_factory)
    (parquet,) = run_dirs(cwd / "parquet")
    return {"imagefolder": cwd / "imagefolder", "saved": cwd / "saved", "parquet": parquet, "cache": cwd / "parquet" / "cache"}


def test_save_to_disk_trains_to_the_weights_of_its_imagefolder(trained):
    """The same JPEG bytes decoded as ImageFolder decodes its files, and each sample's crop and flip drawn
    from its own seed: bit-identical weights, with augmentation on."""
    assert results_of(trained["saved"])["steps"] == results_of(trained["imagefolder"])["steps"] == 8
    assert_same_weights(final_weights(trained["saved"]), final_weights(trained["imagefolder"]))


def test_parquet_files_train_as_the_saved_dataset(trained):
    """train-0000{0,1}-of-00002.parquet read in order are the train split; validation.parquet the val
    split; made Arrow in HF_DATASETS_CACHE, not beside the files."""
    assert_same_weights(final_weights(trained["parquet"]), final_weights(trained["saved"]))
    assert results_of(trained["parquet"])["val_samples"] == 14
    assert list(trained["cache"].rglob("*.arrow"))


def test_eval_of_the_val_split_is_exact_at_1_and_3_ranks(stores, trained, tmp_path):
    """mode=eval of the save_to_disk run on its validation split (14 samples, 5 + 5 + 4 on 3 ranks): the
    same count and accuracy in 1 process and on 3 ranks, and as the training's last validation. The 3
    ranks read the Parquet files with an empty cache, so they make its Arrow files all at once."""
    evaluation = ["mode=eval", "data=hf", "data.num_workers=0", f"resume={trained['saved']}", *TRAINING]
    run_in_this_process([*evaluation, f"data.path={stores['saved']}", "strategy=single"], tmp_path / "single")
    (tmp_path / "ddp_cwd").mkdir()
    check(launch([*evaluation, f"data.path={stores['parquet']}", "strategy=ddp"], tmp_path / "ddp_cwd", nproc=3,
                 env={"HF_DATASETS_CACHE": str(tmp_path / "cache")}))
    (three_ranks,) = run_dirs(tmp_path / "ddp_cwd")
    single, ddp = (json.loads((run / "eval.json").read_text()) for run in (tmp_path / "single", three_ranks))
    training = results_of(trained["saved"])
    assert (single["world_size"], ddp["world_size"]) == (1, 3)
    assert single["val_samples"] == ddp["val_samples"] == training["val_samples"] == 14
    assert single["val_accuracy"] == ddp["val_accuracy"] == training["val_accuracy"]


def _unlabelled_validation(tmp_path: Path, stores: dict) -> Path:
    """A DatasetDict whose validation labels are one lower: its first class's samples get -1, the
    ClassLabel's "no label" (as the Hub's test splits have)."""
    import datasets

    datasets.DatasetDict(hf_splits(stores["imagefolder"], label_shift=1)).save_to_disk(str(tmp_path / "unlabelled"))
    return tmp_path / "unlabelled"


# (overrides after data=hf, the key and message the one line names, setup giving data.path where not `saved`)
BAD_INPUT = {
    "missing_path": (["data.path={tmp}/missing"], "data.path={tmp}/missing", "no such directory", None),
    "hub_name": (["data.path=imagenet-1k"], "data.path=imagenet-1k", ("nothing is downloaded", "save_to_disk"), None),
    "missing_split": (["data.path={saved}", "data.val_split=valid"], "data.val_split=valid",
                      "has no such split (splits: train, validation)", None),
    "missing_image_column": (["data.path={saved}", "data.image_column=img"], "data.image_column=img",
                             "no such column (columns: image, label)", None),
    "missing_label_column": (["data.path={saved}", "data.label_column=target"], "data.label_column=target",
                             "no such column (columns: image, label)", None),
    "label_outside_the_classes": (["data.path={dir}"], "data.label_column=label",
                                  "the validation split holds label -1, outside [0, 2)", _unlabelled_validation),
}


@pytest.mark.parametrize("args, key, message, setup", BAD_INPUT.values(), ids=BAD_INPUT.keys())
def test_bad_input_is_one_line_naming_the_key_before_anything_starts(stores, tmp_path, args, key, message, setup):
    folder = setup(tmp_path, stores) if setup else None
    values = {"tmp": tmp_path, "saved": stores["saved"], "dir": folder}
    result = launch(["data=hf", "data.num_workers=0", *[arg.format(**values) for arg in args], *TRAINING], tmp_path,
                    timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for part in (key.format(**values), *((message,) if isinstance(message, str) else message)):
        assert part in lines[0], lines[0]
    assert_nothing_trained(tmp_path, result)
    assert_no_run_dir_left(tmp_path)


def test_without_datasets_installed_data_hf_names_the_install_command(stores, tmp_path):
    """train.py in a Python environment without `datasets`: the site-packages minus its, linked."""
    (site_packages,) = [Path(p) for p in site.getsitepackages() if Path(p, "torch").exists()]
    without = tmp_path / "site-packages"
    without.mkdir()
    for entry in site_packages.iterdir():
        if not entry.name.lower().startswith("datasets"):
            (without / entry.name).symlink_to(entry)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": f"{REPO}{os.pathsep}{without}"}
    result = subprocess.run([sys.executable, "-S", str(TRAIN), "data=hf", f"data.path={stores['saved']}", *TRAINING],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == ["error: data=hf: datasets is not installed; install it with: "
                                                  "pip install -e '.[hf]'"], result.stderr
    assert_no_run_dir_left(tmp_path)
