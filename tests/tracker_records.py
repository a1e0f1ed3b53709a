"""Readers of a run's record in each logger, by the logger's own means: TensorBoard's event reader, MLflow's
client, and W&B's protobuf records in its offline run files (read as the next attempt of a run reads them)."""

import json
import struct
from pathlib import Path

from ddp.reporting.trackers import wandb_records


def float32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]  # TensorBoard keeps float32


def mlflow_client(store: Path):
    """MLflow's own client of a SQLite store."""
    from mlflow.tracking import MlflowClient

    return MlflowClient(f"sqlite:///{store}")


def mlflow_runs(store: Path) -> list:
    """Every run in the store, of every experiment."""
    client = mlflow_client(store)
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


def mlflow_runs_of(store: Path, run_dir: Path) -> list:
    """The store's runs that record `run_dir` (their tag run_dir)."""
    return [run for run in mlflow_runs(store) if run.data.tags.get("run_dir") == str(run_dir.resolve())]


def tensorboard_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} as TensorBoard shows the run dir (every attempt's event files, purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {event.step: event.value for event in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def wandb_history(run_dir: Path) -> tuple[set[str], dict[str, dict[int, float]], list[int]]:
    """From every .wandb file of the run dir: the run ids, {key: {step: value}}, and every step logged."""
    ids, history, steps = set(), {}, []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
            elif kind == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                steps.append(items["_step"])
                for key, value in items.items():
                    if not key.startswith("_"):
                        history.setdefault(key, {})[items["_step"]] = value
    return ids, history, steps
