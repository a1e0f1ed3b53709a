"""Experiment trackers besides TensorBoard (logger=mlflow, logger=wandb): what RankZeroWriter fans out to.

Rank 0 alone opens a tracker run, once per launch; the run's id is kept in <run dir>/trackers.json,
so whatever continues the run dir (resume=<run dir>, resume=auto after a torchrun restart, a SLURM
requeue) continues the same tracker run. A resumed run repeats the steps after its checkpoint,
bit-identical to the interrupted run's; TensorBoard purges its events after the checkpoint, but
trackers can't delete points, so a tracker is sent only the (metric, step) points it doesn't have
yet, read from it once at start. A sweep's jobs are one group, named after the sweep dir.

Values are buffered and sent at `commit` (RunMonitor commits after each log step's, epoch's and
validation's values). A tracker's own failure mid-run is logged in one line and that tracker stops;
the run and its own files (checkpoints, results.json, TensorBoard) go on.

The trackers start, send and end in a process of their own (tracker_process.py): MLflow's import and
store take seconds of Python, which the training neither waits for nor shares Python's lock with.
"""

import contextlib
import fcntl
import json
import logging
import os
import struct
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy

from ddp.reporting.rank_zero import call_each, one_line, write_json

if TYPE_CHECKING:  # not imported: the trackers' own process imports this module, and neither Hydra nor OmegaConf
    from omegaconf import DictConfig

log = logging.getLogger("train")

TRACKERS = ("mlflow", "wandb")  # logger options besides tensorboard
STATE_FILE = "trackers.json"  # in the run dir: each tracker's run id
JOURNAL_FILE = "tracker_points.jsonl"  # in the run dir: every point sent to the trackers (PointJournal)
JOURNAL_IMAGES = "tracker_images"  # in the run dir: the journaled images, a PNG each (PointJournal)
LOCAL_MLFLOW_STORE = Path("outputs") / "mlflow.db"  # beside the run dirs; `make mlflow-ui` serves it
# what MLflow imports whenever it is installed, for its datasets and model signatures, which a tracker doesn't use
MLFLOW_UNUSED_IMPORTS = ("pandas", "pyarrow", "scipy")


def picked(logger_cfg: Mapping[str, Any]) -> list[str]:
    """The logger options this run uses, e.g. ["tensorboard", "mlflow"]."""
    return [name for name in ("tensorboard", *TRACKERS) if logger_cfg.get(name) is not None]


def wandb_api_key_set() -> bool:
    """An API key in the environment or from `wandb login` (~/.netrc): W&B can go online."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc

    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


# --- what a run is ------------------------------------------------------------------------------

@dataclass(frozen=True)
class TrackedRun:
    """What every tracker is told about the run: its dir, its config as flat params, and its sweep."""

    run_dir: Path
    params: dict[str, str]  # the config, flattened: {"optim.lr": "0.1", ...}
    sweep: str | None  # the sweep dir of a sweep's job (the group), else None
    overrides: list[str]  # the job's command-line overrides

    @classmethod
    def of(cls, cfg: "DictConfig", run_dir: Path) -> "TrackedRun":
        """The sweep and overrides come from the run dir's .hydra/, which every launcher writes (torchrun,
        self-launched DDP, submitit): a spawned worker has no HydraConfig. Computed on rank 0: OmegaConf is imported
        here, and not in the trackers' process, which receives the result."""
        from omegaconf import OmegaConf

        hydra_dir, sweep, overrides = run_dir / ".hydra", None, []
        if (hydra_dir / "overrides.yaml").exists():
            overrides = list(OmegaConf.load(hydra_dir / "overrides.yaml"))
        if (hydra_dir / "hydra.yaml").exists() and OmegaConf.load(hydra_dir / "hydra.yaml").hydra.mode == "MULTIRUN":
            sweep = _readable(run_dir.parent)
        return cls(run_dir, flat_params(OmegaConf.to_container(cfg, resolve=True)), sweep, overrides)


def _readable(path: Path) -> str:
    """The path as the console shows it: relative to the launch's working dir where it lies under it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path.resolve())


def flat_params(config: dict, prefix: str = "") -> dict[str, str]:
    params = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            params |= flat_params(value, f"{prefix}{key}.")
        else:
            params[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return params


def read_state(run_dir: Path) -> dict[str, Any]:
    path = run_dir / STATE_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def write_state(run_dir: Path, name: str, state: dict[str, Any]) -> None:
    write_json(read_state(run_dir) | {name: state}, run_dir / STATE_FILE)


def where_to_look(logger_cfg: "DictConfig", run_dir: Path) -> list[str]:
    """The console's last lines: where each picked logger keeps the run, and the command that shows it."""
    lines, state = [], read_state(run_dir)
    if logger_cfg.tensorboard is not None:
        lines.append(f"tensorboard: tensorboard --logdir {run_dir}  (or: make tensorboard)")
    if "mlflow" in state:
        uri = state["mlflow"]["tracking_uri"]
        shown = "make mlflow-ui" if uri == f"sqlite:///{LOCAL_MLFLOW_STORE.resolve()}" else uri
        lines.append(f"mlflow: run {state['mlflow']['run_id']} in {shown}")
    if "wandb" in state:
        offline = sorted(run_dir.glob("wandb/offline-run-*"))
        lines.append(f"wandb: run {state['wandb']['id']}" + (f"; upload it with: wandb sync {run_dir}/wandb/offline-run-*"
                                                             if offline else ""))
    return lines


class PointJournal:
    """Every point committed to the trackers, a JSON line each in <run dir>/tracker_points.jsonl, so that the
    run dir's next attempt sends a tracker the points it missed: those of a tracking server down for a while,
    or those that W&B's service had not written when SLURM's SIGTERM, sent to every process of the job,
    killed it. A resumed run keeps the points before its checkpoint (`purge_step`); it computes the later
    ones again. An image is a PNG in <run dir>/tracker_images/, its line `[tag, {"image": <its path>}, step]`."""

    def __init__(self, run_dir: Path, purge_step: int | None):
        self.run_dir, self.path = run_dir, run_dir / JOURNAL_FILE
        self.earlier: list[tuple[str, Any, int]] = []  # the earlier attempts' points, before the checkpoint
        if purge_step is not None and self.path.exists():
            points = (_journal_point(line) for line in self.path.read_text().splitlines())
            self.earlier = [point for point in points if point is not None and point[2] < purge_step]
        tmp = self.path.with_name(f".{JOURNAL_FILE}.tmp")
        tmp.write_text("".join(json.dumps(point) + "\n" for point in self.earlier))
        os.replace(tmp, self.path)
        kept = {run_dir / value["image"] for _, value, _ in self.earlier if isinstance(value, dict)}
        for image in (run_dir / JOURNAL_IMAGES).rglob("*.png"):  # the later steps' images: computed again
            if image not in kept:
                image.unlink()
        self.file = open(self.path, "a")

    def append(self, points: list[tuple[str, Any, int]]) -> None:
        self.file.write("".join(json.dumps(point) + "\n" for point in points))
        self.file.flush()

    def append_image(self, tag: str, pixels: numpy.ndarray, step: int) -> None:
        """`pixels`: H x W x 3 bytes. Its PNG is written whole (a temporary file renamed) before its line."""
        from PIL import Image

        relative = Path(JOURNAL_IMAGES, tag, f"step_{step:08d}.png")
        path = self.run_dir / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        Image.fromarray(pixels).save(tmp, format="PNG")
        os.replace(tmp, path)
        self.append([(tag, {"image": str(relative)}, step)])

    def close(self) -> None:
        self.file.close()


def _journal_point(line: str) -> tuple[str, Any, int] | None:
    """A journal line; None for a last line cut short by a kill."""
    try:
        tag, value, step = json.loads(line)
    except ValueError:
        return None
    return tag, value, step


def open_trackers(logger_cfg: Mapping[str, Any], run: TrackedRun, earlier_points: list[tuple[str, Any, int]]) -> list:
    """Rank 0's trackers, each continuing the run dir's earlier tracker run if it has one, and sent the
    `earlier_points` (the journal's, images too) that it lacks. One that can't start is named in one line and
    left out: the training doesn't depend on it."""
    from PIL import Image

    kinds, trackers = {"mlflow": MLflowTracker, "wandb": WandbTracker}, []
    for name in picked(logger_cfg):
        if name in kinds:
            try:
                tracker = kinds[name](logger_cfg[name], run)
                for tag, value, step in earlier_points:
                    if isinstance(value, dict):  # an image: sent after the points before it, as it was
                        tracker.commit()
                        tracker.add_image(tag, numpy.asarray(Image.open(run.run_dir / value["image"])), step)
                    else:
                        tracker.add_scalar(tag, value, step)
                tracker.commit()
                trackers.append(tracker)
            except Exception as error:
                log.warning("logger=%s failed to start (%s): the run goes on without it", name, one_line(error))
    return trackers


class Tracker:
    """Buffers (tag, value, step) points, skips those the tracker has already, sends them at commit."""

    name = ""

    def __init__(self, run: TrackedRun):
        self.run = run
        self.pending: list[tuple[str, float, int]] = []

    def has(self, tag: str, step: int) -> bool:
        """Whether the tracker has this point already (from the interrupted run that this one continues)."""
        raise NotImplementedError

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        if not self.has(tag, step):
            self.pending.append((tag, float(value), step))

    def commit(self) -> None:
        if self.pending:
            points, self.pending = self.pending, []
            self.send(points)

    def send(self, points: list[tuple[str, float, int]]) -> None:
        raise NotImplementedError

    def add_image(self, tag: str, image: numpy.ndarray, step: int) -> None:
        """`image`: H x W x 3 bytes, sent at once (after a commit of the points before it)."""

    def add_params(self, params: dict[str, Any]) -> None:
        """The hparams (TensorBoard's HParams row); the config's are given at start."""

    def close(self, failed: bool) -> None:
        """Ends the tracker's run. A failed run's uncommitted values are of a step it didn't finish: a
        resume repeats that step, whole, so they are dropped (W&B can't add to a step it has)."""
        if failed:
            self.pending = []
        self.commit()
        self.end(failed)

    def end(self, failed: bool) -> None:
        raise NotImplementedError


@contextlib.contextmanager
def store_lock(uri: str):
    """A SQLite store's first use creates its tables; two jobs of a sweep starting at once (submitit) would
    both try, and one would fail. A lock file beside the store lets one create them."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    with open(uri.removeprefix("sqlite:///") + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@contextlib.contextmanager
def modules_hidden(names: tuple[str, ...]):
    """Inside, `import <name>` raises ImportError (a None in sys.modules, as Python's import system defines it)
    for each of `names` not imported yet; a module that tries it goes on without it."""
    hidden = [name for name in names if name not in sys.modules]
    sys.modules.update(dict.fromkeys(hidden))
    try:
        yield
    finally:
        for name in hidden:
            del sys.modules[name]


class MLflowTracker(Tracker):
    """One MLflow run: the config as params, the scalars as metrics at their steps, images as artifacts.
    The local store (no tracking_uri) is outputs/mlflow.db with artifacts under outputs/mlflow-artifacts/."""

    name = "mlflow"

    def __init__(self, cfg: Mapping[str, Any], run: TrackedRun):
        super().__init__(run)
        # MLflow imports pandas, pyarrow and scipy wherever they are installed: 0.24 s of CPU on the cores the ranks use.
        # It imports without them, as where only mlflow-skinny is installed, and the tracker's calls don't use them
        with modules_hidden(MLFLOW_UNUSED_IMPORTS):
            from mlflow.tracking import MlflowClient

        self.uri = cfg["tracking_uri"] or f"sqlite:///{LOCAL_MLFLOW_STORE.resolve()}"
        if not cfg["tracking_uri"]:
            LOCAL_MLFLOW_STORE.parent.mkdir(parents=True, exist_ok=True)
        # MLflow retries a server that stopped answering for minutes (7 times, 120 s each), while every rank
        # waits for rank 0; fail fast instead, once, and go on without it (the user's own settings win)
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")
        logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)  # its retries' warnings: the failure is our one line
        self.client = MlflowClient(self.uri)
        with store_lock(self.uri):
            self._start_run(cfg, run)
        self.add_params(run.params)

    def _start_run(self, cfg: Mapping[str, Any], run: TrackedRun) -> None:
        """Continues the run dir's MLflow run (reading the last step of each of its metrics), or starts one."""
        self.last_steps: dict[str, int] = {}  # per metric, the last step the run has (a continued run's)
        self.images: dict[str, set[str]] = {}  # per image tag, the artifacts the run has, listed at its first image
        saved = read_state(run.run_dir).get(self.name)
        if saved and saved["tracking_uri"] == self.uri:
            self.run_id = saved["run_id"]
            existing = self.client.get_run(self.run_id)
            for key in existing.data.metrics:
                self.last_steps[key] = max(m.step for m in self.client.get_metric_history(self.run_id, key))
            self.client.update_run(self.run_id, status="RUNNING")
            log.info("mlflow: continuing run %s (%s)", self.run_id, self.uri)
        else:
            experiment = cfg["experiment"] or run.sweep or "hydra-ddp"
            tags = {"run_dir": str(run.run_dir.resolve()), "overrides": " ".join(run.overrides)}
            if run.sweep:
                tags["sweep"] = run.sweep
            self.run_id = self.client.create_run(self._experiment_id(experiment),
                                                 run_name=run.run_dir.name, tags=tags).info.run_id
            write_state(run.run_dir, self.name, {"run_id": self.run_id, "tracking_uri": self.uri})
            log.info("mlflow: run %s in experiment %s (%s)", self.run_id, experiment, self.uri)

    def has(self, tag: str, step: int) -> bool:
        return step <= self.last_steps.get(tag, -1)

    def _experiment_id(self, name: str) -> str:
        """The experiment, created if new (a sweep's jobs may race to create it: the loser reads it). A SQLite
        store's artifacts go beside it, in mlflow-artifacts/ (MLflow's default is ./mlruns, wherever the launch runs)."""
        from mlflow.exceptions import MlflowException

        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        store = Path(self.uri.removeprefix("sqlite:///"))
        location = (store.parent / "mlflow-artifacts").resolve().as_uri() if self.uri.startswith("sqlite:///") else None
        try:
            return self.client.create_experiment(name, artifact_location=location)
        except MlflowException:
            return self.client.get_experiment_by_name(name).experiment_id

    def add_params(self, params: dict[str, Any]) -> None:
        """MLflow params can't change: a continued run keeps the first value, and a changed one (a resume's new
        LR, its length) goes into a tag `changed.<key>`."""
        from mlflow.entities import Param, RunTag

        existing = self.client.get_run(self.run_id).data.params
        new = [Param(key, str(value)[:6000]) for key, value in params.items() if key not in existing]
        changed = [RunTag(f"changed.{key}", str(value)[:5000]) for key, value in params.items()
                   if key in existing and existing[key] != str(value)[:6000]]
        for start in range(0, len(new), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=new[start:start + 100])
        if changed:
            self.client.log_batch(self.run_id, tags=changed)

    def send(self, points: list[tuple[str, float, int]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(tag, value, now, step) for tag, value, step in points]
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + 1000])

    def add_image(self, tag: str, image: numpy.ndarray, step: int) -> None:
        """Skipped where the run has it (a continued run's journaled image): one listing of the run's images per tag."""
        if tag not in self.images:
            self.images[tag] = {info.path for info in self.client.list_artifacts(self.run_id, tag)}
        artifact = f"{tag}/step_{step:08d}.png"
        if artifact not in self.images[tag]:
            self.client.log_image(self.run_id, image, artifact_file=artifact)
            self.images[tag].add(artifact)

    def end(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


class WandbTracker(Tracker):
    """One W&B run, offline without an API key: its files in <run dir>/wandb/, uploaded by `wandb sync`."""

    name = "wandb"

    def __init__(self, cfg: Mapping[str, Any], run: TrackedRun):
        super().__init__(run)
        import wandb

        saved = read_state(run.run_dir).get(self.name)
        mode = cfg["mode"] if cfg["mode"] != "auto" else ("online" if wandb_api_key_set() else "offline")
        # W&B's steps are rows, and it drops a row at or before its last one: a continued run starts after
        # the last step W&B has, which the server knows online and the earlier attempts' files show offline
        self.continues_after = last_offline_step(run.run_dir, saved["id"]) if saved else -1
        self.wandb_run = wandb.init(
            project=cfg["project"], entity=cfg["entity"], mode=mode, dir=str(run.run_dir), id=saved["id"] if saved else None,
            resume="allow", group=run.sweep, name=run.run_dir.name, config=dict(run.params),
            tags=None, notes=" ".join(run.overrides) or None, settings=wandb.Settings(console="off", silent=True))
        if saved and mode == "online":
            self.continues_after = self.wandb_run.starting_step - 1
        write_state(run.run_dir, self.name, {"id": self.wandb_run.id})
        log.info("wandb: %s run %s (%s)%s", mode, self.wandb_run.id, run.sweep or cfg["project"],
                 f"; upload it later with: wandb sync {run.run_dir}/wandb/offline-run-*" if mode == "offline" else "")

    def has(self, tag: str, step: int) -> bool:
        return step <= self.continues_after

    def send(self, points: list[tuple[str, float, int]]) -> None:
        rows: dict[int, dict[str, float]] = {}
        for tag, value, step in points:
            rows.setdefault(step, {})[tag] = value
        for step in sorted(rows):
            self.wandb_run.log(rows[step], step=step)

    def add_image(self, tag: str, image: numpy.ndarray, step: int) -> None:
        import wandb

        if not self.has(tag, step):
            self.wandb_run.log({tag: wandb.Image(image)}, step=step)

    def add_params(self, params: dict[str, Any]) -> None:
        self.wandb_run.config.update({f"hparams/{key}": value for key, value in params.items()}, allow_val_change=True)

    def end(self, failed: bool) -> None:
        self.wandb_run.finish(exit_code=1 if failed else 0)


def last_offline_step(run_dir: Path, run_id: str) -> int:
    """The last step that the offline files of W&B run `run_id` in the run dir hold (-1 for none), as
    written: W&B's service writes its records every few seconds, and one killed loses the last ones.
    The attempts' files are read newest first (their dirs are named by start time), up to one with steps."""
    for path in sorted(run_dir.glob(f"wandb/offline-run-*/run-{run_id}.wandb"), reverse=True):
        steps = [json.loads(item.value_json) for record in wandb_records(path) if record.WhichOneof("record_type") == "history"
                 for item in record.history.item if item.key == "_step" or list(item.nested_key) == ["_step"]]
        if steps:
            return max(steps)
    return -1


def wandb_records(path: Path) -> list:
    """The records of a W&B run file (.wandb): W&B's protobuf Records in a LevelDB-style log, a 7-byte header
    then 32 KiB blocks of chunks: crc32 (4 bytes), length (2, little-endian), type (1: full, 2: first,
    3: middle, 4: last). A file cut short by a kill ends at its last whole record."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2

    data, block, records, chunks, offset = path.read_bytes(), 32768, [], b"", 7
    if data[:4] != b":W&B":
        return records
    while offset + 7 <= len(data):
        if block - offset % block < 7:  # a block's tail too short for a header is padding
            offset += block - offset % block
            continue
        length, kind = struct.unpack("<HB", data[offset + 4:offset + 7])
        if kind == 0 or offset + 7 + length > len(data):
            break
        chunks += data[offset + 7:offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            try:
                record.ParseFromString(chunks)
            except DecodeError:
                break
            records.append(record)
            chunks = b""
    return records
