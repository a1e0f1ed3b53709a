"""Per-sample randomness, through real runs (ddp/loading/sample_seeds.py): each sample's augmentation is
a function of (seed, epoch, sample) alone. So, with augmentation on: 2 ranks x 8 with SyncBN train what
1 process x 16 trains, whatever the loader workers; a run resumed at another world size ends where the
uninterrupted one does, within float noise; and a run killed mid-epoch, resumed with other loader
workers, ends bit-identical to the uninterrupted run, for classification on JPEGs, segmentation's joint
transforms and SimCLR's two views. (The loaders' own properties, each sample loaded once and nothing
before a resume point: tests/test_loaders.py and tests/test_fault_tolerance.py.)"""

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import check, final_weights, launch, results_of, run_dirs, run_in_this_process, shared_run
from test_fault_tolerance import assert_bit_identical, last_checkpoint


def write_photo_imagefolder(root: Path, per_class: dict[str, int], size=(48, 40)) -> Path:
    """An ImageFolder of JPEGs cut from scikit-learn's two bundled photos, one class per photo: crops at
    random places, re-encoded at quality 90, as photos are stored (no download)."""
    from sklearn.datasets import load_sample_images

    rng = np.random.default_rng(0)
    photos = load_sample_images()
    for split, count in per_class.items():
        for name, photo in zip(("china", "flower"), photos.images):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                top, left = rng.integers(0, photo.shape[0] - size[1]), rng.integers(0, photo.shape[1] - size[0])
                crop = photo[top:top + size[1], left:left + size[0]]
                Image.fromarray(crop).save(folder / f"{i}.jpg", quality=90)
    return root


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """64 training JPEGs (32 a class) and 16 for validation, once for all test processes."""
    def produce(cwd: Path) -> dict:
        write_photo_imagefolder(cwd / "photos", {"train": 32, "val": 8})
        return {}

    return shared_run("photo_imagefolder", produce, tmp_path_factory)[0] / "photos"


def classification(root: Path) -> list[str]:
    """imagefolder's default preset (augment=standard: a random resized crop and flip), SyncBN's model."""
    return ["data=imagefolder", f"data.root={root}", "data.image_size=16", "model.channels=[8,16]", "trainer.max_epochs=2",
            "checkpoint.keep_best=0", "trainer.log_every_n_steps=1"]


# float32 noise: torch.testing.assert_close's absolute tolerance, as the other invariance tests take it
NOISE_FLOOR = 1e-5


def max_difference(weights: dict, reference: dict) -> float:
    assert weights.keys() == reference.keys()
    return max((weights[key].double() - reference[key].double()).abs().max().item()
               for key in reference if reference[key].is_floating_point())


@pytest.fixture(scope="module")
def two_ranks_and_one_process(photos, tmp_path_factory) -> dict[str, Path]:
    """On the JPEGs, with augmentation: "ranks", 2 ranks x 8 with SyncBN loading in 2 workers each, 8
    updates; "one", 1 process x 16 loading in itself; "elastic", 2 ranks x 8 without workers stopped
    at update 3 (inside the first epoch), then resumed in 1 process x 16 with 2 workers. Their run dirs."""
    def produce(cwd: Path) -> dict:
        args = ["syncbn=true", *classification(photos)]
        for name in ("ranks", "elastic"):
            (cwd / name).mkdir()
        check(launch(["strategy=ddp", *args, "data.batch_size=8", "data.num_workers=2"], cwd / "ranks", nproc=2))
        check(launch(["strategy=ddp", *args, "data.batch_size=8", "data.num_workers=0", "trainer.max_steps=3"],
                     cwd / "elastic", nproc=2))
        (stopped,) = run_dirs(cwd / "elastic")
        with pytest.MonkeyPatch.context() as monkeypatch:
            monkeypatch.chdir(cwd)
            run_in_this_process(["strategy=single", *args, "data.batch_size=16", "data.num_workers=0"], cwd / "one")
            run_in_this_process(["strategy=single", *args, "data.batch_size=16", "data.num_workers=2", f"resume={stopped}"],
                                stopped)
        return {}

    cwd, _ = shared_run("photos_two_ranks_and_one_process", produce, tmp_path_factory)
    return {"ranks": run_dirs(cwd / "ranks")[0], "one": cwd / "one", "elastic": run_dirs(cwd / "elastic")[0]}


def test_two_ranks_of_8_train_what_one_process_of_16_does_with_augmentation_and_any_workers(two_ranks_and_one_process):
    """Each JPEG gets the same crop and flip however many ranks and workers load it, so with SyncBN the
    2-rank run (2 workers a rank) ends within float noise of the one process (no workers)."""
    ranks, one = (two_ranks_and_one_process[name] for name in ("ranks", "one"))
    assert results_of(ranks)["steps"] == results_of(one)["steps"] == 8
    worst = max_difference(final_weights(ranks), final_weights(one))
    assert worst < NOISE_FLOOR, worst


def test_a_resume_at_another_world_size_ends_where_the_uninterrupted_run_does(two_ranks_and_one_process):
    """2 ranks x 8 stopped mid-epoch, continued as 1 process x 16 (the global batch held through the
    per-process batch): the same samples with the same draws, so within float noise of the 2-rank run."""
    ranks, elastic = (two_ranks_and_one_process[name] for name in ("ranks", "elastic"))
    assert (results_of(elastic)["world_size"], results_of(elastic)["steps"]) == (1, 8)
    worst = max_difference(final_weights(elastic), final_weights(ranks))
    assert worst < NOISE_FLOOR, worst


# --- killed mid-epoch, resumed with other loader workers -------------------------------------------------

# Each training: 8 updates over 2 epochs; killed at update 6 with the checkpoint of update 5 (inside the
# second epoch) saved, then resumed with 2 loader workers where the killed run loaded in itself.
KILLED = ["checkpoint.every_n_steps=5", "fault.kill_rank=0", "fault.at_step=6"]
TASKS = {
    "classification": lambda photos: classification(photos) + ["data.batch_size=16"],
    "segmentation": lambda photos: ["task=segmentation", "data=shapes", "model=small_segnet", "model.width=8",
                                    "data.image_size=24", "data.num_samples=32", "data.num_val_samples=8",
                                    "data.batch_size=8", "trainer.max_epochs=2", "checkpoint.keep_best=0"],
    "simclr": lambda photos: ["task=simclr", "data=synthetic", "data.views=2", "data.augment=true", "data.num_samples=64",
                              "data.num_val_samples=16", "data.image_size=8", "model.channels=[8,16]",
                              "data.batch_size=16", "trainer.max_epochs=2", "checkpoint.keep_best=0"],
}


@pytest.mark.parametrize("task", TASKS)
def test_a_run_killed_mid_epoch_resumes_with_other_workers_bit_identically(task, photos, tmp_path, monkeypatch):
    """The augmentation is on (classification's random resized crop and flip, segmentation's joint
    resize, crop and flip, SimCLR's two views of crop, flip and blur): the uninterrupted run loads in
    itself; the killed run's resume loads in 2 workers, and ends with the same weights, bit for bit."""
    args = ["strategy=single", *TASKS[task](photos), "data.num_workers=0"]
    monkeypatch.chdir(tmp_path)
    run_in_this_process(args, tmp_path / "uninterrupted")
    uninterrupted = last_checkpoint(tmp_path / "uninterrupted")
    assert uninterrupted["global_step"] == 8

    killed = launch([*args, *KILLED], tmp_path)
    assert killed.returncode != 0, killed.stderr[-3000:]
    (run_dir,) = run_dirs(tmp_path)
    assert (last_checkpoint(run_dir)["global_step"], last_checkpoint(run_dir)["epoch"]) == (5, 1)
    check(launch([*args, "data.num_workers=2", f"resume={run_dir}"], tmp_path))
    assert_bit_identical(last_checkpoint(run_dir), uninterrupted)
