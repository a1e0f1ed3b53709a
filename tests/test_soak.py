"""The seeded fault soak (tests/soak.py), short: one fault of each kind thrown at EXACT_DDP's 16 steps (2 ranks under
torchrun, 2 loader workers each), which must end bit-identical to tests/conftest.py's uninterrupted run of it.
`SOAK_SEED` and `SOAK_FAULTS` change the draw (as `make soak`'s settings do); a failure names the seed and the faults.
`make soak` runs a long one."""

import os

from conftest import EXACT_DDP
from soak import KINDS, draw, soak

SEED = int(os.environ.get("SOAK_SEED", "1"))
FAULTS = int(os.environ.get("SOAK_FAULTS", str(len(KINDS))))


def test_the_soak_draws_the_same_faults_from_a_seed_every_kind_in_turn():
    faults = draw(SEED, 2 * len(KINDS), 16)
    assert faults == draw(SEED, 2 * len(KINDS), 16) != draw(SEED + 1, 2 * len(KINDS), 16)
    assert sorted(fault["kind"] for fault in faults) == sorted(2 * KINDS)
    assert [fault["step"] for fault in faults] == sorted(fault["step"] for fault in faults)


def test_a_seeded_storm_of_faults_ends_bit_identical_to_the_run_left_alone(exact_ddp_reference, tmp_path):
    """A kill of each rank's process or loader worker, a kill inside a save, a SIGTERM of torchrun (then a relaunch
    with resume=<run dir>) and a flipped bit in a checkpoint just saved: every fault thrown once, a relaunch after each
    stop, each corruption skipped by the resume after it, and the end equal to the uninterrupted run's (soak() checks
    those it can tell from the run)."""
    alone_dir, _ = exact_ddp_reference
    summary = soak(SEED, FAULTS, EXACT_DDP, steps=16, workdir=tmp_path, alone_dir=alone_dir)
    thrown = [fault["kind"] for fault in summary["thrown"]]
    assert sorted(thrown) == sorted(fault["kind"] for fault in draw(SEED, FAULTS, 16)), summary
    assert summary["launches"] == 1 + thrown.count("stop"), summary
