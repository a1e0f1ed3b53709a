"""An exponential moving average of the weights (ema.decay), updated after every optimizer update
without waiting for the device."""

import copy

import torch
from torch import nn


class EMA(nn.Module):
    """An exponential moving average of a model's weights and buffers, updated without a host sync.

    torch's AveragedModel (torchvision's reference recipe) branches on its tensor counter every
    update (`bool(n_averaged == 0)`) and copies it to each (device, dtype) group: on a GPU both wait
    for the device. Here the count is a Python int. The first update copies the model; each later
    one is `ema = lerp(ema, w, 1 - decay)` over the floating-point weights and buffers in one
    `torch._foreach_lerp_` (get_ema_multi_avg_fn's math), and integer buffers (BatchNorm's
    num_batches_tracked) are copied. Its state_dict is AveragedModel's, `module.<key>` plus
    `n_averaged`, so checkpoints written with either load into it.
    """

    def __init__(self, model: nn.Module, decay: float):
        super().__init__()
        # a SyncBN layer's process group is shared by the copy, never copied (it can't be pickled)
        groups = {id(m.process_group): m.process_group for m in model.modules() if getattr(m, "process_group", None) is not None}
        self.module = copy.deepcopy(model, memo=groups)
        self.decay = decay
        self.n_averaged = 0  # updates so far
        self._split_tensors()
        self.register_state_dict_post_hook(_save_count)
        self.register_load_state_dict_pre_hook(_load_count)

    def _split_tensors(self) -> None:
        """Which of the EMA's tensors are averaged (floating point) and which copied (integer buffers),
        found once rather than at every update. The model's tensors pair with them by position: both
        list their parameters, then their buffers, in the same order."""
        tensors = _tensors(self.module)
        self._floating = [i for i, tensor in enumerate(tensors) if tensor.is_floating_point()]
        self._integer = [i for i, tensor in enumerate(tensors) if not tensor.is_floating_point()]
        self._all_tensors = tensors
        self._floating_tensors = [tensors[i] for i in self._floating]
        self._integer_tensors = [tensors[i] for i in self._integer]

    def _apply(self, fn, *args, **kwargs) -> "EMA":
        super()._apply(fn, *args, **kwargs)
        self._split_tensors()  # .to() and its kin put new tensors in place of the buffers
        return self

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        current = _tensors(model)
        if self.n_averaged == 0:
            torch._foreach_copy_(self._all_tensors, current)
        else:
            torch._foreach_lerp_(self._floating_tensors, [current[i] for i in self._floating], 1 - self.decay)
            if self._integer_tensors:  # a model without BatchNorm has none
                torch._foreach_copy_(self._integer_tensors, [current[i] for i in self._integer])
        self.n_averaged += 1


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def _save_count(ema: EMA, state_dict: dict, prefix: str, local_metadata) -> None:
    state_dict[prefix + "n_averaged"] = torch.tensor(ema.n_averaged)


def _load_count(ema: EMA, state_dict: dict, prefix: str, *_) -> None:
    ema.n_averaged = int(state_dict.pop(prefix + "n_averaged"))  # load_state_dict passes a copy


def build_ema(model: nn.Module, decay: float | None) -> EMA | None:
    """The EMA of `model` (on its device) with that decay, or None for none. Its update does no host
    read and copies nothing between devices, so it never waits for the GPU."""
    if decay is None:
        return None
    return EMA(model, decay)
