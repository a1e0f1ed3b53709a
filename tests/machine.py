"""What the suite needs of the machine outside .venv/, which `make test` sets up where it can
(scripts/test-setup.sh): a browser and its driver, and SLURM running. A test that needs a piece the machine
lacks skips, its reason naming the command that sets it up (and conftest's summary lists those skips last),
or fails where HYDRA_DDP_REQUIRE_BROWSER=1 or HYDRA_DDP_REQUIRE_SLURM=1 asks for the piece (as CI does).

A SLURM of the machine's own (an /etc/slurm/slurm.conf that scripts/slurm/local-cluster.sh didn't write)
gets jobs only where HYDRA_DDP_SLURM_PARTITION names one of its partitions."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SETUP = "sudo scripts/test-setup.sh"
NOT_HERE = "not on this machine: "  # every such skip's reason starts so (conftest's summary finds them by it)

BROWSER, DRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")

LOCAL_CLUSTER = REPO / "scripts" / "slurm" / "local-cluster.sh"
# The daemons live in sbin, which a user's PATH may lack.
SLURM_COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel")
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
PARTITION_VARIABLE = "HYDRA_DDP_SLURM_PARTITION"
SLURM_PARTITION = os.environ.get(PARTITION_VARIABLE) or None  # None: the cluster's default partition
OWN_SLURM = 3  # local-cluster.sh status's exit code where the machine has a SLURM of its own


def cannot_run(variable: str, reason: str) -> None:
    """Skip (a laptop without root); fail where `variable`=1 asks for the piece, so that a piece that went
    missing never passes as a skip."""
    if os.environ.get(variable) == "1":
        pytest.fail(f"{variable}=1, but {reason.removeprefix(NOT_HERE)}")
    pytest.skip(reason)


def need_browser() -> None:
    missing = [str(path) for path in (BROWSER, DRIVER) if not path.exists()]
    if missing:
        cannot_run("HYDRA_DDP_REQUIRE_BROWSER", f"{NOT_HERE}a browser ({', '.join(missing)} missing); to run: {SETUP}")


def need_slurm() -> None:
    """The one-node SLURM running, or a SLURM of the machine's own with HYDRA_DDP_SLURM_PARTITION set."""
    status = subprocess.run([LOCAL_CLUSTER, "status"], capture_output=True).returncode
    if status == 0 or (status == OWN_SLURM and SLURM_PARTITION):
        return
    if status == OWN_SLURM:
        reason = (f"a partition of this machine's own SLURM, which gets no jobs unasked; "
                  f"to run: {PARTITION_VARIABLE}=<partition> make test")
    elif missing := [name for name in SLURM_COMMANDS if shutil.which(name, path=SEARCH_PATH) is None]:
        reason = f"SLURM (not installed: {' '.join(missing)} missing); to run: {SETUP}"
    else:
        reason = f"the one-node SLURM (installed, not running); to run: {SETUP}"
    cannot_run("HYDRA_DDP_REQUIRE_SLURM", NOT_HERE + reason)


def own_slurm() -> bool:
    return subprocess.run([LOCAL_CLUSTER, "status"], capture_output=True).returncode == OWN_SLURM
