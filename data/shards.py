"""Convert a dataset to tar shards in WebDataset's layout, for data=webdataset (docs/sharded-data.md):

    python -m data.shards OUT_DIR data=<option> [data.* keys] [--samples-per-shard N]

The data config is composed from conf/ as train.py composes it, the splits are built by their builder,
and each split's samples are written in their order: `<split>-000000.tar`, ..., each sample's key its
index in the split. An ImageFolder's images keep their file's bytes and extension (so the shards train
exactly as the folder does); a tensor dataset's images are stored as tensors (`pth`, torch.save).
A detection dataset's samples (data=coco, data=detection_shapes) are stored untransformed: the image
(a COCO folder's file, its bytes and extension; a generated image as its uint8 tensor) and a `json`
target with the image's id, size and every annotation of it in COCO's form, crowd regions included;
dataset.json adds the categories and each split's image ids and sizes.

Each shard is written to `<shard>.tmp`, fsynced and renamed, with its index; `dataset.json`, listing the
shards, their sample counts, sizes and CRC-32s and the class names, is written last. While the conversion runs
`dataset.partial.json` marks the folder: an interrupted conversion is refused by data=webdataset and
written again by the next run of the converter.

    python -m data.shards --verify OUT_DIR

checks every shard `dataset.json` lists against its size and CRC-32, names the bad ones, and exits 1 if one is."""

import argparse
import io
import json
import os
import shlex
import sys
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from data.coco import CocoDetection
from data.detection_shapes import DetectionShapes
from data.webdataset import (IMAGE_EXTENSIONS, LABEL_EXTENSION, MANIFEST, PARTIAL_MANIFEST, TARGET_EXTENSION,
                             TENSOR_EXTENSION, load_index)
from data.shard_cache import shard_problem
from ddp.checkpoints.verify import file_crc32
from ddp.config.schema import ConfigError

CONF = Path(__file__).resolve().parents[1] / "conf"
SHARD_NAME = "{split}-{number:06d}.tar"
ANNOTATION_FIELDS = ("id", "category_id", "bbox", "area", "iscrowd")  # of each annotation in a json target


def compose_data_config(overrides: list[str]):
    """The `data` node train.py would run with these overrides (only data=... and data.* keys)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    from ddp.config.schema import register_configs

    others = [override for override in overrides if not override.lstrip("+~").startswith("data")]
    if others:
        raise ConfigError(f"{others[0]}: the converter takes data=<option> and data.* keys only")
    register_configs()
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return compose("config", overrides=overrides).data
    except HydraException as error:
        raise ConfigError(" ".join(str(error).split())) from None


def file_member(path: str | Path) -> dict[str, bytes]:
    """An image file as a sample's member: its extension and its own bytes."""
    try:
        return {Path(path).suffix[1:].lower(): Path(path).read_bytes()}
    except OSError as error:
        raise ConfigError(f"{path}: can't be read ({error.strerror}); fix or remove the file, then run the "
                          "converter again (it writes the interrupted conversion again)") from None


def tensor_member(image: torch.Tensor) -> dict[str, bytes]:
    buffer = io.BytesIO()
    torch.save(image.clone(), buffer)  # clone: a view would save the whole split's storage
    return {TENSOR_EXTENSION: buffer.getvalue()}


def check_extensions(paths, split: str, option: str) -> None:
    unknown = sorted({Path(path).suffix.lower() for path in paths} - {f".{e}" for e in IMAGE_EXTENSIONS})
    if unknown:
        raise ConfigError(f"data={option}: the {split} split has {unknown[0]} files; "
                          f"shards store {', '.join(IMAGE_EXTENSIONS)}: convert those images first")


def stored_samples(dataset, split: str, option: str):
    """(count, sample(i) -> {extension: bytes}): a split's samples as stored, before any transform."""
    if hasattr(dataset, "coco_ground_truth"):  # a detection dataset
        return len(dataset), detection_sample_members(dataset, split, option)
    if hasattr(dataset, "samples") and hasattr(dataset, "loader"):  # an ImageFolder: its files' own bytes
        def image_file(index: int) -> dict[str, bytes]:
            path, label = dataset.samples[index]
            return {**file_member(path), LABEL_EXTENSION: str(label).encode()}

        check_extensions([path for path, _ in dataset.samples], split, option)
        return len(dataset.samples), image_file
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
        images, labels = dataset.tensors

        def tensor(index: int) -> dict[str, bytes]:
            return {**tensor_member(images[index]), LABEL_EXTENSION: str(int(labels[index])).encode()}

        return len(images), tensor
    raise ConfigError(f"data={option}: its {split} split is a {type(dataset).__name__}, which transforms samples as it "
                      "loads them; the converter stores ImageFolder files and TensorDataset tensors: "
                      "set data.augment=false data.views=1 (a tensor dataset), or convert the images to an ImageFolder")


def detection_sample_members(dataset, split: str, option: str):
    """sample(i) -> {image extension: bytes, "json": target}: the untransformed image (a COCO folder's
    file; generated shapes' drawn uint8 tensor) and its target, the image's entry and annotations in
    dataset.coco_ground_truth() (crowd regions included), from which data=webdataset makes the sample's
    target and the split's ground truth as the dataset does."""
    if isinstance(dataset, CocoDetection):
        check_extensions(dataset.file_names, split, option)

        def image(index: int) -> dict[str, bytes]:
            return file_member(dataset.images.path / dataset.file_names[index])
    elif isinstance(dataset, DetectionShapes):
        def image(index: int) -> dict[str, bytes]:
            return tensor_member(dataset.draw(index)[0])
    else:
        raise ConfigError(f"data={option}: its {split} split is a {type(dataset).__name__}; the converter reads the "
                          "untransformed images of data=coco and data=detection_shapes: convert the data to COCO's "
                          "format and use data=coco")
    ground_truth = dataset.coco_ground_truth()
    images = {entry["id"]: entry for entry in ground_truth["images"]}
    annotations = {image_id: [] for image_id in images}
    for annotation in ground_truth["annotations"]:
        annotations[annotation["image_id"]].append({field: annotation[field] for field in ANNOTATION_FIELDS})

    def sample(index: int) -> dict[str, bytes]:
        entry = images[dataset.sample_ids[index]]
        image_fields = {field: entry[field] for field in ("width", "height", "file_name") if field in entry}
        target = {"image_id": entry["id"], **image_fields, "annotations": annotations[entry["id"]]}
        return {**image(index), TARGET_EXTENSION: json.dumps(target).encode()}

    return sample


def detection_manifest(splits, datasets: dict) -> tuple[dict, dict[str, dict]]:
    """What data=webdataset reads from dataset.json for detection shards: the categories in label order
    (label l is categories[l - 1]), and per split each sample's image id and [width, height] in sample
    order (sample_ids and aspect_ratios, without reading a sample)."""
    names = {category["id"]: category["name"] for category in splits.train.coco_ground_truth()["categories"]}
    categories = [{"id": category_id, "name": names[category_id]} for category_id in splits.train.category_ids]
    per_split = {}
    for split, dataset in datasets.items():
        images = {entry["id"]: entry for entry in dataset.coco_ground_truth()["images"]}
        per_split[split] = {"image_ids": list(dataset.sample_ids),
                            "image_sizes": [[images[i]["width"], images[i]["height"]] for i in dataset.sample_ids]}
    return {"task": "detection", "categories": categories}, per_split


def prepare(out_dir: Path) -> None:
    """An empty or new folder, or one an interrupted conversion left (its shards are written again)."""
    if (out_dir / MANIFEST).exists():
        raise ConfigError(f"{out_dir}: already holds converted shards ({MANIFEST}); delete the folder or choose another")
    if (out_dir / PARTIAL_MANIFEST).exists():
        print(f"{out_dir}: an interrupted conversion ({PARTIAL_MANIFEST}): writing it again", file=sys.stderr)
        for leftover in out_dir.iterdir():
            if leftover.name.endswith((".tar", ".tar.tmp", ".tmp")) or leftover.name.endswith(".tar.idx.json"):
                leftover.unlink()
    elif out_dir.exists() and any(out_dir.iterdir()):
        raise ConfigError(f"{out_dir}: not empty; write the shards to an empty or new folder")
    out_dir.mkdir(parents=True, exist_ok=True)


def write_shards(out_dir: Path, split: str, count: int, sample, samples_per_shard: int, progress) -> dict:
    """The split's samples in order, samples_per_shard a shard, each shard written atomically with its index."""
    from webdataset import TarWriter

    names, counts, sizes, crcs = [], [], [], []
    for first in range(0, count, samples_per_shard):
        path = out_dir / SHARD_NAME.format(split=split, number=len(names))
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as stream:
            with TarWriter(stream, encoder=False, mtime=0) as writer:
                for index in range(first, min(first + samples_per_shard, count)):
                    writer.write({"__key__": f"{index:09d}", **sample(index)})
                    progress.update()
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp, path)
        load_index(path)  # built and saved now, beside the shard
        names.append(path.name)
        counts.append(min(samples_per_shard, count - first))
        sizes.append(path.stat().st_size)
        crcs.append(f"{file_crc32(path):08x}")  # read back while in the page cache
    return {"shards": names, "samples": counts, "bytes": sizes, "crc32": crcs}


def write_json_atomically(path: Path, content: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as stream:
        json.dump(content, stream, indent=1)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(tmp, path)


def convert(out_dir: Path, overrides: list[str], samples_per_shard: int, progress_bar: bool = True) -> str:
    """Write the shards and dataset.json; the train.py overrides that train on them."""
    from tqdm import tqdm

    from data import build_datasets

    if samples_per_shard < 1:
        raise ConfigError(f"--samples-per-shard={samples_per_shard}: must be at least 1")
    data_cfg = compose_data_config(overrides)
    option = data_cfg._target_.rpartition(".")[2].removeprefix("build_")
    splits = build_datasets(data_cfg)
    datasets = {split: dataset for split, dataset in (("train", splits.train), ("val", splits.val), ("test", splits.test))
                if dataset is not None}
    stored = {split: stored_samples(dataset, split, option) for split, dataset in datasets.items()}
    detection = hasattr(splits.train, "coco_ground_truth")
    kind, per_split = detection_manifest(splits, datasets) if detection else ({"task": "classification"}, {})
    out_dir = out_dir.resolve()
    prepare(out_dir)
    write_json_atomically(out_dir / PARTIAL_MANIFEST, {"overrides": overrides})
    written = {}
    with tqdm(total=sum(count for count, _ in stored.values()), unit="sample", disable=not progress_bar) as progress:
        for split, (count, sample) in stored.items():
            shards = write_shards(out_dir, split, count, sample, samples_per_shard, progress)
            written[split] = {**shards, **per_split.get(split, {})}
    class_names = splits.class_names or getattr(splits.train, "classes", None)
    write_json_atomically(out_dir / MANIFEST, {"num_classes": splits.num_classes, "class_names": class_names,
                                               "in_channels": splits.in_channels, **kind, "source": overrides,
                                               "splits": written})
    (out_dir / PARTIAL_MANIFEST).unlink()
    if detection:  # as data=coco trains: its preset, and evaluation at batch 1
        settings = ["task=detection", "model=detection", f"data.augment={data_cfg.augment}", "data.val_batch_size=1"]
    elif any(TENSOR_EXTENSION in sample(0) for count, sample in stored.values() if count):
        settings = ["data.augment=none"]  # tensors train as stored
    else:
        settings = []
    return training_overrides(out_dir, {split: len(w["shards"]) for split, w in written.items()}, settings)


def training_overrides(out_dir: Path, shard_counts: dict[str, int], settings: list[str]) -> str:
    """`data=webdataset data.train_shards=... ... <settings>`, quoted for a POSIX shell: Hydra needs a brace
    pattern in quotes (`'...{000000..000003}.tar'`), and the shell needs the whole override in quotes too."""
    overrides = ["data=webdataset"]
    for split, count in shard_counts.items():
        if count == 0:
            continue
        last = SHARD_NAME.format(split=split, number=count - 1)
        name = last if count == 1 else f"{split}-{{{0:06d}..{count - 1:06d}}}.tar"
        value = str(out_dir / name).replace("\\", "\\\\").replace("'", "\\'")
        override = f"data.{split}_shards='{value}'"
        overrides.append(f'"{override}"' if not set(override) & set('"$`\\!') else shlex.quote(override))
    return " ".join([*overrides, *settings])


def verify(out_dir: Path) -> int:
    """A line per shard that dataset.json lists: good, corrupt (why) or unverified (no digest listed); 1 if one is corrupt."""
    try:
        manifest = json.loads((out_dir / MANIFEST).read_text())
    except (OSError, ValueError) as error:
        sys.stderr.write(f"error: {out_dir / MANIFEST}: can't be read ({error}); --verify checks a folder python -m data.shards wrote\n")
        return 2
    corrupt = 0
    for split in manifest.get("splits", {}).values():
        for name, size, crc in zip(split["shards"], split.get("bytes", [None] * len(split["shards"])),
                                   split.get("crc32", [None] * len(split["shards"]))):
            if crc is None:
                print(f"unverified  {out_dir / name}")
            elif problem := shard_problem(out_dir / name, size, crc):
                corrupt += 1
                print(f"corrupt  {out_dir / name}: {problem}")
            else:
                print(f"good  {out_dir / name}")
    return 1 if corrupt else 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m data.shards", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="the folder to write the shards and dataset.json to")
    parser.add_argument("overrides", nargs="*", help="data=<option> and data.* keys, as train.py takes them")
    parser.add_argument("--samples-per-shard", type=int, default=1000)
    parser.add_argument("--verify", action="store_true", help="check the folder's shards against dataset.json instead")
    args = parser.parse_intermixed_args(argv)
    if args.verify:
        sys.exit(verify(args.out_dir))
    try:
        line = convert(args.out_dir, args.overrides, args.samples_per_shard)
    except ConfigError as error:
        sys.stderr.write(f"error: {error}\n")
        sys.exit(1)
    print(f"wrote {args.out_dir}; train on it with:\n  python train.py {line}")


if __name__ == "__main__":
    main()
