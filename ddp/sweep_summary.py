"""A Hydra callback that writes summary.csv and summary.md into a multirun's sweep dir (rank 0)."""

import csv
import json
import logging
import os
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

log = logging.getLogger(__name__)

COLUMNS = [
    "job", "overrides", "world_size", "batch_size", "global_batch_size",
    "val_loss", "val_accuracy", "samples_per_s", "wall_s", "status", "best",
]


class SweepSummary(Callback):
    """Rewrites the summary after every job, so it exists even if the sweep stops early."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN or os.environ.get("RANK", "0") != "0":
            return
        self.rows.append(summary_row(config, job_return))
        write_summary(self.rows, Path(config.hydra.sweep.dir))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.rows and os.environ.get("RANK", "0") == "0":
            sweep_dir = Path(config.hydra.sweep.dir)
            print(f"\nsweep summary ({sweep_dir / 'summary.csv'}):\n" + (sweep_dir / "summary.md").read_text(), flush=True)


def summary_row(config: DictConfig, job_return: JobReturn) -> dict[str, Any]:
    world_size = config.strategy.nproc_per_node if config.strategy.name == "ddp" else 1
    world_size = int(os.environ.get("WORLD_SIZE", world_size or 1))
    row = {
        "job": config.hydra.job.num,
        "overrides": " ".join(job_return.overrides or []),
        "world_size": world_size,
        "batch_size": config.data.batch_size,
        "global_batch_size": config.data.batch_size * world_size,
    }
    results_file = Path(config.hydra.runtime.output_dir) / "results.json"
    if job_return.status == JobStatus.COMPLETED and results_file.is_file():
        results = json.loads(results_file.read_text())
        row |= {key: results.get(key) for key in ("world_size", "global_batch_size", "val_loss", "val_accuracy", "samples_per_s", "wall_s")}
        row["status"] = "ok"
    else:
        reason = str(job_return._return_value).strip().splitlines() or ["unknown error"]
        row["status"] = f"failed: {type(job_return._return_value).__name__}: {reason[0]}"
    return row


def write_summary(rows: list[dict[str, Any]], sweep_dir: Path) -> None:
    finished = [row for row in rows if row["status"] == "ok"]
    best = max(finished, key=lambda row: row["val_accuracy"], default=None)
    table = [{column: row.get(column) for column in COLUMNS} | {"best": row is best} for row in rows]
    with open(sweep_dir / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(table)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(row[column]) for column in COLUMNS) + " |" for row in table]
    if best is not None:
        lines += ["", f"best: job {best['job']} ({best['overrides']}) val_accuracy={best['val_accuracy']:.4f}"]
    (sweep_dir / "summary.md").write_text("\n".join(lines) + "\n")


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if value is True:
        return "*"
    return "" if value is None or value is False else str(value).replace("|", "\\|")
