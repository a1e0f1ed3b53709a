"""Research recipes on real runs of train.py: mixed precision, accumulation, LR schedules, clipping,
EMA, channels_last and compile, composed with DDP, exact resume and the no-host-sync loop."""

import json
import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import (REPO, TINY, check, hparams_table, job_dir, launch, load_last, load_results, results_of, run_dirs,
                      run_in_this_process, shared_run, write_imagefolder)
from data import build_datasets
from ddp.distributed.env import DistEnv
from ddp.loading.loaders import build_val_loader
from ddp.training.ema import build_ema
from models import build_model
from models.small_cnn import SmallCNN
from ddp.training.evaluation import evaluate
from conftest import last_checkpoint
from test_fault_tolerance import assert_bit_identical, assert_same_state
from test_update import cosine_with_warmup
from tasks.classification import ClassificationTask

# Everything on, under 2-rank DDP, on a folder of 4 x 32 training PNGs read by 2 workers per rank:
# 8 micro-batches of 8 per rank and epoch, 2 per update: 4 updates per epoch, 8 in all; a checkpoint
# and a log line every 2 updates. Clipping at 0.7 cuts the first updates' gradients (norms about 0.9).
RECIPE = ["strategy=ddp", *[arg for arg in TINY if not arg.startswith("data")], "data=imagefolder", "data.image_size=8",
          "data.batch_size=8", "data.num_workers=2", "data.augment=randaugment", "data.random_erase=0.25",
          "data.mixup_alpha=0.2", "data.cutmix_alpha=1.0", "trainer.label_smoothing=0.1", "model.dropout=0.2", "precision=bf16",
          "trainer.accumulate_grad_batches=2", "scheduler=cosine", "scheduler.warmup_steps=3", "trainer.gradient_clip_norm=0.7",
          "ema.decay=0.9", "channels_last=true", "checkpoint.every_n_steps=2"]
INSTRUMENTED = REPO / "tests" / "workers" / "instrumented_train.py"
UPDATE_STATE_KEYS = ("scheduler", "scaler", "ema")


def instrumented(args: list[str], cwd, env: dict | None = None, timeout: float = 180):
    (cwd / "watch").mkdir()
    result = launch(args, cwd, nproc=2, env={"WATCH_DIR": str(cwd / "watch"), **(env or {})}, script=INSTRUMENTED,
                    timeout=timeout)
    check(result)
    return cwd / "watch"


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> list[str]:
    """RECIPE's arguments, with data.root at a generated ImageFolder tree (one for all test processes)."""
    def produce(root: Path) -> None:
        write_imagefolder(root, classes=("a", "b", "c", "d"), per_class={"train": 32, "val": 9}, size=(12, 10))

    root, _ = shared_run("recipe_images", produce, tmp_path_factory)
    return [*RECIPE, f"data.root={root}"]


@pytest.fixture(scope="module")
def recipe_run(recipe, tmp_path_factory):
    """The whole recipe, uninterrupted, watched for collectives and host reads, once for all test
    processes (shared_run): (cwd, watch dir)."""
    cwd, _ = shared_run("recipe_run", lambda cwd: str(instrumented(recipe, cwd)), tmp_path_factory)
    return cwd, cwd / "watch"


def test_everything_on_reports_the_recipe(recipe_run):
    results = load_results(recipe_run[0])
    assert (results["steps"], results["global_batch_size"], results["precision"]) == (8, 32, "bf16")
    assert results["val_samples"] == 36 and results["val_accuracy"] > 0.5  # 4 classes: it learns through the mixing
    checkpoint = load_last(recipe_run[0])
    assert checkpoint["scheduler"]["last_epoch"] == 8 and int(checkpoint["ema"]["n_averaged"]) == 8
    assert checkpoint["scaler"] is None  # bf16 needs none


def test_the_checkpointed_ema_is_the_one_reported_and_not_the_model(recipe_run):
    """checkpoint["ema"], loaded into a model in one process, scores the run's val_ema_*; its weights
    are an average, none equal to the model's."""
    checkpoint, results = load_last(recipe_run[0]), load_results(recipe_run[0])
    cfg = OmegaConf.create(checkpoint["config"])
    cfg.data.num_workers = 0
    splits = build_datasets(cfg.data)
    model = build_model(cfg.model, splits.num_classes, splits.in_channels).to(memory_format=torch.channels_last)
    ema = build_ema(model, cfg.ema.decay)
    ema.load_state_dict(checkpoint["ema"])
    metrics = evaluate(ema.module, build_val_loader(splits.val, cfg.data, DistEnv(), pin_memory=False), torch.device("cpu"), -1, ClassificationTask())
    assert metrics["val_samples"] == results["val_samples"] == 36
    assert metrics["val_accuracy"] == results["val_ema_accuracy"]
    assert metrics["val_loss"] == pytest.approx(results["val_ema_loss"], rel=1e-6)  # float32 sums over other batch groupings
    averaged = ema.module.state_dict()
    for key, value in checkpoint["model"].items():
        if value.is_floating_point():
            assert not torch.equal(averaged[key], value), key


# torchvision draws MixUp's and CutMix's parameters (and which of the two) from CPU tensors, and
# F.one_hot checks its labels' range only off CUDA: on a GPU none of these reads waits for the device.
CPU_ONLY_READS = "torchvision/transforms/v2/"


def test_everything_on_still_does_no_collective_or_host_read_on_quiet_updates(recipe_run):
    """Updates 1, 3, 5 and 7 neither log, nor end an epoch, nor save: from such an update to the next
    (two micro-batches in between) nothing is all-reduced and nothing read to the host."""
    for rank in (0, 1):
        events = json.loads((recipe_run[1] / f"syncs_rank{rank}.json").read_text())
        quiet = [(step, name) for step, name in events if step in (1, 3, 5, 7)]
        assert quiet == [], (rank, quiet)
        assert any(step == 2 and name == "all_reduce" for step, name in events)
        host_reads = json.loads((recipe_run[1] / f"host_reads_rank{rank}.json").read_text())
        quiet_reads = [(step, kind, where) for step, kind, where in host_reads
                       if step in (1, 3, 5, 7) and not where.startswith(CPU_ONLY_READS)]
        assert quiet_reads == [], (rank, quiet_reads)


def test_everything_on_trains_channels_last_in_bf16_with_clipped_gradients(recipe_run):
    """Seen from outside train.py: every convolution in training gets a channels_last input and
    computes in bfloat16; train/grad_norm (the norm before clipping) is logged, above clip_norm at
    least once (so clipping had work to do), and every gradient the optimizer applied has a norm of
    at most clip_norm."""
    cwd, watch = recipe_run
    accumulator = EventAccumulator(str(run_dirs(cwd)[0]))
    accumulator.Reload()
    logged = [(e.step, e.value) for e in accumulator.Scalars("train/grad_norm")]
    assert [step for step, _ in logged] == [2, 4, 6, 8] and max(norm for _, norm in logged) > 0.7, logged
    for rank in (0, 1):
        assert json.loads((watch / f"convs_rank{rank}.json").read_text()) == [[True, "torch.bfloat16"]]
        applied = json.loads((watch / f"applied_grad_norms_rank{rank}.json").read_text())
        assert len(applied) == 8 and all(norm <= 0.7 * (1 + 1e-6) for norm in applied), applied


def test_a_resume_with_everything_on_is_bit_identical(recipe, recipe_run, tmp_path):
    """2 ranks resume the recipe from its step-4 checkpoint (update 4 of 8, an epoch's end): model,
    optimizer, scheduler, scaler and EMA end exactly as in the uninterrupted run (RandAugment, random
    erasing, MixUp/CutMix and dropout draw the same numbers again). A resume from a file, not a kill:
    a torchrun restart after a killed rank finds its checkpoint and ends bit-identical in
    test_fault_tolerance.py; what this run adds is the recipe's state."""
    (reference_dir,) = run_dirs(recipe_run[0])
    check(launch([*recipe, f"resume={reference_dir / 'checkpoints' / 'step-00000004.pt'}"], tmp_path, nproc=2, timeout=240))
    (run_dir,) = run_dirs(tmp_path)
    assert "at epoch 1, batch 0, step 4" in (run_dir / "train_rank0.log").read_text()
    resumed, reference = last_checkpoint(run_dir), load_last(recipe_run[0])
    assert_bit_identical(resumed, reference)
    assert_same_state({k: resumed[k] for k in UPDATE_STATE_KEYS}, {k: reference[k] for k in UPDATE_STATE_KEYS})


def test_two_ranks_accumulating_two_micro_batches_equal_one_process_with_four_times_the_batch(tmp_path, monkeypatch):
    """GroupNorm (per-sample statistics): 2 ranks x batch 8 x 2 micro-batches = 1 process x batch 32,
    up to float summation order; and DDP skipped the gradient all-reduce of every first micro-batch.
    The one process is train.run in this one (a launch costs seconds of start-up)."""
    common = [*TINY, "model.norm=group", "optim=adam", "trainer.max_epochs=2"]
    (tmp_path / "ddp").mkdir()
    # WATCH_TENSORS=0: no_sync is counted without the dispatch mode that sees every operation (and costs CPU)
    watch = instrumented(["strategy=ddp", *common, "data.batch_size=8", "trainer.accumulate_grad_batches=2"], tmp_path / "ddp",
                         env={"WATCH_TENSORS": "0"})
    single = tmp_path / "single" / "run"
    monkeypatch.chdir(tmp_path)
    run_in_this_process(["strategy=single", *common, "data.batch_size=32"], single)
    accumulated, whole = load_last(tmp_path / "ddp")["model"], last_checkpoint(single)["model"]
    for key in whole:
        torch.testing.assert_close(accumulated[key], whole[key], rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")
    assert [int((watch / f"no_sync_rank{rank}.txt").read_text()) for rank in (0, 1)] == [8, 8]  # 2 epochs x 4 updates
    single_results = json.loads((single / "results.json").read_text())
    assert load_results(tmp_path / "ddp")["global_batch_size"] == single_results["global_batch_size"] == 32


# One process in fp16 with a cosine schedule (warmup 10 of 32 updates), a checkpoint every 5 updates (all kept):
# straight through, and resumed from its step-5 checkpoint (in the warmup) in a run dir of its own.
FP16_COSINE = ["strategy=single", *TINY, "precision=16", "trainer.log_every_n_steps=1", "scheduler=cosine",
               "scheduler.warmup_steps=10", "scheduler.min_lr=0.001", "checkpoint.every_n_steps=5", "checkpoint.keep_last=10"]


@pytest.fixture(scope="module")
def fp16_cosine(tmp_path_factory):
    """FP16_COSINE's run dirs: (straight, resumed from the straight run's step-5 checkpoint). Both by
    train.run in this process (a launch costs seconds of start-up; what is checked is the training's)."""
    straight, resumed = (tmp_path_factory.mktemp(name) / "run" for name in ("fp16_straight", "fp16_resumed"))
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.chdir(straight.parent)
        run_in_this_process(FP16_COSINE, straight)
        monkeypatch.chdir(resumed.parent)
        run_in_this_process([*FP16_COSINE, f"resume={straight / 'checkpoints' / 'step-00000005.pt'}"], resumed)
    return straight, resumed


def logged_lr(run_dir) -> list[tuple[int, float]]:
    accumulator = EventAccumulator(str(run_dir))
    accumulator.Reload()
    return [(e.step, e.value) for e in accumulator.Scalars("train/lr")]


def test_logged_lr_is_the_schedule_step_for_step_across_a_resume_in_warmup(fp16_cosine):
    """Straight: updates 1 to 32; resumed from update 5: updates 6 to 32, each the LR of the schedule.
    (A kill and a resume in the same run dir, whose TensorBoard events a reader sees once per step:
    test_fault_tolerance.py.)"""
    for run_dir, first_step in zip(fp16_cosine, (1, 6)):
        logged = logged_lr(run_dir)
        assert [step for step, _ in logged] == list(range(first_step, 33)), run_dir
        expected = [cosine_with_warmup(step - 1, 0.05, 10, 32, 0.001) for step, _ in logged]
        assert [value for _, value in logged] == pytest.approx(expected, rel=1e-6)  # TensorBoard stores float32


def test_a_resume_with_a_changed_lr_trains_at_it_and_reports_it(tmp_path, monkeypatch):
    """4 updates at optim.lr=0.05, then resumed with optim.lr=0.5 up to update 8: the optimizer trains
    at 0.5 (not the checkpoint's 0.05), and train/lr (TensorBoard's reader), results.json, the
    optimizer's state in the final checkpoint and the HParams table (TensorBoard's own backend) all
    say so, with each attempt's events in its one file. Both attempts by train.run in this process
    (a launch costs seconds of start-up; resuming a run dir through a launch: test_trainer.py)."""
    args = ["strategy=single", *TINY, "trainer.log_every_n_steps=1"]
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    run_in_this_process([*args, "trainer.max_steps=4"], run_dir)
    assert hparams_table(run_dir)["."]["lr"] == pytest.approx(0.05)
    run_in_this_process([*args, "trainer.max_steps=8", "optim.lr=0.5", f"resume={run_dir}"], run_dir)
    assert len(list(run_dir.glob("events.out.tfevents*"))) == 2  # one per attempt
    assert hparams_table(run_dir)["."]["lr"] == pytest.approx(0.5)
    # by step: both attempts ran in this process, so their files' names can sort in either order
    logged = sorted(logged_lr(run_dir))
    assert logged == [(step, pytest.approx(0.05 if step <= 4 else 0.5)) for step in range(1, 9)]
    assert results_of(run_dir)["lr"] == 0.5
    assert [group["lr"] for group in last_checkpoint(run_dir)["optimizer"]["param_groups"]] == [0.5]


@pytest.fixture(scope="module")
def digits_in_mixed_precision(tmp_path_factory):
    """The default data, with a narrower small_cnn, Adam and 4 epochs, in bf16 and in fp16: one multirun,
    so one process start for both. CPU has no fast fp16 kernels, and the default recipe in fp16 takes
    minutes here (fp32 and bf16 reach 0.96 on this recipe too). Once for all test processes (shared_run).
    {precision: its job's results.json}"""
    def produce(cwd: Path) -> dict:
        check(launch(["-m", "precision=bf16,16", "model.channels=[16,32]", "optim=adam", "optim.lr=0.01",
                      "trainer.max_epochs=4"], cwd, timeout=600))
        (sweep,) = (cwd / "outputs" / "multirun").iterdir()
        jobs = {"bf16": 0, "16": 1}  # the sweep's order
        return {precision: json.loads((job_dir(sweep, job) / "results.json").read_text()) for precision, job in jobs.items()}

    return shared_run("digits_in_mixed_precision", produce, tmp_path_factory)[1]


@pytest.mark.parametrize("precision", ["bf16", "16"])
def test_mixed_precision_still_learns_digits_to_over_90_percent(precision, digits_in_mixed_precision):
    results = digits_in_mixed_precision[precision]
    assert results["precision"] == precision and results["val_accuracy"] > 0.9, results


def test_fp16_resumes_its_grad_scaler_exactly(fp16_cosine):
    """Resumed from update 5: the same model, optimizer, scheduler and GradScaler state as 32 straight
    (a scaler started afresh would end with another growth count, if not another scale)."""
    straight, resumed = (last_checkpoint(run_dir) for run_dir in fp16_cosine)
    assert resumed["scaler"]["scale"] > 0
    assert_bit_identical(resumed, straight)
    assert_same_state({k: resumed[k] for k in UPDATE_STATE_KEYS}, {k: straight[k] for k in UPDATE_STATE_KEYS})


def test_compiled_ddp_trains_and_saves_plain_keys(tmp_path):
    """Each rank compiled a graph (dynamo's counters), and the checkpoint holds the plain module's keys.
    The watcher's dispatch mode is off: torch.compile compiles nothing under one."""
    watch = instrumented(["strategy=ddp", *TINY, "compile=true", "trainer.max_epochs=1", "trainer.limit_train_batches=3",
                          "trainer.limit_val_batches=2"], tmp_path, env={"WATCH_TENSORS": "0"}, timeout=600)
    for rank in (0, 1):
        dynamo = json.loads((watch / f"dynamo_rank{rank}.json").read_text())
        assert dynamo["stats"].get("unique_graphs", 0) >= 1 and dynamo["frames"].get("ok", 0) >= 1, (rank, dynamo)
    state = load_last(tmp_path)["model"]
    assert not any("_orig_mod" in key for key in state), list(state)
    SmallCNN(num_classes=10, in_channels=3, channels=[8, 16]).load_state_dict(state, strict=True)
    assert load_results(tmp_path)["steps"] == 3


@pytest.mark.parametrize("strategy,nproc", [(["strategy=single"], None), (["strategy=ddp", "strategy.nproc_per_node=2"], None),
                                            (["strategy=ddp"], 2)], ids=["single", "self_launched_ddp", "torchrun"])
def test_a_diverging_run_stops_in_one_line_and_never_saves_non_finite_weights(tmp_path, strategy, nproc):
    """Also under self-launched DDP, where the launcher prints the ranks' one line (no worker tracebacks), and under
    torchrun, where the ranks agree on it and rank 0 alone prints it (torchrun adds its own summary)."""
    result = launch([*strategy, *TINY, "optim.lr=1e6", "checkpoint.every_n_steps=1"], tmp_path, nproc=nproc)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    (line,) = [line for line in lines if line.startswith("error:")] if nproc else lines
    assert re.fullmatch(r"error: training diverged: a non-finite loss or gradient norm between steps \d+ and \d+ "
                        r"\(precision=32, lr=1e\+06\); .*", line), line
    for path in tmp_path.rglob("*.pt"):
        checkpoint = torch.load(path, weights_only=True)
        assert all(torch.isfinite(t).all() for t in checkpoint["model"].values() if t.is_floating_point()), path
    assert not list(tmp_path.rglob("results.json"))


def test_the_ema_of_a_syncbn_model_trains_under_ddp(tmp_path):
    """ema.decay with syncbn=true on 2 ranks: the EMA's copy of the model shares its SyncBN layers' process
    group (a group can't be copied), averages their statistics with the weights, and is evaluated."""
    check(launch(["strategy=ddp", "syncbn=true", "ema.decay=0.9", *TINY, "trainer.max_epochs=1"], tmp_path, nproc=2))
    run_dir = run_dirs(tmp_path)[0]
    results, checkpoint = results_of(run_dir), last_checkpoint(run_dir)
    assert results["replicas_identical"] and 0 <= results["val_ema_accuracy"] <= 1
    averaged = {key.removeprefix("module."): value for key, value in checkpoint["ema"].items()}
    means = [key for key in checkpoint["model"] if key.endswith("running_mean")]
    assert means and all(not torch.equal(averaged[key], checkpoint["model"][key]) for key in means)
