"""make bench's shard readers: the repo's own reader and node cache against webdataset's `wids`, on one epoch of
the same tar shards over HTTP, from a cold cache and then a warm one (docs/sharded-data.md, "Why not wids").

- ours: data=webdataset's train split as train.py builds it (ShardReader over ShardCache, each download checked
  against dataset.json's CRC-32), its sampler's Prefetcher downloading the next data.shuffle_window's shards;
- wids 0.1.11 (the optional extra `bench`): its ShardListDataset with a cache_dir, given each shard's URL and sample
  count, behind the same EncodedImages (data/encoded.py), so that the decode and everything after it are the same
  and only the reading differs.

Both read the same shards (data=synthetic's tensors, as python -m data.shards stores them) from a server paced to
a fixed bandwidth, into an empty cache, in the same order (the sampler's, with data.shuffle_window), through the
project's train loader in this process (no loader workers: the readers are compared, not the loaders), a sleep
after each batch standing for the training step; then the same epoch again, every shard in the cache. Reported:
the epoch's wall time and the time spent waiting for batches. Then what each makes of a served shard whose bytes
changed after the conversion.
"""

import contextlib
import io
import json
import logging
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from integrity import serve

try:
    import wids  # noqa: F401 (the optional extra bench, which make bench installs)

    WIDS = True
except ImportError:
    WIDS = False

READERS = ("data=webdataset: ShardReader + ShardCache + Prefetcher", "wids 0.1.11: ShardListDataset, cache_dir")
# each epoch read again by the same dataset, its cache now warm: the reader's own time, downloads aside
CACHES = ("cold cache", "warm cache")


@dataclass(frozen=True)
class ReaderSettings:
    shards: int
    samples_per_shard: int
    image_size: int  # a sample: a 3 x image_size x image_size float32 tensor
    mb_per_s: float  # the server's bandwidth, all its connections together
    batch_size: int
    step_s: float  # the simulated training step after each batch (a sleep)
    window: int  # data.shuffle_window
    repeats: int


# a shard of 6.1 MB takes 0.2 s to arrive and 0.3 s to train on: a link that keeps up with the training
READERS_FULL = ReaderSettings(shards=12, samples_per_shard=32, image_size=128, mb_per_s=32, batch_size=16, step_s=0.15,
                              window=2, repeats=5)
READERS_QUICK = ReaderSettings(shards=2, samples_per_shard=4, image_size=16, mb_per_s=32, batch_size=4, step_s=0.01,
                               window=1, repeats=1)


class WidsReader:
    """wids' ShardListDataset as a reader of EncodedImages (data/encoded.py): a sample's tensor bytes and label."""

    def __init__(self, shards: list[dict], cache_dir: Path):
        import wids

        with contextlib.redirect_stderr(io.StringIO()):  # it prints a line about the dataset, always
            self.dataset = wids.ShardListDataset(shards, cache_dir=str(cache_dir), transformations=[])
        self.shard_sizes = [shard["nsamples"] for shard in shards]

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[bytes, int]:
        sample = self.dataset[index]
        return sample[".pth"].getvalue(), int(sample[".cls"].getvalue())  # wids gives each member as a BytesIO

    def where(self, index: int) -> str:
        return f"wids sample {index}"


def build_ours(url: str, settings: ReaderSettings, cache_dir: Path):
    from data.webdataset import build_webdataset

    return build_webdataset(f"{url}/train-{{000000..{settings.shards - 1:06d}}}.tar", f"{url}/val-000000.tar",
                            image_size=settings.image_size, augment="none", random_erase=0.0, interpolation="bilinear",
                            cache_dir=str(cache_dir)).train


def build_wids(url: str, manifest: dict, cache_dir: Path):
    from data.encoded import EncodedImages
    from data.webdataset import load_tensor

    train = manifest["splits"]["train"]
    shards = [{"url": f"{url}/{name}", "nsamples": count} for name, count in zip(train["shards"], train["samples"])]
    return EncodedImages(WidsReader(shards, cache_dir), None, manifest["num_classes"], "train", "error", decode=load_tensor)


def read_epoch(dataset, settings: ReaderSettings, epoch: int) -> tuple[float, float]:
    """(the epoch's wall time, the time spent waiting for its batches), in seconds."""
    from ddp.distributed.env import DistEnv
    from ddp.loading.loaders import build_train_loader, start_epoch

    config = SimpleNamespace(batch_size=settings.batch_size, num_workers=0, shuffle_window=settings.window)
    loader = build_train_loader(dataset, config, DistEnv(), seed=0, pin_memory=False)
    start_epoch(loader, epoch)
    started, waited = time.perf_counter(), 0.0
    batches = iter(loader)
    while True:
        asked = time.perf_counter()
        batch = next(batches, None)
        waited += time.perf_counter() - asked
        if batch is None:
            return time.perf_counter() - started, waited
        time.sleep(settings.step_s)


def next_epochs_first_window(dataset, settings: ReaderSettings, epoch: int) -> None:
    """Waits for what ours' sampler asked for in the epoch's last window, the next epoch's first window: so that
    its download shares the link with no later measurement, and its prefetch thread is idle when the cache goes."""
    from ddp.loading.samplers import epoch_windows

    (shards, _), *_ = epoch_windows(0, epoch + 1, dataset.shard_sizes, settings.window)
    for shard in shards:
        dataset.reader.cache.fetch(dataset.reader.shards[shard])


def write_shards(folder: Path, settings: ReaderSettings) -> dict:
    """data=synthetic's samples as python -m data.shards writes them: its dataset.json."""
    from data.shards import convert

    convert(folder, ["data=synthetic", f"data.num_samples={settings.shards * settings.samples_per_shard}",
                     "data.num_val_samples=4", f"data.image_size={settings.image_size}"], settings.samples_per_shard,
            progress_bar=False)
    return json.loads((folder / "dataset.json").read_text())


def reader_runs(settings: ReaderSettings, scratch: Path) -> tuple[dict[tuple[str, str], list[tuple[float, float]]], dict[str, str], float]:
    """({(reader, cache): [(epoch wall s, waiting s) per repeat]}, {reader: what it made of a corrupt shard}, MB a shard)."""
    scratch = Path(tempfile.mkdtemp(dir=scratch, prefix="shard-readers-"))
    folder = scratch / "shards"
    manifest = write_shards(folder, settings)
    found: dict[tuple[str, str], list[tuple[float, float]]] = {(name, cache): [] for name in READERS for cache in CACHES}
    with serve(folder, settings.mb_per_s * 2**20) as url:
        for repeat in range(settings.repeats):
            for name in READERS[::1 if repeat % 2 else -1]:
                print(f"bench: shard readers, repeat {repeat + 1}/{settings.repeats}: {name}", flush=True)
                cache_dir = Path(tempfile.mkdtemp(dir=scratch, prefix="cache-"))
                dataset = build_ours(url, settings, cache_dir) if name == READERS[0] else build_wids(url, manifest, cache_dir)
                found[name, "cold cache"].append(read_epoch(dataset, settings, epoch=repeat + 1))
                if name == READERS[0]:
                    next_epochs_first_window(dataset, settings, epoch=repeat + 1)
                found[name, "warm cache"].append(read_epoch(dataset, settings, epoch=repeat + 1))
                shutil.rmtree(cache_dir)
    corrupt = corrupt_shard(folder, manifest, settings, scratch)
    shutil.rmtree(scratch)
    return found, corrupt, statistics.mean(manifest["splits"]["train"]["bytes"]) / 2**20


def corrupt_shard(folder: Path, manifest: dict, settings: ReaderSettings, scratch: Path) -> dict[str, str]:
    """Each reader's first sample of a served shard with one byte of that sample's tensor changed after the
    conversion (as a disk's flipped bit or a proxy would): what it made of it."""
    from data.shard_cache import ShardCorrupt
    from data.webdataset import load_tensor

    served = scratch / "corrupt"
    shutil.copytree(folder, served)
    shard = served / "train-000000.tar"
    _, _, offset, size, _ = json.loads((served / "train-000000.tar.idx.json").read_text())["samples"][0]
    data = bytearray(shard.read_bytes())
    original = load_tensor(bytes(data[offset:offset + size]))
    at = data.find(original.numpy().tobytes(), offset)  # the tensor's own bytes within its .pth member
    if at < 0:
        raise RuntimeError(f"{shard}: the first sample's tensor bytes not found in its member")
    data[at + original.numel() * 2] ^= 0x10
    shard.write_bytes(data)
    found = {}
    logging.getLogger("data.shard_cache").setLevel(logging.ERROR)  # its warning before the second download
    with serve(served) as url:
        try:
            build_ours(url, settings, Path(tempfile.mkdtemp(dir=scratch)))[0]
            found[READERS[0]] = "read it"
        except ShardCorrupt as error:
            found[READERS[0]] = f"refused it ({str(error).split(': ', 1)[1].split(': the server')[0]})"  # the URL's port varies
        image, _ = build_wids(url, manifest, Path(tempfile.mkdtemp(dir=scratch)))[0]
        changed = int((image != original).sum())
        found[READERS[1]] = f"read it: the sample's tensor differs from the converted one in {changed} value(s)" if changed \
            else "read it, unchanged"
    logging.getLogger("data.shard_cache").setLevel(logging.NOTSET)
    return found


def report(runs: dict[tuple[str, str], list[tuple[float, float]]], corrupt: dict[str, str], shard_mb: float,
           settings: ReaderSettings) -> tuple[list[str], list[tuple]]:
    """The section's table lines and its ratio rows (what, ratio, goal)."""
    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"

    wall, wait = ({key: statistics.median(values[i] for values in found) for key, found in runs.items()} for i in (0, 1))
    lines = ["", f"Shard readers: one epoch of {settings.shards} shards of {settings.samples_per_shard} tensors "
             f"(3x{settings.image_size}x{settings.image_size} float32, {shard_mb:.2f} MB a shard) over HTTP at "
             f"{settings.mb_per_s:.0f} MB/s, data.shuffle_window={settings.window}'s order, batch {settings.batch_size}, "
             f"{settings.step_s} s of simulated training after each batch, one process, no loader workers; from an empty "
             f"cache, then the same epoch again from the warm cache; {settings.repeats} interleaved repeats, median (min-max).",
             "", "| reader | cache | epoch wall s | waiting for batches s |", "|---|---|---|---|"]
    lines += [f"| {name} | {cache} | {cell([w for w, _ in found])} | {cell([w for _, w in found])} |"
              for (name, cache), found in runs.items()]
    lines += ["", "Waiting for downloads (cold cache - warm cache, waiting): " + "; ".join(
        f"{name.split(':')[0]} {wait[name, 'cold cache'] - wait[name, 'warm cache']:.2f} s" for name in READERS) + "."]
    lines += ["", "A served shard with one byte changed after the conversion: " +
              "; ".join(f"{name.split(':')[0]} {what}" for name, what in corrupt.items()) + "."]
    ours, theirs = READERS
    rows = [("shard readers: data=webdataset / wids, epoch wall time, cold cache over HTTP",
             wall[ours, "cold cache"] / wall[theirs, "cold cache"], "<= 0.90"),
            ("shard readers: data=webdataset / wids, time waiting for batches, cold cache",
             wait[ours, "cold cache"] / wait[theirs, "cold cache"], "report"),
            ("shard readers: data=webdataset / wids, epoch wall time, warm cache",
             wall[ours, "warm cache"] / wall[theirs, "warm cache"], "report")]
    return lines, rows
