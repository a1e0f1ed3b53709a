"""The update step on its own, without a process group: mixed precision really on, accumulation
equal to a bigger batch, the schedule's shape and pace (also across a resume that changes the LR or
the run's length), and what a checkpoint of it holds."""

import copy
import io
import math

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from ddp.training.ema import build_ema
from ddp.training.evaluation import evaluate
from ddp.training.optimizer import build_scheduler, resume_schedule
from ddp.training.update import UpdateStep
from models.small_cnn import SmallCNN
from tasks import Task
from tasks.classification import ClassificationTask
from workers.host_reads import HostReads


def small_model(norm: str = "batch") -> nn.Module:
    torch.manual_seed(0)
    return SmallCNN(num_classes=10, in_channels=3, channels=[8, 16], norm=norm)


def batch(size: int = 16):
    generator = torch.Generator().manual_seed(1)
    return torch.randn(size, 3, 8, 8, generator=generator), torch.randint(10, (size,), generator=generator)


@pytest.mark.parametrize("precision, dtype", [("32", torch.float32), ("bf16", torch.bfloat16), ("16", torch.float16)])
def test_autocast_is_really_on(precision, dtype):
    """torch only warns, and turns autocast off, for a dtype the device can't do: look inside the forward."""
    model = small_model()
    seen = []
    model.features[0].register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    update = UpdateStep(model, torch.optim.SGD(model.parameters(), lr=0.1), task=ClassificationTask(), precision=precision)
    update.micro_step(batch(), micro_index=0, group_size=1)
    assert seen == [dtype]
    assert (update.scaler is not None) == (precision == "16")  # bf16 needs no GradScaler
    assert all(p.dtype == torch.float32 for p in model.parameters())  # weights stay fp32


class SquaredError(Task):
    """A task that isn't classification (regression onto float targets), written against tasks/__init__.py."""

    objective, direction = "val_loss", "minimize"

    def train_batch(self, images, targets):
        return images, targets

    def loss(self, output, targets):
        return ((output - targets) ** 2).mean()

    def eval_sums(self, output, targets):
        squared = ((output.double() - targets.double()) ** 2).sum()
        return torch.stack([squared, torch.tensor(float(targets.numel()), dtype=torch.float64), torch.tensor(float(len(targets)), dtype=torch.float64)])

    def metrics(self, sums):
        return {"loss": (sums[0] / sums[1]).item(), "samples": int(sums[2])}

    def log_validation(self, writer, model, dataset, device, step):
        pass


def test_the_update_and_evaluation_take_the_loss_and_metrics_from_the_task():
    """Nothing in the update step or in evaluate() is classification's: a regression task trains and evaluates as is."""
    torch.manual_seed(0)
    model, inputs, targets = nn.Linear(3, 2), torch.randn(10, 3), torch.randn(10, 2)
    expected_loss = ((model(inputs) - targets) ** 2).mean()
    update = UpdateStep(model, torch.optim.SGD(model.parameters(), lr=0.1), task=SquaredError(), precision="32")
    assert torch.equal(update.micro_step((inputs, targets), micro_index=0, group_size=1), expected_loss.detach())
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, targets), batch_size=4)
    metrics = evaluate(model, loader, torch.device("cpu"), -1, SquaredError())
    with torch.no_grad():
        mean_squared = ((model(inputs).double() - targets.double()) ** 2).mean().item()
    assert metrics.keys() == {"val_loss", "val_samples"} and metrics["val_samples"] == 10
    assert metrics["val_loss"] == pytest.approx(mean_squared, rel=1e-12)


def test_two_accumulated_halves_equal_one_whole_batch():
    """GroupNorm has per-sample statistics, so micro-batching changes nothing but float summation order."""
    images, labels = batch(32)
    whole, halves = small_model("group"), small_model("group")
    for model, groups in ((whole, [(images, labels)]), (halves, [(images[:16], labels[:16]), (images[16:], labels[16:])])):
        update = UpdateStep(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), task=ClassificationTask(),
                            precision="32")
        for _ in range(3):
            for index, (x, y) in enumerate(groups):
                update.micro_step((x, y), micro_index=index, group_size=len(groups))
    for (name, a), b in zip(whole.state_dict().items(), halves.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_updates_happen_once_per_group_and_the_schedule_steps_with_them():
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = build_scheduler(OmegaConf.create({"name": "cosine", "warmup_steps": 2, "warmup_epochs": 0, "min_lr": 0.0}),
                                optimizer, total_updates=10, updates_per_epoch=10)
    ema = build_ema(model, 0.9)
    update = UpdateStep(model, optimizer, task=ClassificationTask(), precision="32", scheduler=scheduler, ema=ema)
    before = copy.deepcopy(model.state_dict())
    images, labels = batch()
    for micro in range(3):
        update.micro_step((images, labels), micro_index=micro, group_size=3)
        changed = any(not torch.equal(before[k], v) for k, v in model.state_dict().items() if "running" not in k
                      and "num_batches" not in k)
        assert changed == (micro == 2), micro  # weights move only after the group's last micro-batch
    assert scheduler.last_epoch == 1 and int(ema.n_averaged) == 1


def trained_a_little(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """New weights and BatchNorm statistics for `model`, as an update would leave them; returns a copy."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter))
    model.train()
    model(batch(4)[0])  # running statistics and num_batches_tracked move
    return copy.deepcopy(model.state_dict())


def test_ema_copies_on_its_first_update_then_lerps_towards_the_weights_by_one_minus_decay():
    model = small_model()
    ema = build_ema(model, 0.9)
    first = trained_a_little(model, seed=1)
    ema.update_parameters(model)
    second = trained_a_little(model, seed=2)
    ema.update_parameters(model)
    averaged = ema.module.state_dict()
    assert averaged.keys() == first.keys() and any(key.endswith("running_mean") for key in averaged)
    for key, value in averaged.items():
        if value.is_floating_point():
            torch.testing.assert_close(value, torch.lerp(first[key], second[key], 1 - 0.9), rtol=0, atol=0,
                                       msg=lambda m, key=key: f"{key}: {m}")
            assert not torch.equal(value, second[key]), key
        else:  # num_batches_tracked: a count, not averaged
            assert torch.equal(value, second[key]), key
    assert ema.n_averaged == 2


@pytest.mark.parametrize("norm", ["batch", "group"])
def test_ema_updates_the_tensors_it_holds_after_to_and_without_integer_buffers(norm):
    """The EMA finds its tensors once; .to() (here .double().float()) puts new tensors in place of its
    buffers, and the updates go into those. GroupNorm leaves no integer buffer to copy."""
    model = small_model(norm)
    ema = build_ema(model, 0.9).double().float()
    first = trained_a_little(model, seed=1)
    ema.update_parameters(model)
    second = trained_a_little(model, seed=2)
    ema.update_parameters(model)
    averaged = ema.module.state_dict()
    assert averaged.keys() == second.keys()
    for key, value in averaged.items():
        expected = torch.lerp(first[key], second[key], 1 - 0.9) if value.is_floating_point() else second[key]
        torch.testing.assert_close(value, expected, rtol=0, atol=0, msg=lambda m, key=key: f"{key}: {m}")


def test_ema_checkpoint_is_averaged_models_both_ways():
    """The state_dict keeps torch.optim.swa_utils.AveragedModel's format (`module.<key>`, `n_averaged`):
    checkpoints written before the EMA stopped using AveragedModel still resume, and an EMA
    checkpoint loads into AveragedModel."""
    model = small_model()
    old = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    for seed in (1, 2, 3):
        trained_a_little(model, seed)
        old.update_parameters(model)
    ema = build_ema(small_model(), 0.9)
    ema.load_state_dict(old.state_dict())
    assert ema.n_averaged == 3
    for key, value in ema.module.state_dict().items():
        assert torch.equal(value, old.module.state_dict()[key]), key
    state = ema.state_dict()
    assert state.keys() == old.state_dict().keys() and state["n_averaged"].dtype == torch.int64
    AveragedModel(small_model(), use_buffers=True).load_state_dict(state, strict=True)


def test_ema_update_reads_nothing_back_to_the_host_where_averaged_model_does():
    """On a GPU a host read waits for the device. The detector sees AveragedModel's
    `bool(n_averaged == 0)` and `n_averaged > 0`; the EMA's update makes no read at all."""
    model = small_model()
    ema, old = build_ema(model, 0.9), AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    with HostReads() as ours:
        for _ in range(3):
            ema.update_parameters(model)
    with HostReads() as torchs:
        for _ in range(3):
            old.update_parameters(model)
    assert ours.events == []
    assert torchs.events == [("_local_scalar_dense", "torch/optim/swa_utils.py:update_parameters")] * 6


def test_a_step_the_fp16_scaler_skips_still_advances_the_schedule_and_is_no_divergence():
    """An overflowing scale (as while the scaler calibrates) makes inf gradients: the scaler skips the
    optimizer step and halves its scale, the schedule moves on (the LR is a function of the update
    count), and the finite check passes, since the loss itself was finite."""
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = build_scheduler(OmegaConf.create({"name": "cosine", "warmup_steps": 2, "warmup_epochs": 0, "min_lr": 0.0}),
                                optimizer, total_updates=10, updates_per_epoch=10)
    update = UpdateStep(model, optimizer, task=ClassificationTask(), precision="16", scheduler=scheduler)
    update.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100)
    before = copy.deepcopy(model.state_dict())
    update.micro_step(batch(), micro_index=0, group_size=1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items() if "running" not in k and "num_batches" not in k)
    assert update.scaler.get_scale() == 2.0**99 and scheduler.last_epoch == 1
    update.check_finite(step=1)


def cosine_with_warmup(step: int, base: float, warmup: int, total: int, min_lr: float) -> float:
    """The LR of update `step` (0-based), written out: (step + 1) / warmup, then half a cosine."""
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / (total - warmup)
    return min_lr + (base - min_lr) * (1 + math.cos(math.pi * progress)) / 2


def lrs_of(scheduler_cfg: dict, base_lr: float, total_updates: int, updates_per_epoch: int) -> list[float]:
    """The LR of every update of a run with that schedule."""
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=base_lr)
    scheduler = build_scheduler(OmegaConf.create(scheduler_cfg), optimizer, total_updates, updates_per_epoch)
    lrs = []
    for _ in range(total_updates):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return lrs


@pytest.mark.parametrize("warmup", [0, 1, 5])
def test_cosine_schedule_follows_its_formula_and_never_starts_at_zero(warmup):
    lrs = lrs_of({"name": "cosine", "warmup_steps": warmup, "warmup_epochs": 0, "min_lr": 0.01}, 0.4, 20, 10)
    assert lrs[0] > 0
    expected = [cosine_with_warmup(step, 0.4, warmup, 20, 0.01) for step in range(20)]
    assert lrs == pytest.approx(expected, rel=1e-6)


def test_step_schedule_decays_at_its_milestone_epochs_after_warmup():
    lrs = lrs_of({"name": "step", "warmup_steps": 2, "warmup_epochs": 0, "milestones": [2, 3], "gamma": 0.5}, 1.0, 16, 4)
    assert lrs == pytest.approx([0.5, 1, 1, 1, 1, 1, 1, 1, 0.5, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.25])


def lrs_across_a_resume(scheduler_cfg: dict, updates_per_epoch: int, stop_after: int, before: tuple[float, int],
                        after: tuple[float, int]) -> list[float]:
    """The LR of every update of a run with (base LR, total updates) `before`, stopped after `stop_after`
    updates, its optimizer and scheduler states saved as a checkpoint holds them, and resumed as
    train.py resumes, by a run with (base LR, total updates) `after`."""

    def start(base_lr: float, total_updates: int):
        optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=base_lr)
        return optimizer, build_scheduler(OmegaConf.create(scheduler_cfg), optimizer, total_updates, updates_per_epoch)

    lrs: list[float] = []

    def train(optimizer, scheduler, until: int) -> None:
        while len(lrs) < until:
            lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            if scheduler is not None:
                scheduler.step()

    optimizer, scheduler = start(*before)
    train(optimizer, scheduler, stop_after)
    buffer = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict() if scheduler else None}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    optimizer, scheduler = start(*after)
    optimizer.load_state_dict(saved["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(saved["scheduler"])
    resume_schedule(optimizer, scheduler, *after)
    train(optimizer, scheduler, after[1])
    return lrs


COSINE = {"name": "cosine", "warmup_steps": 0, "warmup_epochs": 0, "min_lr": 0.1}


def test_extending_a_finished_cosine_run_holds_min_lr():
    """The issue's run: cosine over 6 updates, extended to 12. CosineAnnealingLR is periodic past
    T_max, so its LR rose again from update 7; it stays at min_lr instead."""
    lrs = lrs_across_a_resume(COSINE, 6, stop_after=6, before=(1.0, 6), after=(1.0, 12))
    assert lrs[:6] == pytest.approx([cosine_with_warmup(step, 1.0, 0, 6, 0.1) for step in range(6)])
    assert lrs[6:] == pytest.approx([0.1] * 6)


def test_extending_a_cosine_run_mid_decay_re_plans_the_rest_down_to_min_lr_at_the_new_end():
    """Stopped after 6 of 10 updates (warmup 2), resumed for 20: from the LR it has reached, a cosine
    over the remaining 14 updates, never rising; update 20 would have min_lr."""
    warmup = {**COSINE, "warmup_steps": 2}
    lrs = lrs_across_a_resume(warmup, 10, stop_after=6, before=(1.0, 10), after=(1.0, 20))
    first_plan = [cosine_with_warmup(step, 1.0, 2, 10, 0.1) for step in range(7)]
    assert lrs[:6] == pytest.approx(first_plan[:6])
    re_planned = [0.1 + (first_plan[6] - 0.1) * (1 + math.cos(math.pi * (step - 6) / 14)) / 2 for step in range(6, 20)]
    assert lrs[6:] == pytest.approx(re_planned)
    assert all(later <= earlier for earlier, later in zip(lrs[1:], lrs[2:]))


def test_extending_a_run_in_its_warmup_gives_the_schedule_of_the_new_length():
    warmup = {**COSINE, "warmup_steps": 4}
    lrs = lrs_across_a_resume(warmup, 8, stop_after=2, before=(1.0, 8), after=(1.0, 16))
    assert lrs == pytest.approx(lrs_of(warmup, 1.0, 16, 8))


def test_extending_a_step_run_keeps_its_milestone_epochs():
    """Milestones are epochs: the extended run decays where a run planned that long from the start does."""
    step = {"name": "step", "warmup_steps": 2, "warmup_epochs": 0, "milestones": [2, 3], "gamma": 0.5}
    lrs = lrs_across_a_resume(step, 4, stop_after=8, before=(1.0, 8), after=(1.0, 16))
    assert lrs == pytest.approx(lrs_of(step, 1.0, 16, 4))
    assert lrs[8:] == pytest.approx([0.5] * 4 + [0.25] * 4)  # epochs 2 and 3, which the first run never reached


@pytest.mark.parametrize("scheduler_cfg", [
    {**COSINE, "warmup_steps": 2, "min_lr": 0.01},
    {"name": "step", "warmup_steps": 2, "warmup_epochs": 0, "milestones": [1, 2], "gamma": 0.5},
    {"name": "none", "warmup_steps": 0, "warmup_epochs": 0},
], ids=lambda cfg: cfg["name"])
def test_a_resume_with_another_base_lr_trains_at_it_with_the_schedule_rescaled(scheduler_cfg):
    """optim.lr=0.5 (or lr_scaling at another global batch) for a checkpoint trained at 0.05: from the
    resume on, the LR is that of a run planned at 0.5 from the start, not the checkpoint's."""
    lrs = lrs_across_a_resume(scheduler_cfg, 4, stop_after=5, before=(0.05, 10), after=(0.5, 10))
    assert lrs[:5] == pytest.approx(lrs_of(scheduler_cfg, 0.05, 10, 4)[:5])
    assert lrs[5:] == pytest.approx(lrs_of(scheduler_cfg, 0.5, 10, 4)[5:])


def test_a_schedule_saved_by_torchs_chained_schedulers_resumes_and_never_rises():
    """Checkpoints from before the schedule's own class hold SequentialLR(LinearLR, CosineAnnealingLR)'s
    state: a resume continues its step, base LR and length (here extended after its end: min_lr)."""
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, end_factor=1.0, total_iters=1)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=4, eta_min=0.1)
    chained = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[2])
    for _ in range(6):
        optimizer.step()
        chained.step()
    resumed_optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_scheduler(OmegaConf.create({**COSINE, "warmup_steps": 2}), resumed_optimizer, 12, 12)
    resumed_optimizer.load_state_dict(optimizer.state_dict())
    scheduler.load_state_dict(chained.state_dict())
    resume_schedule(resumed_optimizer, scheduler, 1.0, 12)
    lrs = []
    for _ in range(6):
        lrs.append(resumed_optimizer.param_groups[0]["lr"])
        resumed_optimizer.step()
        scheduler.step()
    assert scheduler.last_epoch == 12 and lrs == pytest.approx([0.1] * 6)
