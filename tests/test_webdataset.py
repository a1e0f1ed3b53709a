"""data=webdataset and python -m data.shards (data/webdataset.py, data/shards.py), through the real command
lines: an ImageFolder converted to shards trains to the folder's bit-identical weights with augmentation
on; the converter's printed overrides run as printed through bash; shards written by `tar` train, their
index built on first use; an interrupted conversion is refused and written again; every bad input is one
`error:` line before anything starts; mode=eval on the shards is exact at 1 and 3 ranks."""

import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import tarfile
import zlib
from pathlib import Path

import pytest

from conftest import (REPO, TRAIN, assert_same_weights, check, final_weights, launch, results_of, run_dirs,
                      run_in_this_process, shared_run)
from test_sample_seeds import photos, write_photo_imagefolder  # noqa: F401 (photos: the shared JPEG ImageFolder)

SMALL = ["data.image_size=16", "model.channels=[8,16]", "checkpoint.keep_best=0", "data.batch_size=16",
         "trainer.max_epochs=1", "trainer.max_steps=3"]


def convert(out_dir: Path, overrides: list[str], samples_per_shard: int, cwd: Path) -> subprocess.CompletedProcess:
    """python -m data.shards, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "data.shards", str(out_dir), *overrides,
                           f"--samples-per-shard={samples_per_shard}"],
                          cwd=REPO, capture_output=True, text=True, timeout=180)


def printed_overrides(result: subprocess.CompletedProcess) -> str:
    """The overrides after `python train.py` on the converter's last line."""
    return result.stdout.strip().splitlines()[-1].split("python train.py ", 1)[1]


def run_through_bash(overrides: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """train.py with the converter's printed overrides pasted into a bash command line."""
    return subprocess.run(["bash", "-c", f"{sys.executable} {TRAIN} {overrides} {' '.join(args)}"], cwd=cwd,
                          capture_output=True, text=True, timeout=180)


def one_error_line(result: subprocess.CompletedProcess, cwd: Path) -> str:
    """The refusal's line: exit 1, one `error:` line and no traceback on stderr, no run dir left."""
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert not run_dirs(cwd)
    return errors[0]


@pytest.fixture(scope="module")
def trained(photos, tmp_path_factory) -> dict:  # noqa: F811
    """The photos converted to 3 train shards (24, 24, 16 samples) and a val shard; 3 augmented updates
    on the folder (train.run here) and on the shards (the printed overrides through bash, 2 loader
    workers); then mode=eval of the shards' checkpoint at 1 process and 3 ranks. Once for all test processes."""
    def produce(cwd: Path) -> dict:
        conversion = convert(cwd / "shards", ["data=imagefolder", f"data.root={photos}"], 24, cwd)
        check(conversion)
        overrides = printed_overrides(conversion)
        (cwd / "shards_run").mkdir()
        check(run_through_bash(overrides, [*SMALL, "data.num_workers=2"], cwd / "shards_run"))
        (shards_run,) = run_dirs(cwd / "shards_run")
        with pytest.MonkeyPatch.context() as monkeypatch:
            monkeypatch.chdir(cwd)
            run_in_this_process(["data=imagefolder", f"data.root={photos}", *SMALL, "data.num_workers=0"], cwd / "folder_run")
            webdataset = ["data=webdataset", f"data.train_shards='{cwd}/shards/train-{{000000..000002}}.tar'",
                          f"data.val_shards={cwd}/shards/val-000000.tar", "data.image_size=16", "model.channels=[8,16]", "data.num_workers=0",
                          f"resume={shards_run}"]
            run_in_this_process(["mode=eval", "strategy=single", *webdataset], cwd / "eval_one")
        (cwd / "eval_three").mkdir()
        check(launch(["mode=eval", "strategy=ddp", *webdataset], cwd / "eval_three", nproc=3))
        return {"conversion": conversion.stdout + conversion.stderr, "overrides": overrides,
                "shards_run": str(shards_run), "eval_three": str(run_dirs(cwd / "eval_three")[0])}

    cwd, runs = shared_run("webdataset_trained", produce, tmp_path_factory)
    return {**runs, "cwd": cwd, "shards": cwd / "shards", "folder_run": cwd / "folder_run", "eval_one": cwd / "eval_one"}


def test_the_converter_writes_every_sample_in_order_with_its_index_and_manifest(trained, photos):  # noqa: F811
    shards = trained["shards"]
    manifest = json.loads((shards / "dataset.json").read_text())
    names = ["train-000000.tar", "train-000001.tar", "train-000002.tar"]
    assert manifest["splits"]["train"] == {"shards": names, "samples": [24, 24, 16],
                                           "bytes": [(shards / name).stat().st_size for name in names],
                                           "crc32": [f"{zlib.crc32((shards / name).read_bytes()):08x}" for name in names]}
    assert manifest["splits"]["val"]["samples"] == [16] and manifest["class_names"] == ["china", "flower"]
    assert not list(shards.glob("*.tmp")) and not (shards / "dataset.partial.json").exists()
    with tarfile.open(shards / "train-000001.tar") as archive:  # sample 24 is the folder's 25th file, its bytes
        assert archive.getnames()[:2] == ["000000024.cls", "000000024.jpg"]
        # ImageFolder sorts file names as strings: its 25th china file is 30.jpg
        assert archive.extractfile("000000024.jpg").read() == (photos / "train" / "china" / "30.jpg").read_bytes()
    assert all((shards / f"{name}.idx.json").is_file() for name in manifest["splits"]["train"]["shards"])
    assert "\"data.train_shards='" in trained["overrides"]  # quoted for Hydra, and for the shell around it


def test_shards_of_an_imagefolder_train_to_its_bit_identical_weights_with_augmentation_on(trained):
    """Sample i of the shards is the folder's sample i, its same bytes decoded and augmented (random
    resized crop and flip) with the same per-sample seed: the same weights, bit for bit, and metrics."""
    shards_run, folder_run = Path(trained["shards_run"]), trained["folder_run"]
    assert results_of(shards_run)["steps"] == results_of(folder_run)["steps"] == 3
    assert_same_weights(final_weights(shards_run), final_weights(folder_run))
    assert results_of(shards_run)["val_loss"] == results_of(folder_run)["val_loss"]


def test_mode_eval_on_shards_is_exact_at_1_and_3_ranks(trained):
    one, three = (json.loads((Path(trained[name]) / "eval.json").read_text()) for name in ("eval_one", "eval_three"))
    training = results_of(Path(trained["shards_run"]))
    assert (one["world_size"], three["world_size"]) == (1, 3)
    assert one["val_samples"] == three["val_samples"] == training["val_samples"] == 16
    assert one["val_accuracy"] == three["val_accuracy"] == training["val_accuracy"]
    assert three["val_loss"] == pytest.approx(training["val_loss"], rel=1e-6)


def write_tar_shard(shard: Path, images: list[Path], labels: list[int], tmp: Path) -> None:
    """A shard as `tar` writes it: `tar -cf shard -C folder .` of key.jpg and key.cls files (and `./`)."""
    folder = tmp / f"{shard.stem}_files"
    folder.mkdir()
    for number, (image, label) in enumerate(zip(images, labels)):
        shutil.copy(image, folder / f"sample{number:03d}.jpg")
        (folder / f"sample{number:03d}.cls").write_text(f"{label}\n")
    subprocess.run(["tar", "-cf", str(shard), "-C", str(folder), "."], check=True)


def test_shards_written_by_tar_train_and_get_their_index_on_first_use(photos, tmp_path, monkeypatch):  # noqa: F811
    images = sorted((photos / "train" / "china").glob("*.jpg"))[:8] + sorted((photos / "train" / "flower").glob("*.jpg"))[:8]
    write_tar_shard(tmp_path / "train.tar", images, [0] * 8 + [1] * 8, tmp_path)
    write_tar_shard(tmp_path / "val.tar", images[4:12], [0] * 4 + [1] * 4, tmp_path)
    assert not list(tmp_path.glob("*.idx.json"))
    monkeypatch.chdir(tmp_path)
    results = run_in_this_process(["data=webdataset", f"data.train_shards={tmp_path}/train.tar",
                                   f"data.val_shards={tmp_path}/val.tar", *SMALL, "data.num_workers=0",
                                   "data.batch_size=8", "trainer.max_steps=-1"], tmp_path / "run")
    assert (results["steps"], results["val_samples"]) == (2, 8)
    index = json.loads((tmp_path / "train.tar.idx.json").read_text())
    with tarfile.open(tmp_path / "train.tar") as archive:  # the samples in the tar's order: the directory's, unsorted
        in_tar = list(dict.fromkeys(name.rpartition(".")[0] for name in archive.getnames() if name != "."))
    assert [sample[0] for sample in index["samples"]] == in_tar
    assert sorted(in_tar) == [f"./sample{n:03d}" for n in range(16)]


def test_an_interrupted_conversion_is_refused_and_written_again(tmp_path):
    """A source file that can't be read stops the converter after its first shards; training on them is
    one line, and the converter's next run writes the whole dataset again."""
    root = write_photo_imagefolder(tmp_path / "photos", {"train": 6, "val": 2})
    unreadable = root / "train" / "flower" / "5.jpg"
    unreadable.rename(tmp_path / "kept.jpg")
    unreadable.symlink_to(tmp_path / "gone.jpg")  # listed by ImageFolder, gone when read
    out = tmp_path / "shards"
    stopped = convert(out, ["data=imagefolder", f"data.root={root}"], 4, tmp_path)
    assert f"{unreadable}: can't be read" in one_error_line(stopped, tmp_path)
    assert (out / "train-000000.tar").is_file() and not (out / "dataset.json").exists()

    refused = launch(["data=webdataset", f"data.train_shards={out}/train-000000.tar",
                      f"data.val_shards={out}/train-000000.tar", *SMALL, "data.num_workers=0"], tmp_path)
    assert "interrupted conversion" in one_error_line(refused, tmp_path) and "python -m data.shards" in refused.stderr

    unreadable.unlink()
    (tmp_path / "kept.jpg").rename(unreadable)
    again = convert(out, ["data=imagefolder", f"data.root={root}"], 4, tmp_path)
    check(again)
    assert "an interrupted conversion" in again.stderr
    manifest = json.loads((out / "dataset.json").read_text())
    assert manifest["splits"]["train"]["samples"] == [4, 4, 4] and not (out / "dataset.partial.json").exists()


def test_a_tensor_dataset_converts_and_trains_as_it_did(tmp_path, monkeypatch):
    """data=digits' tensors, stored losslessly (pth): the printed overrides (with data.augment=none)
    train to the weights data=digits trains to."""
    conversion = convert(tmp_path / "shards", ["data=digits"], 500, tmp_path)
    check(conversion)
    overrides = printed_overrides(conversion)
    assert overrides.endswith("data.augment=none")
    args = ["model.channels=[8,16]", "checkpoint.keep_best=0", "trainer.max_steps=3", "data.num_workers=0"]
    (tmp_path / "shards_run").mkdir()
    check(run_through_bash(overrides, args, tmp_path / "shards_run"))
    monkeypatch.chdir(tmp_path)
    run_in_this_process(["data=digits", *args], tmp_path / "digits_run")
    assert_same_weights(final_weights(run_dirs(tmp_path / "shards_run")[0]), final_weights(tmp_path / "digits_run"))


# --- bad input: one line naming the shard and the fix, before anything starts --------------------------

def _not_a_tar(tmp: Path) -> list[str]:
    (tmp / "train-000000.tar").write_text("not a tar\n")
    return [f"data.train_shards={tmp}/train-000000.tar"]


def _shard_of_one_member(name: str, content: bytes):
    def shard(tmp: Path) -> list[str]:
        (tmp / name).write_bytes(content)
        subprocess.run(["tar", "-cf", str(tmp / "shard.tar"), "-C", str(tmp), name], check=True)
        return [f"data.train_shards={tmp}/shard.tar"]
    return shard


def _stale_index(tmp: Path, converted: Path) -> list[str]:
    shutil.copy(converted / "train-000000.tar", tmp / "train.tar")
    shutil.copy(converted / "train-000000.tar.idx.json", tmp / "train.tar.idx.json")  # recorded another mtime
    return [f"data.train_shards={tmp}/train.tar"]


BAD = {
    "pattern_matching_nothing": (lambda tmp, _: [f"data.train_shards='{tmp}/train-{{000000..000003}}.tar'"],
                                 "matches no file"),
    "not_a_tar": (lambda tmp, _: _not_a_tar(tmp), "not a readable tar file"),
    "sample_without_a_label": (lambda tmp, _: _shard_of_one_member("00.jpg", b"\xff\xd8")(tmp), "sample 00 has no label"),
    "sample_without_an_image": (lambda tmp, _: _shard_of_one_member("00.cls", b"0")(tmp), "sample 00 has no image"),
    "label_outside_num_classes": (lambda tmp, converted: [f"data.train_shards={converted}/train-000002.tar",
                                                          "data.num_classes=1"], "label 1 is outside [0, 1)"),
    "index_disagreeing_with_its_shard": (_stale_index, "delete the index to rebuild it"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_shards_are_one_line_naming_the_shard_and_the_fix(case, trained, tmp_path):
    make, expected = BAD[case]
    overrides = make(tmp_path, trained["shards"])
    result = launch(["data=webdataset", f"data.val_shards={trained['shards']}/val-000000.tar", *SMALL, "data.num_workers=0",
                     *overrides], tmp_path)
    line = one_error_line(result, tmp_path)
    assert expected in line, line


def test_with_a_shuffle_window_2_ranks_train_as_1_process_and_read_within_the_window(trained, tmp_path, monkeypatch):
    """data.shuffle_window=2 on the 3 train shards (24, 24, 16 samples), augmentation on: 2 ranks x 8 with
    SyncBN end within float noise of 1 process x 16, and at every update the samples both ranks read
    (fault.record_samples_dir) come from two consecutive groups of 2 shards of the epoch's order."""
    from ddp.loading.samplers import epoch_order

    shards = trained["shards"]
    args = ["data=webdataset", f"data.train_shards='{shards}/train-{{000000..000002}}.tar'",
            f"data.val_shards={shards}/val-000000.tar", "data.shuffle_window=2", "data.image_size=16",
            "model.channels=[8,16]", "checkpoint.keep_best=0", "trainer.max_epochs=1", "syncbn=true"]
    check(launch(["strategy=ddp", *args, "data.batch_size=8", "data.num_workers=2", "fault.record_samples_dir=samples"],
                 tmp_path, nproc=2))
    (ranks,) = run_dirs(tmp_path)
    monkeypatch.chdir(tmp_path)
    run_in_this_process(["strategy=single", *args, "data.batch_size=16", "data.num_workers=0"], tmp_path / "one")
    ranks_weights, one_weights = final_weights(ranks), final_weights(tmp_path / "one")
    worst = max((ranks_weights[key].double() - one_weights[key].double()).abs().max().item() for key in one_weights
                if one_weights[key].is_floating_point())
    assert worst < 1e-5, worst

    sizes, seen, group_of = [24, 24, 16], [], {}
    for index in epoch_order(64, seed=0, epoch=0, shard_sizes=sizes, window=2):
        shard = 0 if index < 24 else 1 if index < 48 else 2
        seen += [shard] if shard not in seen else []
        group_of[index] = (len(seen) - 1) // 2
    steps: dict[int, set[int]] = {}
    for path in (tmp_path / "samples").glob("rank*.jsonl"):
        for record in map(json.loads, path.read_text().splitlines()):
            steps.setdefault(record["step"], set()).update(group_of[i] for i in record["ids"])
    assert sorted(steps) == list(range(1, 5)) and all(max(groups) - min(groups) <= 1 for groups in steps.values()), steps


def test_shards_served_over_http_train_as_the_local_ones_and_a_gone_server_is_one_line(trained, tmp_path):
    """The converted shards served by http.server on 127.0.0.1, read through a node cache of 2.5 shards'
    size (so the 4 shards read don't all fit): the same weights, bit for bit, as the local shards; then, with the
    server gone and a cold cache, one line naming the URL, exit 1, no run dir left."""
    from test_shard_cache import Server

    server = Server(trained["shards"])
    shard_bytes = (trained["shards"] / "train-000000.tar").stat().st_size
    http = ["data=webdataset", f"data.train_shards='{server.url}/train-{{000000..000002}}.tar'",
            f"data.val_shards={server.url}/val-000000.tar", f"data.cache_limit_gb={2.5 * shard_bytes / 2**30}"]
    try:
        check(launch([*http, f"data.cache_dir={tmp_path / 'cache'}", *SMALL, "data.num_workers=2"], tmp_path))
        cached = list((tmp_path / "cache").glob("*.tar"))  # of the 4 shards read (3 train, 1 val), one went
        assert len(cached) < 4 and sum(path.stat().st_size for path in cached) <= 2.5 * shard_bytes
    finally:
        server.stop()
    (run_dir,) = run_dirs(tmp_path)
    assert_same_weights(final_weights(run_dir), final_weights(Path(trained["shards_run"])))

    (tmp_path / "gone").mkdir()
    result = launch([*http, f"data.cache_dir={tmp_path / 'cold'}", *SMALL], tmp_path / "gone")
    line = one_error_line(result, tmp_path / "gone")
    # the first file a start asks for: the folder's dataset.json (or its interrupted conversion's)
    assert line.startswith(f"error: {server.url}/dataset.partial.json: unreachable after 3 tries"), line
    assert line.endswith("check that the server serves it, then run it again (no checkpoint of this run was saved yet)"), line


def test_the_verify_command_names_each_shard_edited_after_the_conversion(trained, tmp_path):
    """`python -m data.shards --verify <folder>`: every shard good, exit 0; then a bit flipped at a random offset of
    a shard, for several shards and offsets: that shard is named corrupt (its CRC-32 against dataset.json's), exit 1."""
    from test_integrity import SEED, flip_bit

    folder = shutil.copytree(trained["shards"], tmp_path / "shards")
    verify = [sys.executable, "-m", "data.shards", "--verify", str(folder)]
    good = subprocess.run(verify, cwd=REPO, capture_output=True, text=True)
    names = ["train-000000.tar", "train-000001.tar", "train-000002.tar", "val-000000.tar"]
    assert (good.returncode, good.stdout.splitlines()) == (0, [f"good  {folder / name}" for name in names]), good.stdout + good.stderr
    rng = random.Random(SEED)
    for name in rng.sample(names, 3):
        edited = folder / name
        original = edited.read_bytes()
        flip_bit(edited, rng.randrange(len(original)), rng.randrange(8))
        bad = subprocess.run(verify, cwd=REPO, capture_output=True, text=True)
        assert bad.returncode == 1, bad.stdout
        assert [line for line in bad.stdout.splitlines() if not line.startswith("good  ")] == [
            f"corrupt  {edited}: CRC-32 {zlib.crc32(edited.read_bytes()):08x} where dataset.json lists {zlib.crc32(original):08x}"], bad.stdout
        edited.write_bytes(original)


def test_an_http_shard_changed_on_the_server_is_downloaded_once_more_then_one_line(trained, tmp_path):
    """The served folder's train-000001.tar with one byte changed from the converted one: its download, at its first
    read, fails its digest, is downloaded once more, then the run stops with one line naming the URL and both digests
    (and the command that continues the run once the server serves the right shard)."""
    from test_shard_cache import Server

    served = shutil.copytree(trained["shards"], tmp_path / "served")
    changed = served / "train-000001.tar"
    content = bytearray(changed.read_bytes())
    content[len(content) // 2] ^= 0x10
    changed.write_bytes(bytes(content))
    (tmp_path / "run").mkdir()
    server = Server(served)
    try:
        result = launch(["data=webdataset", f"data.train_shards='{server.url}/train-{{000000..000002}}.tar'",
                         f"data.val_shards={server.url}/val-000000.tar", f"data.cache_dir={tmp_path / 'cache'}", *SMALL,
                         "data.num_workers=0"], tmp_path / "run")
    finally:
        server.stop()
    converted = f"{zlib.crc32((trained['shards'] / 'train-000001.tar').read_bytes()):08x}"
    assert result.returncode == 1, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error: ")]  # found mid-epoch: a run dir
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert line.startswith(f"error: {server.url}/train-000001.tar: downloaded twice, it fails its digest "
                           f"(CRC-32 {zlib.crc32(content):08x} where dataset.json lists {converted})"), line
    assert server.requests.count("/train-000001.tar") == 2, server.requests
    assert not list((tmp_path / "cache").glob("*train-000001.tar"))  # never put in place


def test_the_next_windows_shards_download_in_the_background_and_no_read_leaves_the_window(trained, tmp_path):
    """Shards served over HTTP, data.shuffle_window=1, one rank of 2 iterating its sampler as a DataLoader
    does: the run starts without downloading a shard (the served indexes say what each holds); as the
    rank's samples enter each window, the next window's shard is requested from the server before any
    sample is read (the test reads nothing until it has been); and no shard beyond the next window is
    ever asked for. Each shard is downloaded once."""
    from data.shard_cache import ShardCache
    from data.webdataset import ShardReader, shard_index
    from ddp.loading.samplers import TrainSampler, epoch_windows
    from test_shard_cache import Server

    server = Server(trained["shards"])
    try:
        urls = [f"{server.url}/train-{number:06d}.tar" for number in range(3)]
        cache = ShardCache(tmp_path / "cache")
        reader = ShardReader(urls, [shard_index(url, cache) for url in urls], cache)
        assert not [path for path in server.requests if path.endswith(".tar")]
        sampler = TrainSampler(range(len(reader)), num_replicas=2, rank=1, seed=0, shard_sizes=reader.shard_sizes,
                               window=1, prefetch=reader.prefetch)
        sampler.set_epoch(3)
        windows = epoch_windows(0, 3, reader.shard_sizes, window=1)
        window_of = {index: number for number, (_, samples) in enumerate(windows) for index in samples}
        requested = lambda number: f"/train-{windows[number][0][0]:06d}.tar"  # noqa: E731
        entered = -1
        for index in sampler:
            if window_of[index] != entered:
                entered = window_of[index]
                upcoming = [requested(number) for number in range(entered, min(entered + 2, len(windows)))]
                assert server.wait_for(lambda got: set(upcoming) <= set(got)), (entered, server.requests)
                beyond = {requested(number) for number in range(entered + 2, len(windows))}
                assert not beyond & set(server.requests), (entered, server.requests)
            reader[index]
        assert entered == len(windows) - 1
        assert sorted(path for path in server.requests if path.endswith(".tar")) == sorted(urls[n][len(server.url):] for n in range(3))
    finally:
        server.stop()


def test_http_shards_killed_then_cut_off_resume_from_a_cold_cache_bit_identically(trained, tmp_path, monkeypatch):
    """HTTP shards, data.shuffle_window=1, 2 loader workers, 2 epochs of 4 updates: killed at update 6
    (the checkpoint of update 5 saved); resumed with an empty cache, the server stops when asked for
    a shard mid-epoch: one line naming the URL and ending with the command that continues the run, exit
    1, the checkpoint untouched; the server back, that command with another empty cache: the
    uninterrupted run's weights, optimizer and RNG states, bit for bit (the uninterrupted run on the
    local shards: the same bytes, tested above)."""
    from test_fault_tolerance import assert_bit_identical, last_checkpoint
    from test_shard_cache import Server

    shards = trained["shards"]
    common = ["data=webdataset", "data.shuffle_window=1", "data.image_size=16", "model.channels=[8,16]",
              "checkpoint.keep_best=0", "data.batch_size=16", "trainer.max_epochs=2", "checkpoint.every_n_steps=5"]
    monkeypatch.chdir(tmp_path)
    run_in_this_process([*common, f"data.train_shards='{shards}/train-{{000000..000002}}.tar'",
                         f"data.val_shards={shards}/val-000000.tar", "data.num_workers=0"], tmp_path / "uninterrupted")
    uninterrupted = last_checkpoint(tmp_path / "uninterrupted")
    assert uninterrupted["global_step"] == 8

    server = Server(shards)
    http = [*common, f"data.train_shards='{server.url}/train-{{000000..000002}}.tar'",
            f"data.val_shards={server.url}/val-000000.tar", "data.num_workers=2"]
    (tmp_path / "runs").mkdir()
    killed = launch([*http, "data.cache_dir=cache_a", "fault.kill_rank=0", "fault.at_step=6"], tmp_path / "runs")
    server.stop()
    assert killed.returncode != 0, killed.stderr[-3000:]
    (run_dir,) = run_dirs(tmp_path / "runs")
    assert (last_checkpoint(run_dir)["global_step"], last_checkpoint(run_dir)["epoch"]) == (5, 1)
    saved = {path: path.read_bytes() for path in (run_dir / "checkpoints").iterdir()}

    # epoch 1 from its 17th sample: its 3 windows' shards. The server goes when asked for the last one.
    last_shard = epoch_windows_last_shard(seed=0, epoch=1)
    server = Server(shards, port=server.port, stop_at=f"/train-{last_shard:06d}.tar")
    cut_off = launch([*http, "data.cache_dir=cache_b", f"resume={run_dir}"], tmp_path / "runs")
    server.stop()
    line = one_error_line_of(cut_off)
    assert line.startswith(f"error: {server.url}/train-{last_shard:06d}.tar: unreachable after 3 tries"), line
    assert {path: path.read_bytes() for path in (run_dir / "checkpoints").iterdir()} == saved
    continue_with = shlex.split(line.split("then continue with  ", 1)[1])  # python <train.py> <overrides> resume=<run dir>
    assert continue_with[-1] == f"resume={run_dir.relative_to(tmp_path / 'runs')}" and "data.cache_dir=cache_b" in continue_with

    server = Server(shards, port=server.port)
    try:
        # the printed command, with another empty cache
        check(launch([arg.replace("cache_b", "cache_c") for arg in continue_with[2:]], tmp_path / "runs"))
    finally:
        server.stop()
    assert len(run_dirs(tmp_path / "runs")) == 1
    assert_bit_identical(last_checkpoint(run_dir), uninterrupted)


def epoch_windows_last_shard(seed: int, epoch: int) -> int:
    """The shard of the last window of an epoch over the 3 converted train shards, data.shuffle_window=1."""
    from ddp.loading.samplers import epoch_windows

    return epoch_windows(seed, epoch, [24, 24, 16], window=1)[-1][0][0]


def one_error_line_of(result: subprocess.CompletedProcess) -> str:
    """A run that stopped mid-run with one `error:` line on stderr and no traceback: that line."""
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return errors[0]


def test_an_elastic_resume_on_shards_trains_every_sample_once(trained, tmp_path, monkeypatch):
    """data.shuffle_window=2 on the converted shards: 2 ranks x 8 killed at update 3 of 4 (the
    checkpoint of update 2 saved), resumed as 1 process x 16: epoch 0 is the 2 ranks' first 2 updates
    and the resumed process's rest, every sample once; epoch 1 every sample once."""
    shards = trained["shards"]
    args = ["data=webdataset", f"data.train_shards='{shards}/train-{{000000..000002}}.tar'",
            f"data.val_shards={shards}/val-000000.tar", "data.shuffle_window=2", "data.image_size=16",
            "model.channels=[8,16]", "checkpoint.keep_best=0", "trainer.max_epochs=2", "data.num_workers=0",
            "checkpoint.every_n_steps=2"]
    killed = launch(["strategy=ddp", *args, "data.batch_size=8", "fault.record_samples_dir=samples",
                     "fault.kill_rank=1", "fault.at_step=3"], tmp_path, nproc=2)
    assert killed.returncode != 0, killed.stderr[-3000:]
    (run_dir,) = run_dirs(tmp_path)
    monkeypatch.chdir(tmp_path)
    results = run_in_this_process(["strategy=single", *args, "data.batch_size=16", f"resume={run_dir}",
                                   "fault.record_samples_dir=resumed"], run_dir)
    assert (results["world_size"], results["steps"]) == (1, 8)
    before = [record for path in (tmp_path / "samples").glob("rank*.jsonl")
              for record in map(json.loads, path.read_text().splitlines()) if record["step"] <= 2]
    after = [record for path in (tmp_path / "resumed").glob("rank*.jsonl") for record in map(json.loads, path.read_text().splitlines())]
    epoch = lambda records, number: sorted(i for r in records if r["epoch"] == number for i in r["ids"])  # noqa: E731
    assert len(before) == 4 and sorted(epoch(before, 0) + epoch(after, 0)) == list(range(64))
    assert epoch(after, 1) == list(range(64))


def test_a_served_index_of_another_shard_is_one_line_and_a_process_keeps_few_shards_open(trained, tmp_path, monkeypatch):
    """A served index that doesn't fit its shard (another shard's) is found when the shard is first
    read: one line naming the index. And a reader keeps at most MAX_OPEN_SHARDS open (here 2 of 3),
    reading every sample right as it reopens them, and closes them when it is dropped (the jobs of a
    sweep in one process would otherwise pile them up)."""
    import data.webdataset as webdataset
    from data.shard_cache import ShardCache
    from data.vision import BadSample
    from test_shard_cache import Server

    served = tmp_path / "served"
    shutil.copytree(trained["shards"], served)
    shutil.copy(served / "train-000002.tar.idx.json", served / "train-000000.tar.idx.json")
    server = Server(served)
    try:
        url = f"{server.url}/train-000000.tar"
        cache = ShardCache(tmp_path / "cache")
        reader = webdataset.ShardReader([url], [webdataset.shard_index(url, cache)], cache)
        with pytest.raises(BadSample) as raised:
            reader[0]
    finally:
        server.stop()
    assert str(raised.value).startswith(f"{url}.idx.json: disagrees with its shard") and "\n" not in str(raised.value)

    monkeypatch.setattr(webdataset, "MAX_OPEN_SHARDS", 2)
    paths = [str(trained["shards"] / f"train-{number:06d}.tar") for number in range(3)]
    expected = [data for reader in [webdataset.ShardReader(paths, [webdataset.load_index(Path(path)) for path in paths])]
                for data, _ in (reader[index] for index in range(len(reader)))]
    reader = webdataset.ShardReader(paths, [webdataset.load_index(Path(path)) for path in paths])

    def open_shards() -> set[tuple[str, str]]:  # this process's descriptors open on the shards
        found = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                found.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
            except OSError:  # the listing's own descriptor, closed meanwhile
                pass
        return {(fd, target) for fd, target in found if target in paths}

    others = open_shards()  # earlier readers' of this test process (other tests' runs in it)
    for index in [0, 30, 60, 1, 31, 61, 2]:  # shards 0, 1, 2, 0, 1, 2, 0
        assert reader[index][0] == expected[index]
        assert len(open_shards() - others) <= 2, open_shards() - others
    del reader
    assert not open_shards() - others
    with tarfile.open(trained["shards"] / "train-000002.tar") as archive:
        assert expected[60] == archive.extractfile("000000060.jpg").read()


def test_a_reader_alive_at_the_interpreters_exit_prints_nothing(trained):
    """A script's reader at module level lives until the interpreter's exit, where its descriptors close with the process."""
    shard = trained["shards"] / "train-000000.tar"
    script = (f"import data.webdataset as w, pathlib\nreader = w.ShardReader([{str(shard)!r}], "
              f"[w.load_index(pathlib.Path({str(shard)!r}))])\nreader[0]\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0 and result.stderr == "", result.stderr
