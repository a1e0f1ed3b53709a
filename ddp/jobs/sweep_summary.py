"""Hydra callbacks for sweeps: a summary (summary.csv, summary.md) in the sweep dir, written by rank 0,
and the refusal of an Optuna search under torchrun."""

import atexit
import csv
import json
import sys
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from ddp.checkpoints.best import objective_key
from ddp.config.schema import MULTI_PROCESS
from ddp.distributed.env import DistEnv
from ddp.jobs.launch import ONE_LINE_ERRORS
from ddp.jobs.preemption import Interrupted

# The objective (task.objective, e.g. val_accuracy or val_miou; best_val_accuracy with trainer.objective=best)
# comes after val_loss; the best job is the one with the best objective in the task's direction, as Optuna picks.
COLUMNS = ["job", "overrides", "world_size", "batch_size", "global_batch_size", "val_loss"]
LAST_COLUMNS = ["samples_per_s", "wall_s", "status", "best"]

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
OPTUNA_SWEEPER = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"

# One sweep per process: the rows so far, and where they go; the failed jobs the sweep went on past.
_rows: list[dict[str, Any]] = []
_sweep_dir: list[Path] = []
_failed: list[int] = []


def columns(objective: str) -> list[str]:
    return COLUMNS + ([objective] if objective not in COLUMNS else []) + LAST_COLUMNS


class SweepSummary(Callback):
    """Rewrites the summary after every job, so it exists even if the sweep stops early; prints it at
    the end, or at exit when a failed job made Hydra stop before the end.

    A job of the basic sweeper that failed with a one-line error (a startup refusal, divergence: its line
    printed as it failed) is left to the summary: Hydra would end the sweep after the batch with `Error
    executing job` and a traceback through main. An Optuna trial that failed (an unexpected error's traceback
    is in its log) returns what failed, no number, which Optuna records as a failed trial, and the search goes
    on. Either sweep exits 1 at its end, after the summary."""

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        env = DistEnv.from_environ()
        if config.hydra.mode != RunMode.MULTIRUN or not env.is_main or env.launcher == "submitit":
            return  # submitit runs each job in processes of its own: the sweep's process summarises them at the end
        job_dir = Path(config.hydra.runtime.output_dir)
        failure = None if job_return.status == JobStatus.COMPLETED else job_return._return_value
        _add_row(summary_row(config.hydra.job.num, job_return.overrides, config, job_dir, failure), Path(config.hydra.sweep.dir),
                 config)
        sweeper = config.hydra.sweeper._target_
        if isinstance(failure, ONE_LINE_ERRORS) and sweeper == BASIC_SWEEPER:
            # the basic sweeper only raises a failed job's error, and uses no job's value
            job_return.status, job_return.return_value = JobStatus.COMPLETED, None
            _failed.append(config.hydra.job.num)
        elif isinstance(failure, Exception) and sweeper == OPTUNA_SWEEPER:  # a stop (Interrupted) still ends the search
            # each read of a failed job's value prints Hydra's `Error executing job`, and Optuna reads it thrice; a
            # value that is no number fails the trial, with this in Optuna's line
            job_return.status = JobStatus.COMPLETED
            job_return.return_value = f"job {config.hydra.job.num} failed: {type(failure).__name__}: {failure}"
            _failed.append(config.hydra.job.num)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if "submitit" in config.hydra.launcher._target_:
            # A failed job makes Hydra end the sweep without on_multirun_end: summarise at exit then.
            atexit.register(summarise_job_dirs, Path(config.hydra.sweep.dir))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if "submitit" in config.hydra.launcher._target_:
            summarise_job_dirs(Path(config.hydra.sweep.dir))
        print_summary()
        if _failed:
            sys.exit(1)


def summarise_job_dirs(sweep_dir: Path) -> None:
    """The summary of a sweep whose jobs ran in processes of their own (submitit), from their job dirs;
    a job without results.json failed. Once per sweep."""
    if _rows:
        return
    jobs = sorted((int(hydra_dir.parent.name.split("_", 1)[0]), hydra_dir) for hydra_dir in sweep_dir.glob("*/.hydra"))
    for job_num, hydra_dir in jobs:  # job dirs are named <job number>_<swept values>
        overrides = list(OmegaConf.load(hydra_dir / "overrides.yaml"))
        job_cfg = OmegaConf.load(hydra_dir / "config.yaml")
        _add_row(summary_row(job_num, overrides, job_cfg, hydra_dir.parent, failure=None), sweep_dir, job_cfg)
    print_summary()


def record_failed_job(hydra_cfg: DictConfig, cfg: DictConfig, error: BaseException) -> None:
    """For a job that ends the sweep with SystemExit (a failure under torchrun, or an interruption),
    which Hydra's job-end callbacks never see."""
    if hydra_cfg.mode == RunMode.MULTIRUN and DistEnv.from_environ().is_main:
        row = summary_row(hydra_cfg.job.num, hydra_cfg.overrides.task, cfg, Path(hydra_cfg.runtime.output_dir), error)
        _add_row(row, Path(hydra_cfg.sweep.dir), cfg)


def summary_row(job_num: int, overrides, cfg: DictConfig, job_dir: Path, failure: BaseException | None) -> dict[str, Any]:
    env = DistEnv.from_environ()
    world_size = env.world_size
    if not env.launched and cfg.strategy.name in MULTI_PROCESS:
        world_size = cfg.strategy.nproc_per_node  # self-launched workers
    row = {
        "job": job_num,
        "overrides": " ".join(overrides or []),
        "world_size": world_size,
        "batch_size": cfg.data.batch_size,
        "global_batch_size": cfg.data.batch_size * world_size,
    }
    results_file = job_dir / "results.json"
    if isinstance(failure, Interrupted):
        row["status"] = "interrupted"
    elif failure is None and results_file.is_file():
        results = json.loads(results_file.read_text())
        row |= {key: results.get(key) for key in ("world_size", "global_batch_size", "val_loss", _objective(cfg), "samples_per_s", "wall_s")}
        row["status"] = "ok"
    elif failure is None:
        row["status"] = "failed: no results.json (see the job's logs)"
    else:
        reason = str(failure).strip().splitlines() or ["no results.json"]
        row["status"] = f"failed: {type(failure).__name__}: {reason[0]}"
    return row


def _objective(cfg: DictConfig) -> str:
    """The results key a job's `main` returns (trainer.objective: the final objective, or its best)."""
    return objective_key(cfg.task.objective, cfg.trainer.objective, cfg.checkpoint.best_of)


def _add_row(row: dict[str, Any], sweep_dir: Path, cfg: DictConfig) -> None:
    if not _sweep_dir:
        _sweep_dir.append(sweep_dir)
        atexit.register(print_summary)
    _rows.append(row)
    write_summary(_rows, sweep_dir, _objective(cfg), cfg.task.direction)


def print_summary() -> None:
    if _rows and _sweep_dir:
        sweep_dir = _sweep_dir.pop()
        print(f"\nsweep summary ({sweep_dir / 'summary.csv'}):\n" + (sweep_dir / "summary.md").read_text(), flush=True)


def write_summary(rows: list[dict[str, Any]], sweep_dir: Path, objective: str, direction: str) -> None:
    finished = [row for row in rows if row["status"] == "ok" and row.get(objective) is not None]
    best = (max if direction == "maximize" else min)(finished, key=lambda row: row[objective], default=None)
    names = columns(objective)
    table = [{column: row.get(column) for column in names} | {"best": row is best} for row in rows]
    with open(sweep_dir / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        writer.writerows(table)
    lines = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    lines += ["| " + " | ".join(_cell(row[column]) for column in names) + " |" for row in table]
    if best is not None:
        lines += ["", f"best: job {best['job']} ({best['overrides']}) {objective}={best[objective]:.4f}"]
    (sweep_dir / "summary.md").write_text("\n".join(lines) + "\n")


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if value is True:
        return "*"
    return "" if value is None or value is False else str(value).replace("|", "\\|")


class RefuseOptunaUnderTorchrun(Callback):
    """Under torchrun every rank would run its own Optuna study, sampling different values."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        env = DistEnv.from_environ()
        if env.launched and "optuna" in config.hydra.sweeper._target_:
            # Every rank says it, in one write: torchrun stops the other ranks once the first exits.
            sys.stderr.write(
                "error: hparams_search=optuna under torchrun would run a separate study on every rank: run "
                "`python train.py -m hparams_search=optuna strategy=ddp strategy.nproc_per_node=N` instead\n"
            )
            sys.exit(1)
