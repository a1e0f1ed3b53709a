"""Output that only rank 0 writes: console logging, TensorBoard events and the other trackers' runs
(ddp/reporting/trackers.py), results.json."""

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # not imported: the trackers' own process (tracker_process.py) imports this module, and not torch
    from ddp.distributed.env import DistEnv

log = logging.getLogger("train")


def quiet_console_on_other_ranks(env: "DistEnv") -> None:
    """Other ranks keep INFO in their own log file but print only warnings, so the console reads as one run."""
    if env.is_main:
        return
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            handler.setLevel(logging.WARNING)


def one_line(error: BaseException, limit: int = 300) -> str:
    """An error's message as one line of at most `limit` characters (its type's name if it has none)."""
    return ("; ".join(line.strip() for line in str(error).strip().splitlines()) or type(error).__name__)[:limit]


def call_each(trackers: list, call: str, *args) -> None:
    """`tracker.<call>(*args)` for each tracker; one that fails is named in one line and removed from `trackers`."""
    for tracker in list(trackers):
        try:
            getattr(tracker, call)(*args)
        except Exception as error:  # the tracker's own failure (a server gone): never the run's
            trackers.remove(tracker)
            log.warning("logger=%s failed (%s): it logs nothing more; the run and its files go on", tracker.name,
                        one_line(error))


class RankZeroWriter:
    """On rank 0, a TensorBoard SummaryWriter (unless `tensorboard` is off) and the `trackers` the logger
    group picked, each call fanned out to all of them; a no-op elsewhere, so other ranks write no event
    files and open no tracker run. The loop names no tracker: it calls add_scalar, add_image and
    add_hparams, and `commit` where a step's values are all in.

    A tracker that fails is named in one line and dropped; the run and its own files go on."""

    def __init__(self, log_dir: Path, env: "DistEnv", purge_step: int | None = None, *, tensorboard: bool = True,
                 trackers: list | None = None, journal=None):
        self.writer = None
        self.trackers = list(trackers or []) if env.is_main else []
        # trackers.PointJournal where trackers were picked: every point they are sent, whether they take it or not
        self.journal, self.uncommitted = journal if env.is_main else None, []
        self.earlier_event_files: list[Path] = []  # an earlier attempt's, in a resumed run's dir
        if env.is_main and tensorboard:  # imported here, on rank 0 only: the import is a noticeable part of start-up
            from torch.utils.tensorboard import SummaryWriter

            self.earlier_event_files = sorted(Path(log_dir).glob("events.out.tfevents.*"))
            # purge_step: a resumed run drops the events the interrupted one logged after its checkpoint.
            self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    @property
    def active(self) -> bool:
        """Whether this rank writes: work done only to be logged can be skipped where it doesn't."""
        return self.writer is not None or bool(self.trackers)

    def _to_trackers(self, call: str, *args) -> None:
        call_each(self.trackers, call, *args)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        if self.writer is not None:
            self.writer.add_scalar(tag, value, step)
        self._scalar_to_trackers(tag, value, step)

    def _scalar_to_trackers(self, tag: str, value: float, step: int) -> None:
        if self.journal is not None:
            self.uncommitted.append((tag, float(value), step))
        if self.trackers:
            self._to_trackers("add_scalar", tag, value, step)

    def commit(self) -> None:
        """Sends the trackers the values added so far (a step's, an epoch's, a validation's), journaled first."""
        if self.journal is not None and self.uncommitted:
            self.journal.append(self.uncommitted)
            self.uncommitted = []
        if self.trackers:
            self._to_trackers("commit")

    def add_image(self, tag: str, image, step: int) -> None:
        """`image`: a 3 x H x W tensor, floats in [0, 1] (SummaryWriter.add_image's default CHW). The trackers get
        it as bytes, H x W x 3, journaled first, after the points added before it."""
        if self.writer is not None:
            self.writer.add_image(tag, image, step)
        if self.journal is None and not self.trackers:
            return
        self.commit()
        pixels = (image.detach() * 255).round().clamp(0, 255).byte().permute(1, 2, 0).cpu().numpy()
        if self.journal is not None:
            self.journal.append_image(tag, pixels, step)
        self._to_trackers("add_image", tag, pixels, step)

    def add_hparams(self, hparam_dict: dict[str, Any], metric_dict: dict[str, float], step: int) -> None:
        """Written into this run's own event dir, unlike SummaryWriter.add_hparams, which opens a
        timestamped subdir; so every job of a sweep shows as one row of one HParams table.

        A resumed run's hparams (its LR, its length) replace an earlier attempt's. The hparams records
        are metadata only, and TensorBoard keeps the metadata of the first record of a tag it reads in
        a run dir (its event files in name order, that is by start time), ignoring later ones; its purge
        on resume drops values, never metadata. So the earlier attempts' event files are rewritten
        without their hparams records, once this attempt's are on disk.

        The trackers get the hparams as params, and the metrics as scalars at `step`."""
        if self.trackers:
            self._to_trackers("add_params", hparam_dict)
        for tag, value in metric_dict.items():
            self._scalar_to_trackers(tag, value, step)
        self.commit()
        if self.writer is None:
            return
        from torch.utils.tensorboard.summary import hparams

        file_writer = self.writer._get_file_writer()
        for summary in hparams(hparam_dict, metric_dict):
            file_writer.add_summary(summary)
        for tag, value in metric_dict.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()
        for path in self.earlier_event_files:
            drop_hparams_records(path)

    def close(self, failed: bool = False) -> None:
        if self.writer is not None:
            self.writer.close()
        self._to_trackers("close", failed)
        self.trackers = []
        if self.journal is not None:
            self.journal.close()
            self.journal = None

    # A context manager, so that the writer closes however the run ends (a sweep's next job runs in this process).
    def __enter__(self) -> "RankZeroWriter":
        return self

    def __exit__(self, exc_type, *exc_info) -> None:
        self.close(failed=exc_type is not None)


def drop_hparams_records(event_file: Path) -> None:
    """Rewrites a closed event file without its hparams records, through a temporary file and a rename,
    so a reader sees the old file or the new one. Every other record stays as it was, byte for byte."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.plugins.hparams.metadata import PLUGIN_NAME
    from tensorboard.summary.writer.record_writer import RecordWriter

    def is_hparams(record: bytes) -> bool:
        values = Event.FromString(record).summary.value
        return bool(values) and all(value.metadata.plugin_data.plugin_name == PLUGIN_NAME for value in values)

    records = list(RawEventFileLoader(str(event_file)).Load())
    kept = [record for record in records if not is_hparams(record)]
    if len(kept) == len(records):
        return
    tmp = event_file.with_name(".rewritten-events.tmp")  # no "tfevents" in it: TensorBoard doesn't read it as a file of the run
    with open(tmp, "wb") as file:
        writer = RecordWriter(file)
        for record in kept:
            writer.write(record)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, event_file)


def write_json(data: dict[str, Any], path: Path) -> None:
    """Written whole or not at all: readers never see half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
