"""The startup checks of logger=mlflow and logger=wandb: the trackers installed, an MLflow URI usable (its
server reachable), W&B's mode and WANDB_* variables what W&B accepts. One line each, raised before anything
starts. They live apart from the trackers (ddp/reporting/trackers.py), which run in a process of their own that
imports neither Hydra nor OmegaConf."""

import importlib.util
import os
import urllib.error
import urllib.request
from pathlib import Path

from omegaconf import DictConfig

from ddp.config.schema import ConfigError
from ddp.reporting.trackers import TRACKERS, wandb_api_key_set

# make train installs neither tracker; make install adds one to .venv, pip to an environment of the user's own
INSTALL = {name: f"make install EXTRAS={name} (or, in an environment of your own: pip install -e '.[{name}]')" for name in TRACKERS}
WANDB_MODES = ("auto", "online", "offline")


def check_trackers(logger_cfg: DictConfig) -> None:
    """The picked trackers are installed and their settings usable (a server reachable)."""
    for name in TRACKERS:  # tensorboard is always installed
        if logger_cfg.get(name) is not None and importlib.util.find_spec(name) is None:
            raise ConfigError(f"logger={name}: {name} is not installed; install it with: {INSTALL[name]}")
    if logger_cfg.mlflow is not None and logger_cfg.mlflow.tracking_uri:
        check_mlflow_uri(logger_cfg.mlflow.tracking_uri)
    if logger_cfg.wandb is not None:
        mode = logger_cfg.wandb.mode
        if mode not in WANDB_MODES:
            raise ConfigError(f"logger.wandb.mode={mode}: unknown, use one of {', '.join(WANDB_MODES)}")
        if mode == "online" and not wandb_api_key_set():
            raise ConfigError("logger.wandb.mode=online: no W&B API key is set up; run `wandb login` (or set WANDB_API_KEY), "
                              "or use logger.wandb.mode=auto to run offline until then")
        check_wandb_environment()


def check_mlflow_uri(uri: str) -> None:
    key = f"logger.mlflow.tracking_uri={uri}"
    scheme = uri.split("://", 1)[0] if "://" in uri else ""
    if scheme in ("http", "https"):
        try:  # the tracking server's health endpoint
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=5):
                pass
        except (urllib.error.URLError, OSError, ValueError) as error:
            reason = getattr(error, "reason", error)
            raise ConfigError(f"{key}: the server can't be reached ({reason}); start it, fix the URL, "
                              "or drop the key for the local store outputs/mlflow.db") from None
    elif scheme == "sqlite":
        path = Path(uri.removeprefix("sqlite:///"))
        if not path.parent.is_dir():
            raise ConfigError(f"{key}: the folder {path.parent} doesn't exist; create it or drop the key for outputs/mlflow.db")
    elif scheme not in ("databricks", "file", "postgresql", "mysql", "mssql"):
        raise ConfigError(f"{key}: not a tracking URI; use http(s)://<host>:<port> for a server or sqlite:///<file>")


def check_wandb_environment() -> None:
    """The WANDB_* variables as W&B reads them when a run starts (wandb_setup: Settings.update_from_env_vars, which
    validates each one as it sets it, in the environment's order): one it rejects would otherwise only be logged then,
    and the run would go on without W&B. Setting them one at a time names the variable; nothing starts."""
    from pydantic import ValidationError
    from wandb.errors import UsageError  # what some of its validators raise instead (the API key's)
    from wandb.sdk.wandb_settings import Settings

    settings = Settings()
    for name, value in os.environ.items():
        if not name.startswith("WANDB_"):
            continue
        try:
            settings.update_from_env_vars({name: value})
        except (ValidationError, UsageError) as error:
            reason = "; ".join(problem["msg"] for problem in error.errors()) if isinstance(error, ValidationError) else error
            shown = name if "KEY" in name else f"{name}={value!r}"  # an API key stays off the console
            raise ConfigError(f"{shown} in the environment: W&B rejects it ({reason}); set a value W&B accepts, or unset it") from None
