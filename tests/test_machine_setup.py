"""`make test`'s set-up of the machine (scripts/test-setup.sh) and what the suite says of what it lacks
(tests/machine.py, conftest's summary).

Once `make test` has set the machine up, its set-up does nothing and says nothing, in well under 5 s, as root
and as a user without root (whose PATH lacks sbin, where SLURM's daemons are). A test that needs a piece the
machine lacks is reported as skipped, never as passed, and pytest's last lines name it and the command that
sets it up; HYDRA_DDP_REQUIRE_BROWSER=1 makes that a failure. (A missing piece is made here by pointing
tests/machine.py at a browser path that doesn't exist, so that it runs the same on any machine.)"""

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from machine import REPO, need_browser, need_slurm

SETUP = REPO / "scripts" / "test-setup.sh"
USER_PATH = "/usr/local/bin:/usr/bin:/bin"  # Debian's PATH for a user: no sbin


def as_a_user_without_root() -> tuple[list[str], Path]:
    """The command prefix that runs a command as `nobody`, and a copy of the set-up scripts that it can read
    (the clone may lie in a folder only root reads); a skip where this process can't switch users."""
    if os.geteuid() != 0:
        pytest.skip("switching to another user needs root; this user is without root already (the other case)")
    copy = Path(tempfile.mkdtemp(prefix="test-setup-"))
    copy.chmod(0o755)
    shutil.copytree(REPO / "scripts", copy / "scripts")
    return ["runuser", "-u", "nobody", "--", "env", f"PATH={USER_PATH}"], copy / "scripts" / "test-setup.sh"


@pytest.mark.parametrize("user", ["this user", "a user without root"])
def test_a_set_up_machine_is_set_up_again_at_once_and_silently(user):
    """The second `make test` in a row spends under 5 s on its set-up and prints nothing of it."""
    need_browser()
    need_slurm()
    prefix, setup = as_a_user_without_root() if user == "a user without root" else ([], SETUP)
    started = time.monotonic()
    try:
        result = subprocess.run([*prefix, str(setup)], cwd=setup.parent, capture_output=True, text=True, timeout=60)
    finally:
        if setup != SETUP:
            shutil.rmtree(setup.parents[1])
    elapsed = time.monotonic() - started
    assert (result.returncode, result.stdout, result.stderr) == (0, "", ""), result
    assert elapsed < 5, f"{elapsed:.1f} s"


MISSING_BROWSER = """\
from pathlib import Path

import machine

machine.BROWSER = Path("/nonexistent/chromium")


def test_with_the_browser():
    machine.need_browser()


def test_without():
    pass
"""


def run_pytest_on(test_file, **env: str) -> subprocess.CompletedProcess:
    """pytest on `test_file` with the suite's conftest (its summary), as `make test` runs it (none of this
    pytest's own variables: PYTEST_ADDOPTS, xdist's)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                           f"--rootdir={test_file.parent}", str(test_file)], cwd=test_file.parent,
                          env=clean | {"PYTHONPATH": str(REPO / "tests")} | env, capture_output=True, text=True, timeout=300)


def test_a_test_without_its_browser_is_skipped_and_the_last_lines_say_how_to_run_it(tmp_path):
    """Skipped, not passed, and named in the last lines with the command; a failure where CI requires the browser."""
    test_file = tmp_path / "test_browser.py"
    test_file.write_text(MISSING_BROWSER)
    skipped = run_pytest_on(test_file, HYDRA_DDP_REQUIRE_BROWSER="")
    assert skipped.returncode == 0, skipped.stdout + skipped.stderr
    last = skipped.stdout.strip().splitlines()[-3:]
    assert "not run on this machine" in last[0], skipped.stdout
    assert last[1] == ("1 test of test_browser.py needs a browser (/nonexistent/chromium missing); "
                       "to run: sudo scripts/test-setup.sh"), skipped.stdout
    assert last[2].startswith("1 passed, 1 skipped in "), skipped.stdout

    required = run_pytest_on(test_file, HYDRA_DDP_REQUIRE_BROWSER="1")
    assert required.returncode == 1, required.stdout + required.stderr
    assert "HYDRA_DDP_REQUIRE_BROWSER=1, but a browser (/nonexistent/chromium missing)" in required.stdout
    assert required.stdout.strip().splitlines()[-1].startswith("1 failed, 1 passed in "), required.stdout
