"""CPUSyncBatchNorm against plain BatchNorm, with real gloo processes (no mocks).

One pair of spawned ranks runs every distributed scenario (spawning costs a few
seconds); each rank saves its results and the tests below assert in this process.
"""

import copy
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from conftest import shared_run
from ddp.distributed.syncbn import CPUSyncBatchNorm, convert_syncbn

WORLD = 2
STEPS = 3
# name -> (per-rank batch sizes, BatchNorm kwargs, mean of the inputs, input dtype: bf16 under CPU autocast)
PARITY_CASES = {
    "equal_split": ((8, 8), dict(momentum=0.1), 1.0, torch.float32),
    "unequal_split_cumulative": ((5, 11), dict(momentum=None, eps=1e-3), 1.0, torch.float32),
    "no_affine_no_running_stats": ((6, 4), dict(affine=False, track_running_stats=False), 1.0, torch.float32),
    # 1e4 + N(0, 4): E[x^2] - E[x]^2 would lose the variance to cancellation
    "large_mean": ((8, 8), dict(momentum=0.1), 1e4, torch.float32),
    # precision=bf16: a bf16 input, float32 parameters and buffers, as autocast leaves them
    "bf16_autocast": ((5, 11), dict(momentum=0.1), 1.0, torch.bfloat16),
    "bf16_autocast_no_affine": ((6, 4), dict(affine=False), 1.0, torch.bfloat16),
}
# float32 holds 1e4 + x only to about 1e-3 (5e-4 of the spread), so there outputs and grads agree to
# a few 1e-3; a variance lost to cancellation would be off by units. bf16 keeps 8 bits of a value.
BF16 = dict(atol=2e-2, rtol=2e-2)
TOLERANCE = {"large_mean": dict(atol=5e-3, rtol=5e-3), "bf16_autocast": BF16, "bf16_autocast_no_affine": BF16}


def _batch(step, n, mean):
    """Input and loss weights for one step; the same in every process."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 3, 5, 5, generator=g) * 2 + mean, torch.randn(n, 3, 5, 5, generator=g)


class _CollectiveCounter:
    """Counts the collectives issued inside a `with` block."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter")

    def __enter__(self):
        self.count, self.originals = 0, {name: getattr(dist, name) for name in self.NAMES}
        for name, original in self.originals.items():
            setattr(dist, name, self._counted(original))
        return self

    def _counted(self, original):
        def wrapper(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)
        return wrapper

    def __exit__(self, *exc):
        for name, original in self.originals.items():
            setattr(dist, name, original)


def _make_bn(cls, **kwargs):
    bn = cls(3, **kwargs)
    if bn.affine:  # non-trivial affine params so their grads and use are checked
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            bn.weight.copy_(torch.rand(3, generator=g) + 0.5)
            bn.bias.copy_(torch.randn(3, generator=g))
    return bn


def _ddp_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Flatten(), nn.Linear(4 * 5 * 5, 6), nn.BatchNorm1d(6),
    )


def _ddp_batch(rank):
    g = torch.Generator().manual_seed(50 + rank)
    return torch.randn(4, 3, 5, 5, generator=g) * (1 + rank) + rank  # ranks see different data


def _run_parity(rank, split, kwargs, mean, dtype):
    bn = _make_bn(CPUSyncBatchNorm, **kwargs).train()
    lo, hi = sum(split[:rank]), sum(split[: rank + 1])
    steps = []
    for step in range(STEPS):
        x, w = _batch(step, sum(split), mean)
        x = x[lo:hi].to(dtype, copy=True).requires_grad_()
        bn.zero_grad(set_to_none=True)
        with _CollectiveCounter() as forward, torch.autocast("cpu", torch.bfloat16, enabled=dtype == torch.bfloat16):
            y = bn(x)
        with _CollectiveCounter() as backward:
            (y * w[lo:hi]).sum().backward()
        out = {"y": y.detach(), "dx": x.grad, "collectives": (forward.count, backward.count)}
        if bn.affine:  # local param grads; summed over ranks they match the full-batch grads
            for name in ("weight", "bias"):
                grad = getattr(bn, name).grad.clone()
                dist.all_reduce(grad)
                out["d" + name] = grad
        steps.append(out)
    return {"steps": steps, "buffers": {k: v.clone() for k, v in bn.named_buffers()}}


def _run_ddp(rank):
    model = DDP(convert_syncbn(_ddp_model(), torch.device("cpu")), broadcast_buffers=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        model(_ddp_batch(rank)).square().mean().backward()
        opt.step()
    return {
        "types": [type(m).__name__ for m in model.module],
        "state": {k: v.clone() for k, v in model.module.state_dict().items()},
    }


def _worker(rank, port, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=60))
    try:
        results = {name: _run_parity(rank, *case) for name, case in PARITY_CASES.items()}
        results["ddp"] = _run_ddp(rank)
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Each rank's results, once for all test processes (shared_run)."""
    def spawn(out_dir: Path) -> None:
        mp.spawn(_worker, args=(_free_port(), str(out_dir)), nprocs=WORLD, join=True)

    out_dir, _ = shared_run("syncbn_ranks", spawn, tmp_path_factory)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("case", PARITY_CASES)
def test_matches_batchnorm_on_the_full_batch(ranks, case):
    split, kwargs, mean, dtype = PARITY_CASES[case]
    ref = _make_bn(nn.BatchNorm2d, **kwargs).train()
    bounds = [(sum(split[:r]), sum(split[: r + 1])) for r in range(WORLD)]
    for step in range(STEPS):
        x, w = _batch(step, sum(split), mean)
        x = x.to(dtype).requires_grad_()
        ref.zero_grad(set_to_none=True)
        with torch.autocast("cpu", torch.bfloat16, enabled=dtype == torch.bfloat16):
            y = ref(x)
        (y * w).sum().backward()
        for r, (lo, hi) in enumerate(bounds):
            got = ranks[r][case]["steps"][step]
            assert got["collectives"] == (1, 1)  # one in the forward, one in the backward, as on CUDA
            tolerance = TOLERANCE.get(case, {})
            torch.testing.assert_close(got["y"], y.detach()[lo:hi], **tolerance)
            torch.testing.assert_close(got["dx"], x.grad[lo:hi], **tolerance)
            if ref.affine:
                torch.testing.assert_close(got["dweight"], ref.weight.grad, **tolerance)
                torch.testing.assert_close(got["dbias"], ref.bias.grad, **tolerance)
    for r in range(WORLD):
        buffers = ranks[r][case]["buffers"]
        assert buffers.keys() == dict(ref.named_buffers()).keys()
        for name, value in ref.named_buffers():
            torch.testing.assert_close(buffers[name], value)


def test_ddp_on_cpu_trains_and_keeps_ranks_identical(ranks):
    assert ranks[0]["ddp"]["types"].count("CPUSyncBatchNorm") == 2
    states = [r["ddp"]["state"] for r in ranks]
    assert states[0].keys() == states[1].keys()
    for name in states[0]:
        # Buffers are not broadcast (broadcast_buffers=False): equal only if BN really synced.
        assert torch.equal(states[0][name], states[1][name]), name
    assert states[0]["1.num_batches_tracked"].item() == 2

    # The 2-rank run equals one process training on both ranks' data together.
    ref = _ddp_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.cat([_ddp_batch(r) for r in range(WORLD)])
    for _ in range(2):
        opt.zero_grad()
        ref(x).square().mean().backward()
        opt.step()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(states[0][name], value)


def test_convert_replaces_batchnorms_and_keeps_behaviour_without_process_group():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, eps=1e-3), nn.ReLU(),
        nn.Flatten(2), nn.BatchNorm1d(4, momentum=None),
        nn.Sequential(nn.Flatten(), nn.BatchNorm1d(36, affine=False)),
    )
    model(torch.randn(6, 3, 5, 5))  # move running stats off their defaults
    model[5].eval()
    original = copy.deepcopy(model)

    converted = CPUSyncBatchNorm.convert_sync_batchnorm(model)
    bns = [m for m in converted.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert len(bns) == 3 and all(type(m) is CPUSyncBatchNorm for m in bns)
    assert [m.training for m in bns] == [True, True, False]
    assert (bns[0].eps, bns[1].momentum, bns[2].affine) == (1e-3, None, False)
    torch.testing.assert_close(converted.state_dict(), original.state_dict(), rtol=0, atol=0)
    assert all(p.requires_grad for p in converted.parameters())
    # Converting again leaves the already-converted layers alone.
    assert CPUSyncBatchNorm.convert_sync_batchnorm(converted)[1] is bns[0]

    assert not dist.is_initialized() or dist.get_world_size() == 1  # i.e. the non-synced path
    x = torch.randn(6, 3, 5, 5)
    for mode in ("train", "eval"):
        getattr(converted, mode)(), getattr(original, mode)()
        assert torch.equal(converted(x), original(x)), mode
        torch.testing.assert_close(converted.state_dict(), original.state_dict(), rtol=0, atol=0)


def test_rejects_inputs_without_a_channel_dim():
    with pytest.raises(ValueError):
        CPUSyncBatchNorm(3)(torch.randn(3))
