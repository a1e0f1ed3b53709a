"""`make gpu-check`: the CUDA paths of train.py in one short run on one GPU.

    make gpu-check                  # with the project's .venv
    make gpu-check PY=python3       # with any Python that has torch (2.11 or newer) and hydra-core
    python tests/gpu/gpu_check.py kill_and_resume_is_exact dataparallel_on_one_gpu   # only the checks named

Each check launches train.py for real (python or torchrun) in a scratch dir, some under
tests/gpu/watched_train.py, which watches the run from outside the product code (host syncs on quiet
updates, convolution layouts and dtypes, no_sync, compiled graphs), and prints one PASS/FAIL line
with its figures; the exit status is 0 when all pass. Without a CUDA GPU it says so
and exits 0 without running anything. It uses at most one GPU (cuda:0): two ranks share it over
gloo, and nccl runs at world size 1.
"""

import gzip
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "train.py"
# --standalone: a free port for torchrun's store. Without it torch 2.11's torchrun takes port 29500, so a gpu-check
# beside another job that holds it (or beside a second gpu-check) fails with EADDRINUSE (seen on an H200)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
# Small and quick, with BatchNorm, dropout and random augmentation where a check needs them.
TINY = ["data=synthetic", "data.num_samples=256", "data.num_val_samples=64", "data.image_size=16", "model.channels=[16,32]"]
WATCHED = REPO / "tests" / "gpu" / "watched_train.py"
# The CPU suite's mixed-precision recipe for digits (tests/test_recipes.py), above 0.9 in 4 epochs there.
DIGITS_MIXED = ["strategy=single", "model.channels=[16,32]", "optim=adam", "optim.lr=0.01", "trainer.max_epochs=4",
                "data.num_workers=2"]
# Every recipe feature on, compiled, under DDP at world size 1 over nccl: 256 samples in micro-batches of 8,
# 2 per update, so 16 updates per epoch and 32 in all. Updates 8, 16, 24 and 32 log (the throughput
# clock's warm-up, which synchronises, ends at 8 too); 16 and 32 end an epoch and save. Every other
# update is quiet: no log, no epoch end, no save. Update 1's window is not: DDP's reducer rebuilds its buckets once,
# in the forward after the first synced backward, and broadcasts their order from rank 0 through the host
# (torch's DistributedDataParallel._pre_forward, reducer._rebuild_buckets); seen on an H200, torch 2.11.
RECIPE = ["strategy=ddp", "backend=nccl", *TINY, "data.batch_size=8", "data.num_workers=2", "data.augment=true",
          "data.mixup_alpha=0.2", "data.cutmix_alpha=1.0", "trainer.label_smoothing=0.1", "model.dropout=0.2",
          "precision=bf16", "trainer.accumulate_grad_batches=2", "scheduler=cosine", "scheduler.warmup_steps=3",
          "trainer.gradient_clip_norm=1.0", "ema.decay=0.9", "channels_last=true", "compile=true", "trainer.max_epochs=2",
          "trainer.log_every_n_steps=8", "trainer.warmup_steps=8", "checkpoint.every_n_steps=16"]
RECIPE_UPDATES = 32
QUIET_UPDATES = [update for update in range(2, RECIPE_UPDATES + 1) if update % 8]


def launch(args: list[str], cwd: Path, nproc: int | None = None, env: dict | None = None, max_restarts: int = 0,
           timeout: float = 240, script: Path = TRAIN) -> subprocess.CompletedProcess:
    """train.py (or `script`) in `cwd` (made if needed) on cuda:0 only; under torchrun when `nproc` is given."""
    cwd.mkdir(parents=True, exist_ok=True)
    if nproc is None:
        command = [sys.executable, str(script), *args]
    else:
        command = [*TORCHRUN, f"--nproc_per_node={nproc}", f"--max-restarts={max_restarts}", str(script), *args]
    environment = os.environ | {"CUDA_VISIBLE_DEVICES": "0", "PYTHONUNBUFFERED": "1",
                                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} | (env or {})
    result = subprocess.run(command, cwd=cwd, env=environment, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}: {' '.join(args)}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def watched(args: list[str], cwd: Path, nproc: int | None = None, env: dict | None = None) -> dict:
    """`launch` under tests/gpu/watched_train.py; returns rank 0's watch report (its docstring says what it holds)."""
    (cwd / "watch").mkdir(parents=True, exist_ok=True)
    report = cwd / "watch" / "watch_rank0.json"
    try:
        launch(args, cwd, nproc=nproc, env={"WATCH_DIR": str(cwd / "watch"), **(env or {})}, script=WATCHED)
    except AssertionError as failure:
        if report.exists() and json.loads(report.read_text()).get("stopped_in_error_mode"):
            quiet = json.loads(report.read_text())["error_mode_after"][-1]
            raise AssertionError(f"a host sync between the optimizer steps of updates {quiet} and {quiet + 1} (sync "
                                 f"debug mode 'error'; the traceback below shows where)\n{failure}") from None
        raise
    return json.loads(report.read_text())


def run_dir(cwd: Path) -> Path:
    (found,) = {log.parent for log in (cwd / "outputs").rglob("train_rank0.log")}
    return found


def results(cwd: Path) -> dict:
    return json.loads((run_dir(cwd) / "results.json").read_text())


def last_checkpoint(cwd: Path) -> dict:
    return torch.load(run_dir(cwd) / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)


def tensor_differences(actual, expected, where: str = "") -> list[str]:
    """Every tensor (in nested dicts/lists) that differs, with its largest absolute difference."""
    if isinstance(expected, torch.Tensor):
        if actual.shape != expected.shape or not torch.equal(actual, expected):
            diff = (actual.double() - expected.double()).abs().max().item() if actual.shape == expected.shape else float("nan")
            return [f"{where} (max abs diff {diff:.3g})"]
        return []
    if isinstance(expected, dict):
        return [d for key in expected for d in tensor_differences(actual[key], expected[key], f"{where}.{key}")]
    if isinstance(expected, (list, tuple)):
        return [d for i, (a, e) in enumerate(zip(actual, expected)) for d in tensor_differences(a, e, f"{where}[{i}]")]
    return [] if actual == expected else [f"{where}: {actual!r} vs {expected!r}"]


def check_single_learns_digits(scratch: Path) -> str:
    cwd = scratch / "single"
    out = launch(["strategy=single", "trainer.max_epochs=5", "data.num_workers=2"], cwd)
    found = results(cwd)
    assert "device=cuda:0" in out.stdout, "did not train on cuda:0"
    assert found["val_accuracy"] > 0.9, found
    assert found["peak_memory_device"] == "cuda:0", found
    return f"val_accuracy={found['val_accuracy']:.4f} samples_per_s={found['samples_per_s']:.0f} (digits, pin_memory, 2 workers)"


def check_fp16_learns_digits_with_channels_last_and_ema(scratch: Path) -> str:
    """fp16 autocast through GradScaler("cuda"), channels_last and EMA on cuda:0, watched at the convolutions."""
    cwd = scratch / "fp16"
    watch = watched([*DIGITS_MIXED, "precision=16", "channels_last=true", "ema.decay=0.9"], cwd, env={"WATCH_CONVS": "1"})
    found, scaler = results(cwd), last_checkpoint(cwd)["scaler"]
    assert watch["convs"] == [{"device": "cuda:0", "channels_last": True, "output_dtype": "float16"}], watch["convs"]
    assert found["val_accuracy"] > 0.9 and found["val_ema_accuracy"] > 0.9, found
    assert found["val_ema_loss"] != found["val_loss"], "the EMA weights evaluate exactly as the model's"
    assert scaler is not None and scaler["scale"] > 0, scaler
    return (f"val_accuracy={found['val_accuracy']:.4f} val_ema_accuracy={found['val_ema_accuracy']:.4f}; training "
            f"convolutions: channels_last input, float16 output on cuda:0; GradScaler scale {scaler['scale']:g}")


def check_bf16_autocast_learns_digits(scratch: Path) -> str:
    cwd = scratch / "bf16"
    watch = watched([*DIGITS_MIXED, "precision=bf16"], cwd, env={"WATCH_CONVS": "1"})
    found = results(cwd)
    assert watch["convs"] == [{"device": "cuda:0", "channels_last": False, "output_dtype": "bfloat16"}], watch["convs"]
    assert found["val_accuracy"] > 0.9, found
    assert last_checkpoint(cwd)["scaler"] is None, "bf16 needs no GradScaler"
    return f"val_accuracy={found['val_accuracy']:.4f}; training convolutions: bfloat16 output on cuda:0; no GradScaler"


def check_every_recipe_feature_does_no_host_sync_on_quiet_updates(scratch: Path) -> str:
    """RECIPE (compile, channels_last, EMA, bf16, accumulation, clipping, cosine, MixUp/CutMix, label
    smoothing, dropout) under DDP at world size 1 over nccl, with torch.cuda.set_sync_debug_mode("error")
    on from each quiet update's optimizer step to the next one: a host sync there fails the run.
    (fp16's GradScaler.step reads its inf check every update, as docs/recipes.md says: bf16 here.)"""
    cwd = scratch / "recipe"
    watch = watched(RECIPE, cwd, nproc=1, env={"SYNC_ERROR_AFTER": ",".join(map(str, QUIET_UPDATES))})
    found = results(cwd)
    assert "backend=nccl" in (run_dir(cwd) / "train_rank0.log").read_text(), "process group was not nccl"
    assert watch["probe_raised"] == {"item": True, "blocking_copy_to_gpu": True}, f"error mode did not raise: {watch['probe_raised']}"
    assert watch["error_mode_after"] == QUIET_UPDATES, watch["error_mode_after"]
    assert watch["no_sync_calls"] == RECIPE_UPDATES, f"no_sync entered {watch['no_sync_calls']} times, not once per update"
    graphs = watch.get("dynamo", {}).get("stats", {}).get("unique_graphs", 0)
    assert watch["ddp_wraps"] == ["OptimizedModule"] and graphs >= 1, (watch["ddp_wraps"], watch.get("dynamo"))
    assert (found["steps"], found["accumulate_grad_batches"], found["global_batch_size"]) == (RECIPE_UPDATES, 2, 16), found
    assert found["val_ema_loss"] != found["val_loss"] and found["replicas_identical"] is True, found
    return (f"{len(QUIET_UPDATES)} quiet updates of {RECIPE_UPDATES} under sync debug mode 'error', none synced; "
            f"DDP wrapped a compiled module ({graphs} graph(s)); no_sync once per update; "
            f"val_accuracy={found['val_accuracy']:.4f} val_ema_accuracy={found['val_ema_accuracy']:.4f}")


def check_nccl_world_size_1_with_torch_syncbn(scratch: Path) -> str:
    cwd = scratch / "nccl"
    out = launch(["strategy=ddp", "backend=nccl", "syncbn=true", "trainer.max_epochs=2"], cwd, nproc=1)
    text = out.stdout + (run_dir(cwd) / "train_rank0.log").read_text()
    assert "backend=nccl" in text, "process group was not nccl"
    assert "torch.nn.modules.batchnorm.SyncBatchNorm" in text, "torch's nn.SyncBatchNorm was not used"
    found = results(cwd)
    assert found["val_accuracy"] > 0.5, found
    return f"val_accuracy={found['val_accuracy']:.4f} (torch nn.SyncBatchNorm, nccl)"


def two_ranks_against_one_process(common: list[str], scratch: Path, name: str) -> float:
    """2 ranks x batch 8 with SyncBN over gloo, sharing the GPU, against 1 process x batch 16: the final weights
    agree within rtol 1e-3; returns the largest difference. Without TF32: cuDNN's float32 convolutions use it by
    default, and batches of 8 and of 16 may take different kernels, rounded apart by about 1e-3 (seen on an H200)."""
    float32 = {"NVIDIA_TF32_OVERRIDE": "0"}
    launch(["strategy=ddp", "backend=gloo", "syncbn=true", *common, "data.batch_size=8"], scratch / name, nproc=2, env=float32)
    launch(["strategy=single", *common, "data.batch_size=16"], scratch / f"{name}_reference16", env=float32)
    shared, single = last_checkpoint(scratch / name)["model"], last_checkpoint(scratch / f"{name}_reference16")["model"]
    worst = max((shared[k].double() - single[k].double()).abs().max().item() for k in single if single[k].is_floating_point())
    for key in single:
        torch.testing.assert_close(shared[key], single[key], rtol=1e-3, atol=1e-4, msg=lambda m, key=key: f"{key}: {m}")
    return worst


def check_two_ranks_share_the_gpu_and_match_one_process(scratch: Path) -> str:
    """2 ranks x batch 8 with torch's SyncBN over gloo equal 1 process x batch 16 (as the CPU suite checks)."""
    worst = two_ranks_against_one_process([*TINY, "data.num_samples=128", "trainer.max_epochs=2", "deterministic=true"],
                                          scratch, "shared")
    assert results(scratch / "shared")["replicas_identical"] is True
    return f"2x8 == 1x16 within rtol 1e-3 (largest difference {worst:.2g}); replicas identical"


def check_a_slow_rank_shows_in_the_cuda_event_timing(scratch: Path) -> str:
    """Each rank's compute per update, timed with CUDA events: rank 1 slowed by 50 ms per forward. Over 32 updates,
    of which the run's figure leaves out the warm-up's 3, where CUDA starts up (libraries loaded, kernels chosen):
    over 4 updates, warm-up included, the fast rank read 97 ms an update on an H200."""
    launch(["strategy=ddp", "backend=gloo", *TINY, "data.num_samples=2048", "trainer.max_epochs=1", "trainer.log_every_n_steps=2",
            "fault.slow_rank=1", "fault.slow_ms=50"], scratch / "straggler", nproc=2)
    found = results(scratch / "straggler")
    fast, slow = found["compute_s_per_update_per_rank"]
    assert slow >= 0.05 > fast and found["straggler_ratio"] > 1.3, (fast, slow, found["straggler_ratio"])
    return f"compute per update: rank 0 {fast * 1000:.1f} ms, rank 1 {slow * 1000:.1f} ms; straggler_ratio {found['straggler_ratio']:.2f}"


def check_dataparallel_on_one_gpu(scratch: Path) -> str:
    cwd = scratch / "dp"
    launch(["strategy=dp", *TINY, "trainer.max_epochs=1"], cwd)
    found = results(cwd)
    assert (found["strategy"], found["peak_memory_device"]) == ("dp", "cuda:0"), found
    return f"val_samples={found['val_samples']} peak_memory_mb={found['peak_memory_mb']:.0f} on {found['peak_memory_device']}"


def check_kill_and_resume_is_exact(scratch: Path) -> str:
    """Dropout on the GPU draws from the CUDA RNG: its state must come back with the checkpoint."""
    exact = ["strategy=ddp", "backend=gloo", *TINY, "data.num_samples=128", "data.batch_size=8", "model.dropout=0.3",
             "data.augment=true", "data.num_workers=2", "trainer.max_epochs=2", "checkpoint.every_n_steps=5",
             "deterministic=true"]
    launch(exact, scratch / "uninterrupted", nproc=2)
    launch([*exact, "fault.kill_rank=1", "fault.at_step=7"], scratch / "killed", nproc=2, max_restarts=1)
    killed, reference = last_checkpoint(scratch / "killed"), last_checkpoint(scratch / "uninterrupted")
    log = (run_dir(scratch / "killed") / "train_rank0.log").read_text()
    assert "resumed from" in log and "at epoch 0, batch 5, step 5" in log, "the restarted run did not resume from step 5"
    differences = tensor_differences({k: killed[k] for k in ("model", "optimizer", "ranks", "global_step")},
                                     {k: reference[k] for k in ("model", "optimizer", "ranks", "global_step")})
    assert not differences, f"{len(differences)} differ: " + "; ".join(differences[:8])
    cuda_states = [len(rank["cuda_rng"]) for rank in killed["ranks"]]
    assert cuda_states == [1, 1], f"CUDA RNG states per rank: {cuda_states}"
    return "kill at step 7, resume from step 5: model, optimizer and every rank's CPU and CUDA RNG state bit-identical"


def check_fp16_kill_and_resume_is_exact(scratch: Path) -> str:
    """fp16 with accumulation, clipping, EMA, cosine and channels_last, under DDP at world size 1 over
    nccl: the GradScaler, scheduler and EMA states come back with the checkpoint too."""
    exact = ["strategy=ddp", "backend=nccl", *TINY, "data.num_samples=128", "data.batch_size=8", "model.dropout=0.3",
             "data.augment=true", "data.num_workers=2", "precision=16", "trainer.accumulate_grad_batches=2",
             "trainer.gradient_clip_norm=1.0", "ema.decay=0.9", "scheduler=cosine", "channels_last=true",
             "trainer.max_epochs=2", "checkpoint.every_n_steps=5", "deterministic=true"]
    launch(exact, scratch / "fp16_uninterrupted", nproc=1)
    launch([*exact, "fault.kill_rank=0", "fault.at_step=7"], scratch / "fp16_killed", nproc=1, max_restarts=1)
    killed, reference = last_checkpoint(scratch / "fp16_killed"), last_checkpoint(scratch / "fp16_uninterrupted")
    log = (run_dir(scratch / "fp16_killed") / "train_rank0.log").read_text()
    # 16 micro-batches of 8 per epoch, 2 per update: update 5 ends with batch 10
    assert "resumed from" in log and "at epoch 0, batch 10, step 5" in log, "the restarted run did not resume from step 5"
    compared = ("model", "optimizer", "scaler", "scheduler", "ema", "ranks", "global_step")
    differences = tensor_differences({k: killed[k] for k in compared}, {k: reference[k] for k in compared})
    assert not differences, f"{len(differences)} differ: " + "; ".join(differences[:8])
    assert killed["scaler"] is not None and killed["ema"] is not None, "no GradScaler or EMA state was saved"
    assert [len(rank["cuda_rng"]) for rank in killed["ranks"]] == [1], "the checkpoint holds no CUDA RNG state"
    return ("fp16 kill at step 7, resume from step 5: model, optimizer, GradScaler, scheduler, EMA and the CPU "
            "and CUDA RNG states bit-identical")


def check_fsdp_nccl_bf16_kill_and_resume_is_exact(scratch: Path) -> str:
    """strategy=fsdp at world size 1 over nccl in bf16 (FSDP's MixedPrecisionPolicy), with SyncBN and
    clipping: sharded (DCP) checkpoints of a CUDA model, a kill at step 7 and torchrun's restart end
    bit-identical to an uninterrupted run; the last checkpoint exports to one float32 file."""
    exact = ["strategy=fsdp", "backend=nccl", "syncbn=true", *TINY, "data.num_samples=128", "data.batch_size=8",
             "data.augment=true", "data.num_workers=2", "precision=bf16", "trainer.gradient_clip_norm=1.0",
             "trainer.max_epochs=2", "checkpoint.every_n_steps=5", "deterministic=true"]
    launch(exact, scratch / "fsdp_uninterrupted", nproc=1)
    launch([*exact, "fault.kill_rank=0", "fault.at_step=7"], scratch / "fsdp_killed", nproc=1, max_restarts=1)
    log = (run_dir(scratch / "fsdp_killed") / "train_rank0.log").read_text()
    assert "backend=nccl" in log and "precision=bf16" in log, "not fsdp in bf16 over nccl"
    assert "resumed from" in log and "at epoch 0, batch 5, step 5" in log, "the restarted run did not resume from step 5"
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    states = {}
    for name in ("fsdp_killed", "fsdp_uninterrupted"):
        step = run_dir(scratch / name) / "checkpoints" / "step-00000032"
        dcp_to_torch_save(step, scratch / f"{name}.pt")
        states[name] = torch.load(scratch / f"{name}.pt", weights_only=True) | {
            key: value for key, value in torch.load(step / "state.pt", weights_only=True).items() if key in ("ranks", "global_step")}
    differences = tensor_differences(states["fsdp_killed"], states["fsdp_uninterrupted"])
    assert not differences, f"{len(differences)} differ: " + "; ".join(differences[:8])
    step = run_dir(scratch / "fsdp_killed") / "checkpoints" / "step-00000032"
    out = subprocess.run([sys.executable, "-m", "ddp.checkpoints.export", str(step)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    exported = torch.load(step / "model.pt", weights_only=True)
    dtypes = sorted({str(t.dtype) for t in exported.values() if t.is_floating_point()})
    assert dtypes == ["torch.float32"], dtypes
    found = results(scratch / "fsdp_killed")
    return (f"fsdp x1 nccl bf16: kill at step 7, resume from step 5: model, optimizer and RNG states bit-identical; "
            f"exported {len(exported)} tensors ({dtypes[0]}); val_accuracy={found['val_accuracy']:.4f}")


def check_hsdp_with_activation_checkpointing_is_bit_identical(scratch: Path) -> str:
    """strategy=hsdp at world size 1 over nccl (a 1x1 mesh on cuda:0) with dropout and SyncBN inside the checkpointed
    blocks: activation_checkpointing=full replays the CUDA RNG and keeps BatchNorm's statistics, so its weights equal
    activation_checkpointing=none's bit for bit."""
    common = ["strategy=hsdp", "backend=nccl", "syncbn=true", *TINY, "model.dropout=0.5", "strategy.block_types=[Sequential]",
              "trainer.max_epochs=1", "deterministic=true"]
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    states = {}
    for mode in ("none", "full"):
        launch([*common, f"activation_checkpointing={mode}"], scratch / f"hsdp_{mode}", nproc=1)
        (step,) = sorted((run_dir(scratch / f"hsdp_{mode}") / "checkpoints").glob("step-*"))[-1:]
        dcp_to_torch_save(step, scratch / f"hsdp_{mode}.pt")
        states[mode] = torch.load(scratch / f"hsdp_{mode}.pt", weights_only=True)["model"]
    log = (run_dir(scratch / "hsdp_full") / "train_rank0.log").read_text()
    assert "backend=nccl" in log and "activation_checkpointing=full: 2 of 2 blocks" in log, "not hsdp over nccl, checkpointed"
    differences = tensor_differences(states["full"], states["none"])
    assert not differences, f"{len(differences)} differ: " + "; ".join(differences[:8])
    return f"hsdp x1 nccl: activation_checkpointing=full equals none bit for bit ({len(states['full'])} tensors)"


def check_async_saves_of_cuda_state_equal_saves_in_the_loop(scratch: Path) -> str:
    """checkpoint.async_save=true on cuda:0, fsdp at world size 1 over nccl (DCP's async save copies the shards off the
    GPU, over a gloo group of its own) and ddp (rank 0 copies the state to the CPU): every checkpoint equals the same
    run's saving in the loop, bit for bit, step 5's too, whose write waited 2 s while training went on."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    common = [*TINY, "backend=nccl", "syncbn=true", "trainer.max_epochs=2", "checkpoint.every_n_steps=5", "checkpoint.keep_last=10",
              "deterministic=true", "fault.slow_save_step=5", "fault.slow_save_s=2"]
    compared = []
    for strategy in ("fsdp", "ddp"):
        states = {}
        for async_save in ("false", "true"):
            name = f"{strategy}_async_{async_save}"
            launch([*common, f"strategy={strategy}", f"checkpoint.async_save={async_save}"], scratch / name, nproc=1)
            checkpoints = run_dir(scratch / name) / "checkpoints"
            for step in sorted(checkpoints.glob("step-*")):
                if strategy == "fsdp":
                    dcp_to_torch_save(step, scratch / f"{name}_{step.name}.pt")
                    state = torch.load(scratch / f"{name}_{step.name}.pt", weights_only=True)
                else:
                    state = {key: value for key, value in torch.load(step, weights_only=True).items() if key in ("model", "optimizer")}
                states.setdefault(async_save, {})[step.name] = state
        log = (run_dir(scratch / f"{strategy}_async_true") / "train_rank0.log").read_text()
        assert "checkpoint of step 5: copied, being written in the background" in log, f"{strategy}: no background save"
        assert states["true"].keys() == states["false"].keys(), (strategy, sorted(states["true"]), sorted(states["false"]))
        differences = tensor_differences(states["true"], states["false"])
        assert not differences, f"{strategy}: {len(differences)} differ: " + "; ".join(differences[:8])
        compared.append(f"{strategy} {len(states['true'])} checkpoints")
    return "async saves on cuda:0 equal saves in the loop bit for bit: " + ", ".join(compared)


def check_fsdp_compiles_each_block_on_cuda(scratch: Path) -> str:
    """compile=true under fsdp at world size 1 over nccl compiles each block's forward where FSDP shards it (inductor on
    CUDA); its weights stay close to the uncompiled run's (different kernels, so not bit for bit)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    states = {}
    for compiled in ("false", "true"):
        launch(["strategy=fsdp", "backend=nccl", *TINY, "trainer.max_epochs=1", f"compile={compiled}"], scratch / f"fsdp_compile_{compiled}",
               nproc=1, timeout=600)
        (step,) = sorted((run_dir(scratch / f"fsdp_compile_{compiled}") / "checkpoints").glob("step-*"))[-1:]
        dcp_to_torch_save(step, scratch / f"fsdp_compile_{compiled}.pt")
        states[compiled] = torch.load(scratch / f"fsdp_compile_{compiled}.pt", weights_only=True)["model"]
    log = (run_dir(scratch / "fsdp_compile_true") / "train_rank0.log").read_text()
    assert "blocks compiled, each where FSDP shards it" in log, "no block compiled"
    largest = max((states["true"][key].double() - states["false"][key].double()).abs().max().item() for key in states["false"])
    assert largest < 1e-2, f"compiled weights {largest:g} from the uncompiled run's"
    return f"fsdp x1 nccl, compile=true per block: weights {largest:.2e} from the uncompiled run's"


def check_checkpoint_loads_on_a_cpu_only_host(scratch: Path) -> str:
    """The single run's checkpoint: its weights and SGD momentum buffers lived on cuda:0."""
    path = run_dir(scratch / "single") / "checkpoints" / "last.pt"
    code = ("import sys, torch; assert not torch.cuda.is_available(); "
            "c = torch.load(sys.argv[1], weights_only=True); "
            "tensors = [*c['model'].values(), *(t for s in c['optimizer']['state'].values() for t in s.values())]; "
            "print(sorted({t.device.type for t in tensors if isinstance(t, torch.Tensor)}))")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120,
                         env=os.environ | {"CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "['cpu']", out.stdout
    return "torch.load(weights_only=True) with CUDA_VISIBLE_DEVICES='' loads it; weights and optimizer state on cpu"


def check_peak_memory_resets_between_multirun_jobs(scratch: Path) -> str:
    cwd = scratch / "memory"
    launch(["-m", "strategy=single", "model=resnet18", "data=synthetic", "data.image_size=32", "data.num_samples=1024",
            "data.num_val_samples=64", "trainer.max_epochs=1", "trainer.limit_train_batches=3", "data.batch_size=256,8"], cwd)
    sweep = next((cwd / "outputs" / "multirun").iterdir())
    big, small = (json.loads(next(sweep.glob(f"{job}_*/results.json")).read_text()) for job in (0, 1))
    total_mb = torch.cuda.get_device_properties(0).total_memory / 2**20
    assert 0 < small["peak_memory_mb"] < big["peak_memory_mb"] < total_mb, (big["peak_memory_mb"], small["peak_memory_mb"])
    assert big["peak_memory_device"] == small["peak_memory_device"] == "cuda:0"
    return f"resnet18 batch 256: {big['peak_memory_mb']:.0f} MiB, then batch 8 in the same process: {small['peak_memory_mb']:.0f} MiB"


def check_jpeg_batches_cross_as_uint8_and_normalize_on_the_gpu(scratch: Path) -> str:
    """data=imagefolder with 2 loader workers on cuda:0: images leave the workers as uint8, move through
    pinned memory and are normalized on the GPU (ddp/loading/batches.py's to_device), into channels_last
    convolutions; the normalized bits are the CPU transform's."""
    sys.path.insert(0, str(REPO))
    import numpy as np
    from PIL import Image

    from data.presets import NORMALIZATION
    from ddp.loading.batches import ImageNormalization, to_device

    normalization = ImageNormalization(*NORMALIZATION["imagenet"])
    images = torch.randint(0, 256, (32, 3, 224, 224), dtype=torch.uint8).pin_memory()
    on_gpu = to_device(images, torch.device("cuda:0"), torch.channels_last, normalization)
    on_cpu = normalization.apply(images)
    assert on_gpu.device.type == "cuda" and on_gpu.dtype == torch.float32, (on_gpu.device, on_gpu.dtype)
    assert on_gpu.is_contiguous(memory_format=torch.channels_last), "not channels_last"
    worst = (on_gpu.cpu() - on_cpu).abs().max().item()
    assert worst <= 1e-6, worst
    root = scratch / "jpegs"
    rng = np.random.default_rng(0)
    for split, count in (("train", 48), ("val", 16)):
        for label, colour in enumerate(((200, 40, 40), (40, 40, 200))):
            (root / split / str(label)).mkdir(parents=True)
            for i in range(count):
                pixels = np.clip(np.array(colour) + rng.integers(-40, 40, (60, 80, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(root / split / str(label) / f"{i}.jpg", quality=90)
    cwd = scratch / "jpeg-training"
    watch = watched(["strategy=single", "data=imagefolder", f"data.root={root}", "data.image_size=32", "data.batch_size=16",
                     "data.num_workers=2", "model.channels=[16,32]", "optim=adam", "optim.lr=0.01", "trainer.max_epochs=3",
                     "channels_last=true"], cwd, env={"WATCH_CONVS": "1"})
    found = results(cwd)
    assert watch["convs"] == [{"device": "cuda:0", "channels_last": True, "output_dtype": "float32"}], watch["convs"]
    assert found["val_accuracy"] > 0.9, found
    bits = "the CPU's bits" if torch.equal(on_gpu.cpu(), on_cpu) else f"within {worst:g} of the CPU's"
    return (f"a uint8 batch normalized on cuda:0: {bits}; "
            f"JPEGs through 2 workers: val_accuracy={found['val_accuracy']:.4f}, channels_last float32 convolutions on cuda:0")


def check_resnet18_throughput(scratch: Path) -> str:
    cwd = scratch / "throughput"
    launch(["strategy=single", "model=resnet18", "data=synthetic", "data.image_size=32", "data.num_samples=25600",
            "data.num_val_samples=256", "data.batch_size=256", "data.num_workers=4", "trainer.max_epochs=1",
            "trainer.warmup_steps=10", "trainer.log_every_n_steps=50"], cwd)
    found = results(cwd)
    return f"resnet18, 32x32, batch 256, fp32: {found['samples_per_s']:.0f} samples/s ({found['peak_memory_mb']:.0f} MiB peak)"


def check_devices_restrict_the_visible_gpus(scratch: Path) -> str:
    code = ("import torch\nfrom ddp.config.schema import ConfigError\nfrom ddp.distributed.env import restrict_visible_gpus\n"
            "restrict_visible_gpus([0])\nprint(torch.cuda.device_count())\ntorch.cuda.init()\n"
            "try:\n    restrict_visible_gpus([1])\nexcept ConfigError as error:\n    print(error)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env=os.environ | {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert out.returncode == 0, out.stderr[-2000:]
    count, refusal = out.stdout.strip().splitlines()
    assert count == "1" and "CUDA is already initialised" in refusal, out.stdout
    return "devices=[0] before CUDA starts: 1 GPU visible; devices=[1] after: refused with one line"


def check_distillation_teacher_on_cuda_single_and_fsdp(scratch: Path) -> str:
    """task=distillation on cuda:0: a teacher trained here (task.teacher=<its run dir>) on the device, in eval mode,
    under the run's bf16 autocast (single), and under its own autocast where FSDP's policy casts the student
    (fsdp x1 over nccl); the student learns digits, and teacher_val_accuracy is the teacher run's own."""
    launch(["strategy=single", "model.channels=[32,64]", "trainer.max_epochs=4", "optim=adam", "optim.lr=0.01"],
           scratch / "teacher")
    teacher = run_dir(scratch / "teacher")
    student = ["task=distillation", f"task.teacher={teacher}", "model.channels=[16,32]", "optim=adam", "optim.lr=0.01",
               "trainer.max_epochs=4", "precision=bf16"]
    launch(["strategy=single", *student], scratch / "distilled")
    launch(["strategy=fsdp", "backend=nccl", *student], scratch / "distilled_fsdp", nproc=1)
    own = results(scratch / "teacher")["val_accuracy"]
    single, sharded = results(scratch / "distilled"), results(scratch / "distilled_fsdp")
    for found in (single, sharded):
        assert abs(found["teacher_val_accuracy"] - own) < 0.01 and found["val_accuracy"] > 0.9, found
    assert "teacher" not in "".join(last_checkpoint(scratch / "distilled")["model"]), "the teacher is in the checkpoint"
    return (f"teacher {own:.4f}; student val_accuracy single bf16 {single['val_accuracy']:.4f}, fsdp x1 nccl bf16 "
            f"{sharded['val_accuracy']:.4f}")


def check_simclr_gathers_negatives_on_cuda(scratch: Path) -> str:
    """task=simclr on cuda:0: the all_gather with gradient over nccl (world size 1) and over gloo (2 ranks sharing
    the GPU, SyncBN): 2 x 8 equal 1 x 16 without augmentation, and the probe learns digits with it."""
    worst = two_ranks_against_one_process(["task=simclr", "data.views=2", "data.augment=false", *TINY, "data.num_samples=128",
                                           "trainer.max_epochs=1", "deterministic=true"], scratch, "simclr_shared")
    launch(["strategy=ddp", "backend=nccl", "syncbn=true", "task=simclr", "data.views=2", "data.augment=true",
            "model.channels=[32,64]", "data.batch_size=32", "optim.lr=0.02", "trainer.max_epochs=3"], scratch / "simclr_nccl", nproc=1)
    probe = results(scratch / "simclr_nccl")["val_accuracy"]
    assert probe > 0.5, probe
    return f"gloo 2x8 == 1x16 within rtol 1e-3 (largest difference {worst:.2g}); nccl x1 digits probe val_accuracy={probe:.4f}"


def check_profiler_traces_cuda_kernels_and_snapshots_memory(scratch: Path) -> str:
    """profiler.* on cuda:0, 2 ranks sharing the GPU over gloo: each rank's trace holds CUDA kernels besides the
    loop's phases, and its memory snapshot (recorded from the start) is written at the chosen step and unpickles
    as torch's snapshot, with segments and an allocation history (pytorch.org/memory_viz reads the same file)."""
    cwd = scratch / "profiler"
    launch(["strategy=ddp", "backend=gloo", *TINY, "data.batch_size=16", "trainer.max_epochs=1", "profiler.enabled=true",
            "profiler.wait=1", "profiler.warmup=1", "profiler.active=2", "profiler.memory_history=true",
            "profiler.memory_snapshot_step=3"], cwd, nproc=2)
    folder = run_dir(cwd) / "profiler"
    kernels = {}
    for rank in (0, 1):
        with gzip.open(folder / f"rank{rank}_step4.json.gz", "rt") as trace:
            events = json.load(trace)["traceEvents"]
        names = {event.get("name", "") for event in events}
        assert {"forward_and_loss", "backward", "optimizer_step", "data_wait"} <= names, sorted(names)[:50]
        kernels[rank] = sum(event.get("cat") == "kernel" for event in events)
        assert kernels[rank] > 0, f"rank {rank}'s trace has no CUDA kernel"
        with open(folder / f"memory_rank{rank}_step3.pickle", "rb") as snapshot_file:
            snapshot = pickle.load(snapshot_file)
        assert snapshot["segments"] and any(snapshot["device_traces"]), list(snapshot)
    return f"CUDA kernels in the traces: rank 0 {kernels[0]}, rank 1 {kernels[1]}; memory snapshots at step 3 unpickle"


DETECTION = ["task=detection", "model=detection", "model.name=small_fasterrcnn", "data=detection_shapes", "data.num_val_samples=37"]


def check_detection_on_cuda(scratch: Path) -> str:
    """task=detection on cuda:0: Faster R-CNN's per-image samplers draw from CUDA generators, the COCO evaluation
    gathers its records over nccl (world size 1, torch's SyncBN, bf16, aspect-ratio groups, loader workers) and
    mode=eval of its checkpoint gives its metrics again; 2 ranks x 8 over gloo sharing the GPU train as 1 x 16 (lsj:
    images of one size)."""
    launch(["strategy=ddp", "backend=nccl", "syncbn=true", *DETECTION, "data.batch_size=8", "data.num_workers=2",
            "data.aspect_ratio_groups=3", "precision=bf16", "optim.lr=0.02", "trainer.max_epochs=3"], scratch / "det_nccl", nproc=1)
    trained = results(scratch / "det_nccl")
    launch(["strategy=ddp", "backend=nccl", *DETECTION, "mode=eval", f"resume={run_dir(scratch / 'det_nccl')}"],
           scratch / "det_eval", nproc=1)
    (evaluated,) = (scratch / "det_eval" / "outputs").rglob("eval.json")
    evaluated = json.loads(evaluated.read_text())
    assert trained["val_samples"] == evaluated["val_samples"] == 37 and trained["val_map"] > 0, trained
    assert json.dumps({k: v for k, v in trained.items() if k.startswith("val_")}, sort_keys=True) == \
        json.dumps({k: v for k, v in evaluated.items() if k.startswith("val_")}, sort_keys=True), (trained, evaluated)
    worst = two_ranks_against_one_process([*DETECTION, "data.num_samples=64", "data.augment=lsj", "data.lsj_size=48",
                                           "optim.lr=0.001", "trainer.max_epochs=1", "deterministic=true"], scratch, "det_shared")
    return (f"nccl x1 bf16 val_map={trained['val_map']:.4f}, mode=eval equal; gloo 2x8 == 1x16 within rtol 1e-3 "
            f"(largest difference {worst:.2g})")


CHECKS = [
    check_single_learns_digits,
    check_fp16_learns_digits_with_channels_last_and_ema,
    check_bf16_autocast_learns_digits,
    check_nccl_world_size_1_with_torch_syncbn,
    check_every_recipe_feature_does_no_host_sync_on_quiet_updates,
    check_two_ranks_share_the_gpu_and_match_one_process,
    check_a_slow_rank_shows_in_the_cuda_event_timing,
    check_dataparallel_on_one_gpu,
    check_kill_and_resume_is_exact,
    check_fp16_kill_and_resume_is_exact,
    check_fsdp_nccl_bf16_kill_and_resume_is_exact,
    check_hsdp_with_activation_checkpointing_is_bit_identical,
    check_async_saves_of_cuda_state_equal_saves_in_the_loop,
    check_fsdp_compiles_each_block_on_cuda,
    check_checkpoint_loads_on_a_cpu_only_host,
    check_peak_memory_resets_between_multirun_jobs,
    check_devices_restrict_the_visible_gpus,
    check_distillation_teacher_on_cuda_single_and_fsdp,
    check_simclr_gathers_negatives_on_cuda,
    check_detection_on_cuda,
    check_profiler_traces_cuda_kernels_and_snapshots_memory,
    check_jpeg_batches_cross_as_uint8_and_normalize_on_the_gpu,
    check_resnet18_throughput,
]


def main(names: list[str]) -> int:
    known = {check.__name__.removeprefix("check_"): check for check in CHECKS}
    if unknown := [name for name in names if name not in known]:
        print(f"gpu-check: no check named {', '.join(unknown)}; the checks are: {', '.join(known)}")
        return 2
    checks = [known[name] for name in names] or CHECKS
    if not torch.cuda.is_available():
        print(f"gpu-check: no CUDA GPU visible (torch {torch.__version__}); nothing was checked")
        return 0
    print(f"gpu-check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    failed, began = 0, time.perf_counter()
    for check in checks:
        name = check.__name__.removeprefix("check_")
        started = time.perf_counter()
        try:
            detail = check(scratch)
            print(f"PASS {name} ({time.perf_counter() - started:.0f} s): {detail}", flush=True)
        except Exception as error:  # noqa: BLE001 (every check reports, even after one fails)
            failed += 1
            print(f"FAIL {name} ({time.perf_counter() - started:.0f} s): {type(error).__name__}: {error}", flush=True)
    print(f"gpu-check: {len(checks) - failed} of {len(checks)} passed in {time.perf_counter() - began:.0f} s "
          f"(all of them about 460 s on an H200); runs in {scratch}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
