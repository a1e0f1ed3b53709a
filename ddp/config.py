"""Typed config schemas (registered in Hydra's ConfigStore) and the startup checks Hydra can't express.

The options of a model, a dataset or a task (the groups in BUILDERS) have no schema here: the
builder's own signature is their schema. `conf/model/my_net.yaml` names `_target_: models.my_net.build`,
and `def build(num_classes: int, in_channels: int, width: int = 64)` declares the option `width` and
its type. builder_options checks a group's keys against those parameters and its values against their
annotations (through OmegaConf, as a dataclass field), at startup, before anything runs or is
written. So a new model, dataset or task is one module and one yaml, its options are declared once,
where they are used, and a misspelt or mistyped one is a one-line ConfigError naming it. The group's
own dataclass (ModelConfig, DataConfig, TaskConfig) holds only the keys the run reads itself
(weights_path; the loading keys; the objective and its direction); Hydra checks those when it
composes, and leaves the group open to the builder's keys.

Why the signature, and not a dataclass next to the builder: the builder has to declare its
parameters anyway, and a second declaration can drift from it (a field it ignores, a default that
differs).
"""

import dataclasses
import difflib
import inspect
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hydra.core.config_store import ConfigStore
from hydra.errors import InstantiationException
from hydra._internal.utils import _locate
from hydra.utils import instantiate
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ValidationError


class ConfigError(ValueError):
    """A user-facing config mistake; printed as one line, no traceback."""


@dataclass
class StrategyConfig:
    name: str = MISSING  # single | dp | ddp | fsdp, set by the strategy/<name>.yaml option
    timeout_s: float = 1800.0  # process-group timeout; a rank stuck in a collective fails after this
    bucket_cap_mb: float = 25.0  # DDP gradient bucket size
    find_unused_parameters: bool = False  # only needed for models with conditional branches
    nproc_per_node: int = 0  # ddp without torchrun: start this many local workers (0: launch with torchrun)
    max_restarts: int = 0  # self-launched workers: restarts of the whole group after a failure, as torchrun's


@dataclass
class FSDPStrategyConfig(StrategyConfig):
    """strategy=fsdp (ddp/fsdp.py): parameters, gradients and optimizer state sharded across the ranks."""

    # true: free each block's gathered parameters after its forward and gather them again for the
    # backward (ZeRO-3: least memory, one more all-gather per block); false: keep them until the
    # backward (ZeRO-2-like: more memory, less communication)
    reshard_after_forward: bool = True
    # null: the model's own (its fsdp_block_types) or the known families' (ddp/fsdp.py); else class
    # names, e.g. [Bottleneck]: each module of these classes is sharded as one unit, then the root
    block_types: list[str] | None = None


@dataclass
class ModelConfig:
    """The keys the run reads itself; every other model.* key is an option of `_target_` (builder_options)."""

    _target_: str = MISSING  # called with num_classes= and in_channels= taken from the data, and its options
    weights_path: str | None = None  # local weights loaded before training (a state_dict, .safetensors, or our checkpoint)
    weights_scope: str = "model"  # model | backbone: what weights_path loads into (models/segmentation.py)


@dataclass
class DataConfig:
    """The loading keys; every other data.* key is an option of `_target_` (builder_options)."""

    _target_: str = MISSING  # returns a data.DataSplits; called with its options only
    batch_size: int = 32  # per process; the global batch is batch_size * world_size
    num_workers: int = 0
    mixup_alpha: float = 0.0  # > 0: MixUp training batches (Beta(alpha, alpha) weights)
    cutmix_alpha: float = 0.0  # > 0: CutMix training batches; with both set, each batch gets one of the two at random
    split: str = "val"  # val | test: the split that mode=eval evaluates (training always validates on val)
    # Per process, for evaluation; null: batch_size. data=voc sets 1, as torchvision's reference: a padded
    # image's predictions near its edges would depend on its batch-mates, and so on the world size.
    val_batch_size: int | None = None


@dataclass
class TaskConfig:
    """The keys the run reads itself; every other task.* key is an option of `_target_` (builder_options)."""

    _target_: str = MISSING  # called with num_classes= and class_names= taken from the data, and its options
    objective: str = MISSING  # the results key main returns: what a sweep and Optuna optimise, e.g. val_accuracy
    direction: str = "maximize"  # maximize | minimize: the objective's direction (Optuna's, via ${task.direction})


# The groups whose `_target_` brings its own options: group -> (the schema of the keys the run reads
# itself, the arguments the run passes the builder besides its options).
BUILDERS = {
    "model": (ModelConfig, ("num_classes", "in_channels")),
    "data": (DataConfig, ()),
    "task": (TaskConfig, ("num_classes", "class_names")),
}


@dataclass
class OptimConfig:
    _target_: str = MISSING  # a torch.optim class; gets params= and the keys below but the scaling keys
    lr: float = MISSING  # at optim.reference_batch_size; see lr_scaling
    lr_scaling: str = "none"  # none | linear | sqrt: scale lr by the global batch / reference_batch_size
    reference_batch_size: int = 256  # the global batch that optim.lr is meant for


# Keys of OptimConfig that say how to scale the LR, not for the torch.optim class.
LR_SCALING_KEYS = ("lr_scaling", "reference_batch_size")


@dataclass
class SGDConfig(OptimConfig):
    momentum: float = 0.9
    weight_decay: float = 0.0
    nesterov: bool = False


@dataclass
class AdamConfig(OptimConfig):
    weight_decay: float = 0.0


@dataclass
class SchedulerConfig:
    """Stepped once per optimizer update (not per micro-batch, not per epoch)."""

    name: str = MISSING  # none | cosine | step, set by the scheduler/<name>.yaml option
    warmup_steps: int = 0  # linear warmup over this many updates (plus warmup_epochs); the first LR is lr / warmup
    warmup_epochs: float = 0.0


@dataclass
class CosineSchedulerConfig(SchedulerConfig):
    min_lr: float = 0.0  # the LR at the last update


@dataclass
class StepSchedulerConfig(SchedulerConfig):
    milestones: list[int] = field(default_factory=lambda: [30, 60])  # epochs at which the LR is multiplied by gamma
    gamma: float = 0.1


@dataclass
class EMAConfig:
    decay: float | None = None  # null: off; e.g. 0.999: an exponential moving average of the weights, evaluated too


@dataclass
class TrainerConfig:
    max_epochs: int = 10
    max_steps: int = -1  # -1: no limit; otherwise stop after this many optimizer steps (updates)
    accumulate_grad_batches: int = 1  # micro-batches per optimizer update
    # null: batch_size x world_size x accumulate_grad_batches. Set, it derives accumulate_grad_batches
    # at each world size, so an elastic run keeps its global batch (and updates per epoch) when it scales.
    global_batch_size: int | None = None
    gradient_clip_norm: float | None = None  # null: off; else clip the global grad norm to this
    label_smoothing: float = 0.0  # of the training loss (F.cross_entropy's); validation reports the plain loss
    log_every_n_steps: int = 10  # at most MAX_LOG_EVERY_N_STEPS: DDP ranks also agree on SIGTERM then
    # After SIGTERM, Ctrl-C or submitit's requeue signal, a rank that reaches no check step within this
    # exits without a checkpoint (a requeue signal still requeues). torchrun force-kills 30 s after its
    # SIGTERM: leave time to save once.
    stop_deadline_s: float = 20.0
    val_every_n_epochs: int = 1
    limit_train_batches: int = -1  # -1: all; for smoke runs
    limit_val_batches: int = -1  # -1: all; a limit makes validation inexact
    warmup_steps: int = 3  # steps left out of the steady-state samples/s
    objective: str = "final"  # final | best: what main returns and a sweep ranks, the last validation's or the best one's
    # null: off; else stop after this many validations in a row without an improvement of the task's
    # objective (checkpoint.best_of's) larger than early_stop_min_delta
    early_stop_patience: int | None = None
    early_stop_min_delta: float = 0.0


@dataclass
class CheckpointConfig:
    every_n_steps: int = 100  # rank 0 saves every n optimizer steps (0: only at the end)
    keep_last: int = 3  # step checkpoints kept; older ones are deleted
    keep_best: int = 1  # the checkpoints of this many best validations kept as best-<step>.pt, the best as best.pt (0: off)
    best_of: str = "model"  # model | ema: whose validation metric ranks them (ema needs ema.decay)


@dataclass
class FaultConfig:
    """Testing aids, off by default: one rank fails at one step (on the first attempt only), one rank is
    slowed, validation is slowed, or every rank records the samples it trains."""

    kill_rank: int = -1  # this rank exits hard (SIGKILL)
    raise_rank: int = -1  # this rank raises an exception
    stall_rank: int = -1  # this rank hangs, until the process-group timeout ends the job
    at_step: int = -1
    every_attempt: bool = False  # fail after torchrun restarts too (exhausts --max-restarts)
    slow_rank: int = -1  # this rank's every training forward takes slow_ms longer (a straggler)
    slow_ms: float = 0.0
    slow_val_ms: float = 0.0  # every rank's every validation forward takes this much longer (a long validation)
    record_samples_dir: str | None = None  # each rank appends the dataset indices of every batch it trains here


@dataclass
class TrainConfig:
    strategy: StrategyConfig = MISSING
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    optim: OptimConfig = MISSING
    scheduler: SchedulerConfig = MISSING
    task: TaskConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    ema: EMAConfig = field(default_factory=EMAConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    mode: str = "train"  # train | eval: evaluate the checkpoint that `resume` names, train nothing
    resume: str | None = None  # auto | a run dir | a checkpoint file; auto after a torchrun restart
    # The GPUs this run may use, e.g. [0, 2] (seen as cuda:0 and cuda:1); null: all that CUDA_VISIBLE_DEVICES leaves
    devices: list[int] | None = None
    backend: str = "auto"  # auto | nccl | gloo; auto is nccl when CUDA is available, else gloo
    syncbn: bool = False  # synchronize BatchNorm statistics across ranks (strategy=ddp or fsdp)
    deterministic: bool = False  # cuDNN picks deterministic algorithms only (exact resume on GPUs; slower)
    precision: str = "32"  # 32 | bf16 | 16 (fp16, with a GradScaler): autocast on the run's device
    channels_last: bool = False  # model and every input batch in channels_last memory format
    compile: bool = False  # torch.compile the model (before wrapping; checkpoints keep the plain keys)
    compile_mode: str | None = None  # torch.compile(mode=...): null (default), reduce-overhead, max-autotune
    seed: int = 0


# The schemas of the groups whose options are fixed here. A model's, dataset's or task's own options
# have no entry: their schema is their builder's signature (builder_options).
SCHEMAS = {
    "strategy": {"single": StrategyConfig, "dp": StrategyConfig, "ddp": StrategyConfig, "fsdp": FSDPStrategyConfig},
    "optim": {"sgd": SGDConfig, "adam": AdamConfig, "adamw": AdamConfig},
    "scheduler": {"none": SchedulerConfig, "cosine": CosineSchedulerConfig, "step": StepSchedulerConfig},
}


def register_configs() -> None:
    """Register the schemas; conf/<group>/<option>.yaml starts from `/schema/<group>/<option>@_here_`.
    The BUILDERS groups stay open to keys their schema doesn't declare: those are the builder's options."""
    cs = ConfigStore.instance()
    train = OmegaConf.structured(TrainConfig)
    for group in BUILDERS:
        OmegaConf.set_struct(train._get_node(group), False)
    cs.store(name="train", group="schema", node=train)
    for group, schemas in SCHEMAS.items():
        for option, schema in schemas.items():
            cs.store(group=f"schema/{group}", name=option, node=schema)


HYDRA_KEYS = ("_target_", "_args_", "_convert_", "_recursive_", "_partial_")  # for instantiate, not the builder


def builder_options(group_cfg: Any, group: str) -> dict:
    """`_target_` and its options from a BUILDERS group's config, checked against the builder's own
    signature: the signature is the options' schema. Every key but the group's own (its schema's) must
    name a parameter of the builder, other than the arguments the run passes it; each parameter without
    a default must be given; and each value must fit its parameter's annotation, converted as OmegaConf
    converts a dataclass field (`int`, `float`, `list[int]`, `str | None`, ...; `Literal[...]` lists the
    allowed values; an annotation OmegaConf can't check, or none, takes any value)."""
    schema, run_args = BUILDERS[group]
    group_keys = {f.name for f in dataclasses.fields(schema)} - {"_target_"}
    node = group_cfg if isinstance(group_cfg, DictConfig) else OmegaConf.create(group_cfg)
    values = OmegaConf.to_container(node, resolve=True, throw_on_missing=False)
    target = values["_target_"]
    options = {key: value for key, value in values.items() if key not in group_keys and key not in HYDRA_KEYS}
    if target == MISSING:  # validate names it as a missing key
        return options
    try:
        builder = _locate(target)  # what instantiate imports; get_object would also log the error
        parameters = inspect.signature(builder, eval_str=True).parameters
    except (ImportError, AttributeError, NameError, ValueError, TypeError) as error:
        reason = " ".join(str(error).split())
        raise ConfigError(f"{group}._target_={target}: can't be imported or inspected ({reason}); "
                          f"check the module path in conf/{group}/*.yaml") from None
    specials = {key: value for key, value in values.items() if key in HYDRA_KEYS}
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):  # **kwargs: any key is an option
        return {**specials, **options}
    accepted = {name: p for name, p in parameters.items()
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and name not in run_args}
    not_taken = [name for name in run_args if name not in parameters]
    _check(not not_taken, f"{group}._target_={target}: must take {', '.join(not_taken)} as keyword arguments "
                          f"(the run passes {', '.join(run_args)}); add them to its parameters")
    for key in options:
        if key in run_args:
            raise ConfigError(f"{group}.{key}: the run passes {key} to {target} itself; remove {group}.{key}")
        if key not in accepted:
            closest = difflib.get_close_matches(key, accepted, n=1)
            hint = f"did you mean {group}.{closest[0]}? " if closest else ""
            raise ConfigError(f"{group}.{key}: unknown key, not an option of {target} ({hint}options: "
                              f"{', '.join(accepted) or 'none'}); check the spelling")
    for name, parameter in accepted.items():
        if name not in options and parameter.default is parameter.empty:
            raise ConfigError(f"{group}.{name} is required: {target} has no default for it; "
                              f"set it in conf/{group}/*.yaml or pass {group}.{name}=<value>")
    annotations = {name: accepted[name].annotation for name in options}
    return {**specials, **_typed_options(options, annotations, group, target)}


def _typed_options(options: dict, annotations: dict, group: str, target: str) -> dict:
    """`options` converted to their annotations by OmegaConf, through a dataclass made of them."""
    fields = []
    for name, annotation in annotations.items():
        if typing.get_origin(annotation) is typing.Literal:
            choices, value = typing.get_args(annotation), options[name]
            _check(value == MISSING or value in choices,
                   f"{group}.{name}={value}: unknown, use one of {', '.join(map(str, choices))}")
        fields.append((name, annotation if _omegaconf_checks(annotation) else Any, field(default=MISSING)))
    typed = OmegaConf.structured(dataclasses.make_dataclass("BuilderOptions", fields))
    try:
        typed = OmegaConf.merge(typed, options)
    except ValidationError as error:
        name = str(error.full_key).split(".")[0].split("[")[0]
        reason = str(error).strip().splitlines()[0]
        raise ConfigError(f"{group}.{error.full_key}: {reason}; {target} takes "
                          f"{name}: {inspect.formatannotation(annotations[name])}") from None
    return OmegaConf.to_container(typed, throw_on_missing=False)


def _omegaconf_checks(annotation: Any) -> bool:
    """Whether OmegaConf can type-check a dataclass field with this annotation."""
    if annotation is inspect.Parameter.empty:
        return False
    try:
        OmegaConf.structured(dataclasses.make_dataclass("probe", [("value", annotation, field(default=MISSING))]))
    except Exception:  # omegaconf raises ValidationError, and others for annotations it doesn't know
        return False
    return True


def optimizer_node(optim_cfg) -> dict:
    """What the torch.optim class gets: optim.* without the LR scaling keys."""
    return {key: value for key, value in optim_cfg.items() if key not in LR_SCALING_KEYS}


def instantiate_checked(node: Any, key: str, **kwargs: Any) -> Any:
    """hydra.utils.instantiate, with a value the target rejects turned into a one-line error naming `key`."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as error:
        cause = error.__cause__
        if isinstance(cause, ConfigError):  # the builder's own message
            raise cause from None
        if isinstance(cause, (ValueError, TypeError)):  # e.g. torch.optim's "Invalid weight_decay value"
            raise ConfigError(f"{key}: {cause}") from None
        raise


def check_model_accepts(model: torch.nn.Module, sample: torch.Tensor) -> None:
    """One sample through the model in eval mode, so data the model can't take (an image too small
    for its pooling, the wrong channel count) stops the run now, as a one-line error."""
    was_training = model.training
    try:
        with torch.no_grad():
            model.eval()(sample.unsqueeze(0))
    except (RuntimeError, ValueError) as error:
        reason = str(error).strip().splitlines()[0]
        raise ConfigError(f"data/model: the model can't take this data's samples (shape {list(sample.shape)}): "
                          f"{reason}; check data.image_size / data.channels against model.*") from None
    finally:
        model.train(was_training)


STRATEGIES = ("single", "dp", "ddp", "fsdp")
MULTI_PROCESS = ("ddp", "fsdp")  # one process per device, in a process group
MODES = ("train", "eval")
SPLITS = ("val", "test")
PRECISIONS = ("32", "bf16", "16")
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
LR_SCALINGS = ("none", "linear", "sqrt")
# DDP ranks act on SIGTERM at log steps; this many steps must fit in trainer.stop_deadline_s.
MAX_LOG_EVERY_N_STEPS = 100
BACKENDS = ("auto", "nccl", "gloo")
DIRECTIONS = ("maximize", "minimize")
OBJECTIVES = ("final", "best")
BEST_OF = ("model", "ema")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _unknown_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """Keys that no schema declares. Hydra lets `+key=value` add them even to structured configs.
    The BUILDERS groups' keys are builder_options' to check."""
    schema = OmegaConf.get_type(node)
    known = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else set(node)
    unknown = [prefix + str(key) for key in node if key not in known]
    for key in known & set(node):
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and f"{prefix}{key}" not in BUILDERS:
            unknown += _unknown_keys(child, f"{prefix}{key}.")
    return unknown


def validate(cfg: Any, *, launched: bool, world_size: int) -> None:
    """Check what the schema's types can't, before anything is started or written."""
    for key in _unknown_keys(cfg):
        raise ConfigError(f"{key}: unknown key; check the spelling (`python train.py --cfg job` lists the keys)")
    for group in BUILDERS:
        builder_options(cfg[group], group)
    for key in sorted(OmegaConf.missing_keys(cfg)):
        raise ConfigError(f"{key} is required: pass {key}=<value> on the command line")
    strategy = cfg.strategy.name
    _check(strategy in STRATEGIES, f"strategy.name={strategy}: unknown, use one of {', '.join(STRATEGIES)}")
    if cfg.devices is not None:
        devices = list(cfg.devices)
        _check(len(devices) > 0 and min(devices) >= 0 and len(set(devices)) == len(devices),
               f"devices={devices}: list distinct GPU indices >= 0 (e.g. devices=[0,2]), or devices=null for all visible GPUs")
    _check(cfg.backend in BACKENDS, f"backend={cfg.backend}: unknown, use one of {', '.join(BACKENDS)}")
    _check(cfg.data.batch_size > 0, f"data.batch_size={cfg.data.batch_size}: must be > 0 (it is per process), e.g. data.batch_size=32")
    _check(cfg.data.num_workers >= 0, f"data.num_workers={cfg.data.num_workers}: must be >= 0")
    if cfg.data.val_batch_size is not None:
        _check(cfg.data.val_batch_size > 0, f"data.val_batch_size={cfg.data.val_batch_size}: must be > 0, e.g. 1")
    _check(cfg.optim.lr > 0, f"optim.lr={cfg.optim.lr}: must be > 0, e.g. optim.lr=0.01")
    if "momentum" in cfg.optim:  # torch accepts any momentum >= 0; from 1 on, updates grow without bound
        momentum = cfg.optim.momentum
        _check(0 <= momentum < 1, f"optim.momentum={momentum}: must be in [0, 1), e.g. optim.momentum=0.9")
    _check(cfg.strategy.timeout_s > 0, f"strategy.timeout_s={cfg.strategy.timeout_s}: must be > 0")
    trainer = cfg.trainer
    _check(trainer.max_epochs >= 1, f"trainer.max_epochs={trainer.max_epochs}: must be >= 1")
    for key in ("max_steps", "limit_train_batches", "limit_val_batches"):
        value = trainer[key]
        _check(value == -1 or value >= 1, f"trainer.{key}={value}: must be -1 (no limit) or >= 1")
    for key in ("log_every_n_steps", "val_every_n_epochs"):
        _check(trainer[key] >= 1, f"trainer.{key}={trainer[key]}: must be >= 1")
    _check(
        trainer.log_every_n_steps <= MAX_LOG_EVERY_N_STEPS,
        f"trainer.log_every_n_steps={trainer.log_every_n_steps}: must be <= {MAX_LOG_EVERY_N_STEPS} (DDP ranks check "
        "for SIGTERM at log steps, and must reach one within trainer.stop_deadline_s of it)",
    )
    _check(trainer.stop_deadline_s > 0, f"trainer.stop_deadline_s={trainer.stop_deadline_s}: must be > 0")
    _check(trainer.warmup_steps >= 0, f"trainer.warmup_steps={trainer.warmup_steps}: must be >= 0")
    _check(cfg.checkpoint.every_n_steps >= 0, f"checkpoint.every_n_steps={cfg.checkpoint.every_n_steps}: must be >= 0 (0: only at the end)")
    _check(cfg.checkpoint.keep_last >= 1, f"checkpoint.keep_last={cfg.checkpoint.keep_last}: must be >= 1")
    _check(cfg.checkpoint.keep_best >= 0, f"checkpoint.keep_best={cfg.checkpoint.keep_best}: must be >= 0 (0: off)")
    _check(cfg.checkpoint.best_of in BEST_OF, f"checkpoint.best_of={cfg.checkpoint.best_of}: unknown, use one of {', '.join(BEST_OF)}")
    _check(cfg.checkpoint.best_of != "ema" or cfg.ema.decay is not None,
           "checkpoint.best_of=ema ranks by the EMA weights' metric, but there are none: set ema.decay (e.g. 0.999) or checkpoint.best_of=model")
    _check(trainer.objective in OBJECTIVES, f"trainer.objective={trainer.objective}: unknown, use one of {', '.join(OBJECTIVES)}")
    patience = trainer.early_stop_patience
    _check(patience is None or patience >= 1, f"trainer.early_stop_patience={patience}: must be >= 1, or null for no early stopping")
    _check(trainer.early_stop_min_delta >= 0, f"trainer.early_stop_min_delta={trainer.early_stop_min_delta}: must be >= 0")
    for key in ("kill_rank", "raise_rank", "stall_rank"):
        rank = cfg.fault[key]
        _check(rank < world_size, f"fault.{key}={rank}: there are only {world_size} ranks")
        _check(rank < 0 or cfg.fault.at_step >= 1, f"fault.{key}={rank} needs fault.at_step >= 1")
    _check(cfg.fault.slow_rank < world_size, f"fault.slow_rank={cfg.fault.slow_rank}: there are only {world_size} ranks")
    _check(cfg.fault.slow_rank < 0 or cfg.fault.slow_ms > 0, f"fault.slow_rank={cfg.fault.slow_rank} needs fault.slow_ms > 0")
    _check(cfg.fault.slow_val_ms >= 0, f"fault.slow_val_ms={cfg.fault.slow_val_ms}: must be >= 0")
    _check(cfg.task.direction in DIRECTIONS,
           f"task.direction={cfg.task.direction}: unknown, use one of {', '.join(DIRECTIONS)}")
    _check(cfg.mode in MODES, f"mode={cfg.mode}: unknown, use one of {', '.join(MODES)}")
    _check(cfg.data.split in SPLITS, f"data.split={cfg.data.split}: unknown, use one of {', '.join(SPLITS)}")
    if cfg.mode == "eval":
        _check(cfg.resume not in (None, "auto"), "mode=eval evaluates a checkpoint: pass resume=<checkpoint file or run dir>")
    else:
        _check(cfg.data.split == "val", f"data.split={cfg.data.split}: training validates on val; evaluate the test "
                                        "split with mode=eval resume=<checkpoint or run dir> data.split=test")
    if cfg.resume not in (None, "auto"):
        _check(Path(cfg.resume).exists(), f"resume={cfg.resume}: not found; pass a run dir, a checkpoint file, or resume=auto")
    _check(cfg.precision in PRECISIONS, f"precision={cfg.precision}: unknown, use one of {', '.join(PRECISIONS)}")
    _check(cfg.compile_mode in COMPILE_MODES,
           f"compile_mode={cfg.compile_mode}: unknown, use null or one of {', '.join(m for m in COMPILE_MODES if m)}")
    _check(trainer.accumulate_grad_batches >= 1,
           f"trainer.accumulate_grad_batches={trainer.accumulate_grad_batches}: must be >= 1 (micro-batches per update)")
    global_batch = trainer.global_batch_size
    if global_batch is not None:
        per_batch = cfg.data.batch_size * world_size
        _check(trainer.accumulate_grad_batches == 1,
               f"trainer.global_batch_size={global_batch} sets trainer.accumulate_grad_batches itself: "
               f"drop trainer.accumulate_grad_batches={trainer.accumulate_grad_batches}")
        _check(global_batch >= 1 and global_batch % per_batch == 0,
               f"trainer.global_batch_size={global_batch}: must be a multiple of data.batch_size x world size = "
               f"{cfg.data.batch_size} x {world_size} = {per_batch} (it is accumulated from those batches): change "
               "trainer.global_batch_size or data.batch_size, for an elastic run so that every world size divides it")
    clip = trainer.gradient_clip_norm
    _check(clip is None or clip > 0, f"trainer.gradient_clip_norm={clip}: must be > 0, or null for no clipping")
    _check(0 <= trainer.label_smoothing < 1, f"trainer.label_smoothing={trainer.label_smoothing}: must be in [0, 1), e.g. 0.1")
    for key in ("mixup_alpha", "cutmix_alpha"):
        _check(cfg.data[key] >= 0, f"data.{key}={cfg.data[key]}: must be >= 0 (0: off), e.g. data.{key}=0.2")
    decay = cfg.ema.decay
    _check(decay is None or 0 < decay < 1, f"ema.decay={decay}: must be in (0, 1), e.g. ema.decay=0.999, or null for no EMA")
    _check(cfg.optim.lr_scaling in LR_SCALINGS,
           f"optim.lr_scaling={cfg.optim.lr_scaling}: unknown, use one of {', '.join(LR_SCALINGS)}")
    _check(cfg.optim.reference_batch_size >= 1, f"optim.reference_batch_size={cfg.optim.reference_batch_size}: must be >= 1")
    scheduler = cfg.scheduler
    for key in ("warmup_steps", "warmup_epochs"):
        _check(scheduler[key] >= 0, f"scheduler.{key}={scheduler[key]}: must be >= 0")
    if "min_lr" in scheduler:
        _check(0 <= scheduler.min_lr <= cfg.optim.lr, f"scheduler.min_lr={scheduler.min_lr}: must be in [0, optim.lr]")
    if "gamma" in scheduler:
        _check(0 < scheduler.gamma <= 1, f"scheduler.gamma={scheduler.gamma}: must be in (0, 1]")
        milestones = list(scheduler.milestones)
        _check(milestones == sorted(set(milestones)) and all(m >= 1 for m in milestones),
               f"scheduler.milestones={milestones}: must be increasing epochs >= 1")
    _check(cfg.strategy.nproc_per_node >= 0, f"strategy.nproc_per_node={cfg.strategy.nproc_per_node}: must be >= 0")
    _check(cfg.strategy.max_restarts >= 0, f"strategy.max_restarts={cfg.strategy.max_restarts}: must be >= 0")
    if strategy in MULTI_PROCESS:
        _check(
            launched or cfg.strategy.nproc_per_node >= 1,
            f"strategy={strategy} needs one process per device: launch it with "
            f"`torchrun --nproc_per_node=N train.py strategy={strategy} ...`, or add strategy.nproc_per_node=N",
        )
    else:
        _check(
            world_size == 1,
            f"strategy={strategy} runs one process, but {world_size} were started: "
            "use strategy=ddp, or torchrun --nproc_per_node=1",
        )
    if strategy == "fsdp":
        _check_fsdp_settings(cfg)
    if cfg.data.get("download", False):
        _check(world_size == 1, "data.download=true: download with one process first, then launch torchrun with data.download=false")
    root = cfg.data.get("root")
    if root is not None and not cfg.data.get("download", False):
        _check(Path(root).is_dir(), f"data.root={root}: no such directory; point data.root at the dataset's folder")


def _check_fsdp_settings(cfg: Any) -> None:
    """What strategy=fsdp doesn't do yet (docs/fsdp.md), refused before anything starts."""
    _check(cfg.ema.decay is None, f"ema.decay={cfg.ema.decay}: the EMA keeps a full copy of the model, which "
                                  "strategy=fsdp doesn't shard yet; use strategy=ddp, or ema.decay=null")
    _check(not cfg.compile, "compile=true: strategy=fsdp doesn't compile its sharded blocks yet; use compile=false, or strategy=ddp")
    _check(cfg.precision == "32", f"precision={cfg.precision}: strategy=fsdp trains in float32 only for now "
                                  "(no MixedPrecisionPolicy yet); use precision=32, or strategy=ddp")
    _check(cfg.task.get("num_images_logged", 0) == 0,
           f"task.num_images_logged={cfg.task.get('num_images_logged')}: the image grid runs the model on rank 0 "
           "alone, and a sharded model's forward needs every rank; use task.num_images_logged=0 with strategy=fsdp")
