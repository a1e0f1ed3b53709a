"""activation_checkpointing=full|selective: the same weights as none, bit for bit, under DDP and FSDP on 2 ranks with
dropout and SyncBN inside the checkpointed blocks (the recompute replays the RNG and leaves BatchNorm's statistics
alone), and far fewer bytes kept for the backward."""

import pytest
import torch
from torchvision.models.vision_transformer import VisionTransformer

from conftest import TINY, check, last_checkpoint, launch, shared_run
from ddp.training.activation_checkpointing import bytes_saved_for_backward, checkpoint_activations
from test_fsdp import full_state
from test_sweeps import job_dirs, the_sweep_dir

# small_cnn's two Sequentials as the blocks: `features` (convolutions, SyncBN) and `head` (dropout, the classifier).
# selective (every 2nd block) checkpoints the head alone.
MODES = ("none", "full", "selective")
SWEEP = ["-m", "strategy=ddp,fsdp", f"activation_checkpointing={','.join(MODES)}", "syncbn=true", "model.dropout=0.5",
         "strategy.block_types=[Sequential]", *TINY, "trainer.max_epochs=1", "checkpoint.keep_best=0"]


def run_sweep(cwd) -> dict:
    check(launch(SWEEP, cwd, nproc=2))
    return {}


@pytest.fixture
def sweep(tmp_path_factory):
    """SWEEP under torchrun --nproc_per_node=2, once for all test processes: its sweep dir."""
    return the_sweep_dir(shared_run("activation_checkpointing_sweep", run_sweep, tmp_path_factory)[0])


def final_state(job_dir, strategy: str, tmp) -> dict:
    if strategy == "ddp":
        return last_checkpoint(job_dir)["model"]
    (step,) = sorted((job_dir / "checkpoints").glob("step-*"))[-1:]
    return full_state(step, tmp)["model"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_checkpointed_blocks_train_bit_identical_weights_and_statistics_with_dropout_and_syncbn(sweep, strategy, tmp_path):
    jobs = {}
    for job_dir in job_dirs(sweep):  # named <job>_activation_checkpointing=<mode>,strategy=<strategy>
        swept = dict(override.split("=") for override in job_dir.name.split("_", 1)[1].split(","))
        jobs[swept["strategy"], swept["activation_checkpointing"]] = job_dir
    none = final_state(jobs[strategy, "none"], strategy, tmp_path / "none")
    for mode, checkpointed in (("full", 2), ("selective", 1)):
        log = (jobs[strategy, mode] / "train_rank0.log").read_text()
        assert f"activation_checkpointing={mode}: {checkpointed} of 2 blocks (Sequential) recompute" in log
        state = final_state(jobs[strategy, mode], strategy, tmp_path / mode)
        assert state.keys() == none.keys() and any(key.endswith("running_var") for key in none)
        for key in none:
            assert torch.equal(state[key], none[key]), f"{mode}: {key}"


def test_checkpointing_a_vits_blocks_keeps_a_fraction_of_the_bytes_for_the_backward():
    """torchvision's ViT (8 EncoderBlocks, found as its blocks with no setting): every block checkpointed keeps under
    a tenth of the bytes, every 2nd block about half, with the same gradients."""
    saved, gradients = {}, {}
    for mode in MODES:
        torch.manual_seed(0)
        model = VisionTransformer(image_size=32, patch_size=4, num_layers=8, num_heads=4, hidden_dim=64, mlp_dim=256,
                                  num_classes=10, dropout=0.1)
        torch.nn.init.normal_(model.heads.head.weight)  # torchvision's is zero, which would leave every other gradient zero
        assert len(checkpoint_activations(model, None, mode, every=2)) == {"none": 0, "full": 8, "selective": 4}[mode]
        images = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1))
        torch.manual_seed(2)  # dropout's masks
        saved[mode], output = bytes_saved_for_backward(lambda: model(images))
        output.sum().backward()
        gradients[mode] = [parameter.grad for parameter in model.parameters()]
        assert all(gradient.abs().sum() > 0 for gradient in gradients[mode])
    assert saved["full"] < 0.1 * saved["none"], saved
    assert 0.4 * saved["none"] < saved["selective"] < 0.6 * saved["none"], saved
    for mode in ("full", "selective"):
        assert all(torch.equal(a, b) for a, b in zip(gradients[mode], gradients["none"])), mode


def test_compiled_checkpointed_blocks_behind_a_tasks_heads_train_as_the_compiled_model_without():
    """SimCLR's heads around small_cnn, its Sequentials as the blocks (small_cnn's features with BatchNorm and head with
    dropout, the projector, the probe with BatchNorm), compiled: the recompute is traced into the backward. With
    inductor drawing dropout from eager's generator, 3 SGD steps end within float noise of the compiled run without
    checkpointing, BatchNorm's statistics updated once a step."""
    from torch._inductor import config as inductor_config

    from models.small_cnn import SmallCNN
    from tasks.simclr import SimCLRTask

    states = {}
    for mode in ("none", "full"):
        torch.manual_seed(0)
        model = SimCLRTask(num_classes=10).with_heads(SmallCNN(num_classes=10, in_channels=3, channels=[8, 16], dropout=0.5))
        blocks = checkpoint_activations(model, ["Sequential"], mode, every=2)
        assert {id(block) for block in blocks} == ({id(module) for module in (model.backbone.features, model.backbone.head,
                                                                               model.projector, model.probe)}
                                                    if mode == "full" else set())
        compiled, optimizer = torch.compile(model), torch.optim.SGD(model.parameters(), lr=0.1)
        images = torch.randn(3, 8, 3, 8, 8, generator=torch.Generator().manual_seed(1))
        torch._dynamo.reset()
        with inductor_config.patch(fallback_random=True):
            for step in range(3):
                loss = sum(output.float().square().mean() for output in compiled(images[step]).values())
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        states[mode] = model.state_dict()
    for key, value in states["none"].items():
        torch.testing.assert_close(states["full"][key], value, msg=lambda m, key=key: f"{key}: {m}")
    assert all(value == 3 for key, value in states["full"].items() if key.endswith("num_batches_tracked"))
