"""Device choice and per-device RNG state as pure functions of what the process sees: the GPU
paths' logic runs here without a GPU (`make gpu-check` runs it on one)."""

import logging
import os
import random
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from ddp.checkpoints.resume import capture_rank_state, restore_rank_state
from ddp.config.schema import ConfigError
from ddp.distributed.env import DistEnv, restrict_visible_gpus, select_device
from ddp.distributed.env import process_gpus


def _rank(local_rank: int, local_world_size: int = 8) -> DistEnv:
    return DistEnv(rank=local_rank, local_rank=local_rank, world_size=local_world_size,
                   local_world_size=local_world_size, launcher="torchrun")


def test_devices_set_the_visible_gpus_before_cuda_starts(monkeypatch):
    """CUDA reads CUDA_VISIBLE_DEVICES once, when it starts (`make gpu-check` checks the refusal after that)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    restrict_visible_gpus(None)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    restrict_visible_gpus([0, 2])
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,2"


def test_no_visible_gpu_is_cpu():
    assert select_device(_rank(3), "gloo", visible_gpus=0) == torch.device("cpu")


@pytest.mark.parametrize("local_rank", [0, 3, 7])
def test_one_gpu_per_process_is_cuda_0_whatever_the_local_rank(local_rank, caplog):
    """SLURM --gpus-per-task=1 or Kubernetes: each process sees exactly one GPU, as cuda:0."""
    with caplog.at_level(logging.WARNING):
        assert select_device(_rank(local_rank), "nccl", visible_gpus=1) == torch.device("cuda", 0)
    assert not caplog.records


def test_one_gpu_per_local_rank():
    assert [select_device(_rank(r, 4), "nccl", visible_gpus=4) for r in range(4)] == [torch.device("cuda", r) for r in range(4)]


def test_more_processes_than_gpus_with_nccl_is_a_config_error():
    with pytest.raises(ConfigError) as error:
        select_device(_rank(5), "nccl", visible_gpus=4)
    message = str(error.value)
    assert "LOCAL_RANK=5 but only 4 GPUs are visible" in message
    assert "torchrun --nproc_per_node=4" in message and "backend=gloo" in message
    assert "\n" not in message


def test_more_processes_than_gpus_with_gloo_share_them_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING):
        assert select_device(_rank(5), "gloo", visible_gpus=4) == torch.device("cuda", 1)
    (record,) = caplog.records
    assert "LOCAL_RANK=5 with 4 visible GPU(s): this rank uses cuda:1" in record.getMessage()


def test_two_ranks_sharing_one_gpu_over_gloo_warn(caplog):
    """How `make gpu-check` runs 2 ranks on one GPU."""
    with caplog.at_level(logging.WARNING):
        assert select_device(_rank(1, 2), "gloo", visible_gpus=1) == torch.device("cuda", 0)
    assert "this rank uses cuda:0" in caplog.text


@pytest.mark.parametrize("strategy", ["single", "dp", "ddp"])
def test_a_cpu_process_computes_on_no_gpu(strategy):
    assert process_gpus(strategy, torch.device("cpu")) == []


def test_a_ddp_rank_computes_on_its_own_gpu_only():
    """Its RNG state and peak memory are read from that device alone, so no rank touches (and
    creates a CUDA context on) the others."""
    assert process_gpus("ddp", torch.device("cuda", 3)) == [3]


def test_a_checkpoint_from_gpus_resumes_on_a_host_with_fewer(caplog):
    """The rank state of a run on 2 GPUs, restored where this rank computes on none (or fewer):
    the CPU and Python streams come back exactly, the surplus GPU states are skipped with a warning
    (torch.cuda.set_rng_state_all would raise IndexError, or restore another device's stream)."""
    torch.manual_seed(7)
    random.seed(7)
    state = capture_rank_state(torch.zeros(2, dtype=torch.float64), cuda_devices=[])
    state["cuda_rng"] = [torch.zeros(16, dtype=torch.uint8), torch.ones(16, dtype=torch.uint8)]
    expected = torch.rand(3), random.random()
    torch.manual_seed(0)
    random.seed(0)
    with caplog.at_level(logging.WARNING):
        restore_rank_state(state, cuda_devices=[])
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    assert "CUDA RNG state of 2 device(s), this rank trains on 0" in caplog.text


def test_gpu_check_without_a_gpu_says_so_and_runs_nothing(tmp_path):
    """`make gpu-check` on a host with no visible GPU: exit 0, one line saying nothing was checked."""
    result = subprocess.run(["make", "-s", "gpu-check", f"PY={sys.executable}"], cwd=REPO, capture_output=True, text=True,
                            timeout=120, env=os.environ | {"TMPDIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines() == [f"gpu-check: no CUDA GPU visible (torch {torch.__version__}); nothing was checked"]
    assert "PASS" not in result.stdout and not list(tmp_path.iterdir())
