"""Research recipes on real runs of train.py: mixed precision, accumulation, LR schedules, clipping,
EMA, channels_last and compile, composed with DDP, exact resume and the no-host-sync loop."""

import json
import re
import subprocess

import pytest
import torch
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import (REPO, TINY, TORCHRUN, TRAIN, check, hparams_table, launch, load_last, load_results, run_dirs,
                      write_imagefolder)
from data import build_datasets
from ddp.env import DistEnv
from ddp.loaders import build_val_loader
from ddp.ema import build_ema
from models import build_model
from models.small_cnn import SmallCNN
from ddp.evaluation import evaluate
from test_fault_tolerance import _clean_env, assert_bit_identical, assert_same_state, last_checkpoint
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
    """RECIPE's arguments, with data.root at a generated ImageFolder tree."""
    root = write_imagefolder(tmp_path_factory.mktemp("recipe_images"), classes=("a", "b", "c", "d"),
                             per_class={"train": 32, "val": 9}, size=(12, 10))
    return [*RECIPE, f"data.root={root}"]


@pytest.fixture(scope="module")
def recipe_run(recipe, tmp_path_factory):
    """The whole recipe, uninterrupted, watched for collectives and host reads: (cwd, watch dir)."""
    cwd = tmp_path_factory.mktemp("recipe")
    return cwd, instrumented(recipe, cwd)


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


def test_kill_and_resume_with_everything_on_is_bit_identical(recipe, recipe_run, tmp_path):
    """Rank 1 dies after update 5; the restarted workers resume from update 4: model, optimizer,
    scheduler, scaler and EMA end exactly as in the uninterrupted run (RandAugment, random erasing,
    MixUp/CutMix and dropout draw the same numbers again)."""
    command = [str(TORCHRUN), "--nproc_per_node=2", "--max-restarts=1", str(TRAIN), *recipe, "fault.kill_rank=1",
               "fault.at_step=5"]
    check(subprocess.run(command, cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, timeout=240))
    (run_dir,) = run_dirs(tmp_path)
    assert "at epoch 1, batch 0, step 4" in (run_dir / "train_rank0.log").read_text()
    resumed, reference = last_checkpoint(run_dir), load_last(recipe_run[0])
    assert_bit_identical(resumed, reference)
    assert_same_state({k: resumed[k] for k in UPDATE_STATE_KEYS}, {k: reference[k] for k in UPDATE_STATE_KEYS})


def test_two_ranks_accumulating_two_micro_batches_equal_one_process_with_four_times_the_batch(tmp_path):
    """GroupNorm (per-sample statistics): 2 ranks x batch 8 x 2 micro-batches = 1 process x batch 32,
    up to float summation order; and DDP skipped the gradient all-reduce of every first micro-batch."""
    common = [*TINY, "model.norm=group", "optim=adam", "trainer.max_epochs=2"]
    (tmp_path / "ddp").mkdir()
    watch = instrumented(["strategy=ddp", *common, "data.batch_size=8", "trainer.accumulate_grad_batches=2"], tmp_path / "ddp")
    (tmp_path / "single").mkdir()
    check(launch(["strategy=single", *common, "data.batch_size=32"], tmp_path / "single"))
    accumulated, whole = load_last(tmp_path / "ddp")["model"], load_last(tmp_path / "single")["model"]
    for key in whole:
        torch.testing.assert_close(accumulated[key], whole[key], rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")
    assert [int((watch / f"no_sync_rank{rank}.txt").read_text()) for rank in (0, 1)] == [8, 8]  # 2 epochs x 4 updates
    assert load_results(tmp_path / "ddp")["global_batch_size"] == load_results(tmp_path / "single")["global_batch_size"] == 32


def test_logged_lr_is_the_schedule_step_for_step_across_a_resume_in_warmup(tmp_path):
    """cosine, warmup 10 of 32 updates; the run dies at update 7 and resumes from update 5 (in the warmup)."""
    args = ["strategy=single", *TINY, "trainer.log_every_n_steps=1", "scheduler=cosine", "scheduler.warmup_steps=10",
            "scheduler.min_lr=0.001", "checkpoint.every_n_steps=5"]
    killed = launch([*args, "fault.kill_rank=0", "fault.at_step=7"], tmp_path)
    assert killed.returncode != 0
    (run_dir,) = run_dirs(tmp_path)
    check(launch([*args, f"resume={run_dir}"], tmp_path))
    accumulator = EventAccumulator(str(run_dir))
    accumulator.Reload()
    logged = [(e.step, e.value) for e in accumulator.Scalars("train/lr")]
    assert [step for step, _ in logged] == list(range(1, 33))
    expected = [cosine_with_warmup(step - 1, 0.05, 10, 32, 0.001) for step, _ in logged]
    assert [value for _, value in logged] == pytest.approx(expected, rel=1e-6)  # TensorBoard stores float32


def test_a_resume_with_a_changed_lr_trains_at_it_and_reports_it(tmp_path):
    """4 updates at optim.lr=0.05, then resumed with optim.lr=0.5 up to update 8: the optimizer trains
    at 0.5 (not the checkpoint's 0.05), and train/lr (TensorBoard's reader), results.json, the
    optimizer's state in the final checkpoint and the HParams table (TensorBoard's own backend) all
    say so, with each attempt's events in its one file."""
    args = ["strategy=single", *TINY, "trainer.log_every_n_steps=1"]
    check(launch([*args, "trainer.max_steps=4"], tmp_path))
    (run_dir,) = run_dirs(tmp_path)
    assert hparams_table(run_dir)["."]["lr"] == pytest.approx(0.05)
    check(launch([*args, "trainer.max_steps=8", "optim.lr=0.5", f"resume={run_dir}"], tmp_path))
    assert len(list(run_dir.glob("events.out.tfevents*"))) == 2  # one per attempt
    assert hparams_table(run_dir)["."]["lr"] == pytest.approx(0.5)
    accumulator = EventAccumulator(str(run_dir))
    accumulator.Reload()
    logged = [(e.step, e.value) for e in accumulator.Scalars("train/lr")]
    assert logged == [(step, pytest.approx(0.05 if step <= 4 else 0.5)) for step in range(1, 9)]
    assert load_results(tmp_path)["lr"] == 0.5
    assert [group["lr"] for group in load_last(tmp_path)["optimizer"]["param_groups"]] == [0.5]


@pytest.mark.parametrize("precision", ["bf16", "16"])
def test_mixed_precision_still_learns_digits_to_over_90_percent(precision, tmp_path):
    """The default data, with a narrower small_cnn, Adam and 4 epochs: CPU has no fast fp16 kernels,
    and the default recipe in fp16 takes minutes here (fp32 and bf16 reach 0.96 on this recipe too)."""
    check(launch([f"precision={precision}", "model.channels=[16,32]", "optim=adam", "optim.lr=0.01", "trainer.max_epochs=4"],
                 tmp_path, timeout=300))
    results = load_results(tmp_path)
    assert results["precision"] == precision and results["val_accuracy"] > 0.9, results


def test_fp16_resumes_its_grad_scaler_exactly(tmp_path):
    """Stop at update 3, extend to 6: the same model, optimizer and GradScaler state as 6 straight."""
    args = ["strategy=single", *TINY, "precision=16"]
    (tmp_path / "first").mkdir()
    check(launch([*args, "trainer.max_steps=3"], tmp_path / "first"))
    (first,) = run_dirs(tmp_path / "first")
    check(launch([*args, "trainer.max_steps=6", f"resume={first}"], tmp_path / "first"))
    (tmp_path / "straight").mkdir()
    check(launch([*args, "trainer.max_steps=6"], tmp_path / "straight"))
    extended, straight = last_checkpoint(first), load_last(tmp_path / "straight")
    assert extended["scaler"]["scale"] > 0
    assert_bit_identical(extended, straight)
    assert_same_state(extended["scaler"], straight["scaler"])


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


def test_a_diverging_run_stops_in_one_line_and_never_saves_non_finite_weights(tmp_path):
    result = launch(["strategy=single", *TINY, "optim.lr=1e6", "checkpoint.every_n_steps=1"], tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert re.fullmatch(r"error: training diverged: a non-finite loss or gradient norm between steps \d+ and \d+ "
                        r"\(precision=32, lr=1e\+06\); .*", line), line
    for path in tmp_path.rglob("*.pt"):
        checkpoint = torch.load(path, weights_only=True)
        assert all(torch.isfinite(t).all() for t in checkpoint["model"].values() if t.is_floating_point()), path
    assert not list(tmp_path.rglob("results.json"))
