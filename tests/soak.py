"""A seeded soak: one 2-rank torchrun run with loader workers, hit by a random stream of faults, must end
bit-identical to the same run left alone (model, optimizer, position, every rank's RNG states).

    python tests/soak.py --seed 7 --faults 30    # make soak SOAK_SEED=7 SOAK_FAULTS=30

The faults, drawn from the seed (as many of each kind, in a random order, at random steps), are fault.plan's
(ddp/training/faults.py): SIGKILL of a rank, of one of its loader workers, of rank 0 inside a checkpoint save,
SIGTERM of torchrun followed by a relaunch with `resume=<run dir>`, and a bit flipped in a checkpoint just saved
(then a SIGKILL, so that the restart must resume past it). torchrun restarts the ranks after each of the others.
Every fault is thrown once, however often the run passes its step again. A failure prints the seed and the
fault list: the same seed draws the same faults (where a kill lands within its step is the machine's timing).
tests/test_soak.py runs a short one in the suite.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

from ddp.training.faults import FaultPlan

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "train.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")
KINDS = FaultPlan.KINDS
# The run: augmentation in 2 loader workers per rank, dropout, a shuffled sampler, a checkpoint every 3 steps.
RUN = ["strategy=ddp", "data=synthetic", "data.num_samples=128", "data.num_val_samples=37", "data.image_size=8",
       "data.batch_size=8", "model.channels=[8,16]", "model.dropout=0.3", "data.augment=true", "data.num_workers=2",
       "trainer.log_every_n_steps=1"]
STEPS_PER_EPOCH = 8  # 128 samples / (2 ranks x 8)
COMPARED = ("model", "optimizer", "epoch", "batch_in_epoch", "global_step", "world_size")


def draw(seed: int, count: int, steps: int) -> list[dict]:
    """`count` faults, the kinds in turn then shuffled, each at a random step of the run's `steps`, in the order of
    their steps."""
    rng = random.Random(seed)
    kinds = [KINDS[index % len(KINDS)] for index in range(count)]
    rng.shuffle(kinds)
    faults = []
    for kind in kinds:
        fault = {"kind": kind, "step": rng.randint(1, steps)}
        if kind in ("kill_rank", "kill_worker"):
            fault["rank"] = rng.randrange(2)
        if kind == "kill_rank":
            fault["delay_ms"] = round(rng.uniform(0, 50), 1)
        if kind == "kill_worker":
            fault["worker"] = rng.randrange(2)
        if kind == "corrupt":
            fault["at"] = round(rng.random(), 6)
        faults.append(fault)
    return sorted(faults, key=lambda fault: fault["step"])


def torchrun(args: list[str], cwd: Path, max_restarts: int, log) -> int:
    """train.py on 2 ranks under torchrun, its output appended to `log`; the exit code."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env |= {"PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # gloo restarts (Makefile)
    command = [str(TORCHRUN), "--nproc_per_node=2", f"--max-restarts={max_restarts}", str(TRAIN), *args]
    log.write(f"$ {' '.join(command)}\n")
    log.flush()
    return subprocess.run(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=1800).returncode


def run_alone(args: list[str], workdir: Path) -> Path:
    """The run left alone: its run dir."""
    run_dir = workdir / "alone"
    with open(workdir / "alone.log", "w") as log:
        if torchrun([*args, f"hydra.run.dir={run_dir}"], workdir, 0, log):
            raise SoakFailed(f"the run without faults failed: {workdir / 'alone.log'}")
    return run_dir


def run_with_faults(args: list[str], faults: list[dict], workdir: Path) -> tuple[Path, int]:
    """The run under `faults`: torchrun restarts it after each fault, and it is launched again with resume=<run dir>
    after each SIGTERM of torchrun. Its run dir and number of launches."""
    run_dir, plan = workdir / "faulted", workdir / "faults.json"
    plan.write_text(json.dumps(faults, indent=1))
    launches = 0
    with open(workdir / "faulted.log", "w") as log:
        while True:
            stops_before = sum(fault["kind"] == "stop" for fault in thrown(plan))
            resume = [f"resume={run_dir}"] if launches else []
            # a restart per fault, and as many to spare (a restart that fails to start, on a loaded machine)
            returncode = torchrun([*args, f"hydra.run.dir={run_dir}", f"fault.plan={plan}", *resume], workdir, 2 * len(faults) + 2, log)
            launches += 1
            if returncode == 0:
                return run_dir, launches
            if sum(fault["kind"] == "stop" for fault in thrown(plan)) == stops_before:
                raise SoakFailed(f"launch {launches} failed (exit {returncode}), not stopped by a fault: {workdir / 'faulted.log'}")


def thrown(plan: Path) -> list[dict]:
    """The faults thrown so far, in order (fault.plan's journal)."""
    journal = Path(f"{plan}.thrown")
    return [json.loads(line) for line in journal.read_text().splitlines()] if journal.exists() else []


def differences(actual, expected, where: str) -> list[str]:
    """Where two saved states differ: tensors compared with torch.equal (and their dtypes), the rest with ==."""
    if isinstance(expected, torch.Tensor):
        same = isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype and actual.shape == expected.shape
        return [] if same and torch.equal(actual, expected) else [where]
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or actual.keys() != expected.keys():
            return [where]
        return [found for key in expected for found in differences(actual[key], expected[key], f"{where}[{key!r}]")]
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            return [where]
        return [found for index, pair in enumerate(zip(actual, expected)) for found in differences(*pair, f"{where}[{index}]")]
    return [] if actual == expected else [where]


def final_differences(run_dir: Path, alone_dir: Path) -> list[str]:
    """Where the faulted run's final last.pt differs from the run left alone's. Python's `random` is left out: nothing
    seeds it, so even two fresh runs differ there."""
    def comparable(directory: Path) -> dict:
        state = torch.load(directory / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
        ranks = [{key: value for key, value in rank.items() if key != "python_rng"} for rank in state["ranks"]]
        return {key: state[key] for key in COMPARED} | {"ranks": ranks}

    return differences(comparable(run_dir), comparable(alone_dir), "last.pt")


class SoakFailed(Exception):
    pass


def soak(seed: int, count: int, args: list[str], steps: int, workdir: Path, alone_dir: Path | None = None) -> dict:
    """Draws the faults, runs the run under them (and alone, unless `alone_dir` is given) and compares their ends. A
    summary: the faults thrown, the launches, the corrupt checkpoint files skipped, the time taken. SoakFailed, naming
    the seed and the faults, where the run failed, a fault was never thrown, a corruption was never found or the end
    differs."""
    faults = draw(seed, count, steps)
    started = time.monotonic()
    try:
        alone_dir = alone_dir or run_alone(args, workdir)
        run_dir, launches = run_with_faults(args, faults, workdir)
        survived = thrown(workdir / "faults.json")
        if len(survived) != len(faults):
            never = [fault for index, fault in enumerate(faults) if index not in {done["id"] for done in survived}]
            raise SoakFailed(f"{len(never)} fault(s) never thrown: {never}")
        if found := final_differences(run_dir, alone_dir):
            raise SoakFailed(f"the run ended unlike the run left alone, in {', '.join(found[:5])}")
        # each corruption is found by the resume after it (where the bit lands in what a resume recomputes, an RNG
        # state, the end is the same either way)
        skipped = (run_dir / "train_rank0.log").read_text().count("skipping checkpoint")  # a file, or another name of it
        if skipped < (corrupted := sum(fault["kind"] == "corrupt" for fault in survived)):
            raise SoakFailed(f"{corrupted} checkpoint(s) corrupted, {skipped} skipped as corrupt by a resume")
    except (SoakFailed, subprocess.TimeoutExpired) as error:
        raise SoakFailed(f"soak failed with --seed {seed} --faults {count}: {error}\nfaults: {json.dumps(faults)}") from None
    return {"seed": seed, "thrown": survived, "launches": launches, "corrupt_skipped": skipped,
            "seconds": time.monotonic() - started}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--faults", type=int, default=30, help="how many faults (default 30, 6 of each kind)")
    parser.add_argument("--epochs", type=int, default=6, help=f"the run's length ({STEPS_PER_EPOCH} steps each)")
    parser.add_argument("--every-n-steps", type=int, default=3, help="checkpoint.every_n_steps")
    parser.add_argument("--workdir", type=Path, default=REPO / "outputs" / "soak")
    options = parser.parse_args()
    workdir = options.workdir / time.strftime("%Y-%m-%d_%H-%M-%S")
    workdir.mkdir(parents=True)
    args = [*RUN, f"trainer.max_epochs={options.epochs}", f"checkpoint.every_n_steps={options.every_n_steps}"]
    steps = options.epochs * STEPS_PER_EPOCH
    print(f"soak: seed {options.seed}, {options.faults} faults over {steps} steps, in {workdir}", flush=True)
    try:
        summary = soak(options.seed, options.faults, args, steps, workdir)
    except SoakFailed as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for fault in summary["thrown"]:
        where = f" of rank {fault['rank']}" if "rank" in fault else ""
        print(f"  step {fault['thrown_at_step']:3d}  {fault['kind']}{where}")
    kinds = {kind: sum(fault["kind"] == kind for fault in summary["thrown"]) for kind in KINDS}
    print(f"survived {len(summary['thrown'])} faults ({', '.join(f'{n} {kind}' for kind, n in kinds.items())}) in "
          f"{summary['launches']} launches, {summary['corrupt_skipped']} corrupt checkpoint(s) skipped, "
          f"{summary['seconds']:.0f} s: bit-identical to the run left alone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
