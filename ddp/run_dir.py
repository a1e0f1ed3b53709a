"""One run dir per launch, even under torchrun.

Every torchrun worker runs @hydra.main, and `${now:}` is resolved per process, so ranks started
a moment apart would land in different timestamped dirs (hydra#2070). Here all ranks of one
launch agree on the launch time, and so on one dir, which also stays the same when torchrun
restarts the workers.
"""

import functools
import os
import sys
import time
from datetime import datetime
from pathlib import Path

from omegaconf import OmegaConf
from torch.distributed import TCPStore

from ddp.env import DistEnv

_STORE_KEY = "hydra_ddp/launch_time"


@functools.cache
def launch_time() -> float:
    """The launch time of this process's launch, the same on every rank."""
    now = time.time()
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return now
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun shares its store with the workers; the first rank to ask sets the value,
        # and the store outlives worker restarts.
        store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
        return float(store.compare_set(_STORE_KEY, "", repr(now)))
    # Store not shared (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): claim a file named after the
    # run id, which torchrun keeps across restarts.
    run_id = os.environ["TORCHELASTIC_RUN_ID"]
    if run_id == "none":
        # Raised inside Hydra's resolution of the run dir, where an exception becomes a traceback.
        print("error: torchrun gave this launch no id (--rdzv-id defaults to none with --rdzv-endpoint) and "
              "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 disables its shared store, so the ranks can't agree on a run dir: "
              "pass --rdzv-id=<unique id> to torchrun, or set hydra.run.dir explicitly", file=sys.stderr)
        sys.exit(1)
    claim = Path("outputs/.launches") / run_id
    claim.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        for _ in range(600):
            text = claim.read_text()
            if text:
                return float(text)
            time.sleep(0.05)
        raise RuntimeError(f"{claim}: still empty after 30 s; remove it and relaunch") from None
    tmp = claim.with_suffix(".tmp")
    tmp.write_text(repr(now))
    os.replace(tmp, claim)
    os.close(fd)
    return now


def _process_log_name(strategy: str, nproc_per_node: int) -> str:
    """`rank<R>` for a training process; `launcher` for one that will start DDP workers itself."""
    env = DistEnv.from_environ()
    if not env.under_torchrun and strategy == "ddp" and nproc_per_node > 0:
        return "launcher"
    return f"rank{env.rank}"


def register_resolvers() -> None:
    """`${launch_time:FORMAT}` for run and sweep dirs; `${resume_dir:RESUME,DEFAULT}` continues in the
    run dir that `resume=` names; `${rank_zero_only:VALUE}` is null on other ranks;
    `${process_log_name:STRATEGY,NPROC}` names this process's log file."""
    OmegaConf.register_new_resolver(
        "launch_time", lambda fmt: datetime.fromtimestamp(launch_time()).strftime(fmt), replace=True
    )
    OmegaConf.register_new_resolver(
        "resume_dir", lambda resume, default: resume if resume and Path(resume).is_dir() else default, replace=True
    )
    OmegaConf.register_new_resolver("process_log_name", _process_log_name, replace=True)
    OmegaConf.register_new_resolver(
        "rank_zero_only", lambda value: value if DistEnv.from_environ().is_main else None, replace=True
    )
