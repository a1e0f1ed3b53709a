"""Typed config schemas, registered in Hydra's ConfigStore, and ConfigError: a config mistake, one line.

The options of a model, a dataset or a task (the groups in BUILDERS) have no schema here: the
builder's own signature is their schema (ddp/config/builder_options.py). The group's own dataclass
(ModelConfig, DataConfig, TaskConfig) holds only the keys the run reads itself (weights_path; the
loading keys; the objective and its direction); Hydra checks those when it composes, and leaves the
group open to the builder's keys. What the types can't express is checked at startup
(ddp/config/checks.py).
"""

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf


class ConfigError(ValueError):
    """A user-facing config mistake; printed as one line, no traceback."""


MULTI_PROCESS = ("ddp", "fsdp", "hsdp")  # the strategies of one process per device, in a process group
SHARDED = ("fsdp", "hsdp")  # FSDP2's: sharded parameters (ddp/distributed/fsdp.py) and sharded checkpoints
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")


@dataclass
class StrategyConfig:
    name: str = MISSING  # single | dp | ddp | fsdp | hsdp, set by the strategy/<name>.yaml option
    timeout_s: float = 1800.0  # process-group timeout; a rank stuck in a collective fails after this
    bucket_cap_mb: float = 25.0  # DDP gradient bucket size
    find_unused_parameters: bool = False  # only needed for models with conditional branches
    nproc_per_node: int = 0  # ddp without torchrun: start this many local workers (0: launch with torchrun)
    max_restarts: int = 0  # self-launched workers: restarts of the whole group after a failure, as torchrun's
    # The model's blocks: what fsdp and hsdp shard one by one, and what activation_checkpointing recomputes.
    # null: the model's own (its fsdp_block_types) or the known families' (ddp/distributed/fsdp.py); else class
    # names, e.g. [Bottleneck]; []: none (fsdp: the root alone, the whole model as one unit)
    block_types: list[str] | None = None


@dataclass
class FSDPStrategyConfig(StrategyConfig):
    """strategy=fsdp (ddp/distributed/fsdp.py): parameters, gradients and optimizer state sharded across the ranks."""

    # true: free each block's gathered parameters after its forward and gather them again for the
    # backward (ZeRO-3: least memory, one more all-gather per block); false: keep them until the
    # backward (ZeRO-2-like: more memory, less communication)
    reshard_after_forward: bool = True


@dataclass
class HSDPStrategyConfig(FSDPStrategyConfig):
    """strategy=hsdp (ddp/distributed/fsdp.py): sharded within groups of shard_size ranks, replicated across the groups."""

    shard_size: int | None = None  # ranks per shard group; null: the processes of a node (LOCAL_WORLD_SIZE)


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
    # > 0: a sharded dataset's epoch goes through its shards in a shuffled order, this many at a time, its
    # samples shuffled within them (reads stay within those shards); 0: one shuffle of all samples
    shuffle_window: int = 0
    # > 0: training batches of images of similar aspect ratio (a detection dataset's `aspect_ratios`), formed on
    # the global batch, as torchvision's --aspect-ratio-group-factor: 2K+2 groups (docs/distributed.md); 0: off
    aspect_ratio_groups: int = 0


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
# Arguments the run passes a builder only where its signature has them (a task's teacher needs the data's channels).
OPTIONAL_RUN_ARGS = {"task": ("in_channels",)}


@dataclass
class OptimConfig:
    _target_: str = MISSING  # a torch.optim class; gets params= and the keys below but the scaling keys
    lr: float = MISSING  # at optim.reference_batch_size; see lr_scaling
    lr_scaling: str = "none"  # none | linear | sqrt: scale lr by the global batch / reference_batch_size
    reference_batch_size: int = 256  # the global batch that optim.lr is meant for



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
class ProfilerConfig:
    """torch.profiler over a few updates, and CUDA memory snapshots: each rank writes its own files
    under the run dir's profiler/ (docs/profiling.md). Off by default, and then it costs nothing."""

    # trace this process's updates wait+warmup+1 .. wait+warmup+active (a resumed run counts from its own start)
    enabled: bool = False
    wait: int = 1  # updates not traced first (the first ones carry one-off setup costs)
    warmup: int = 1  # updates traced but thrown away (the profiler's own start-up skews them)
    active: int = 3  # updates recorded into the trace, profiler/rank<R>_step<N>.json.gz (N: the last one's global step)
    table_rows: int = 15  # rows of the key-averages table rank 0 logs at the end (0: none)
    # CUDA only: record every allocation from the start; each rank dumps profiler/memory_rank<R>_step<N>.pickle
    # at memory_snapshot_step (a global step) and profiler/memory_rank<R>_oom.pickle on an out-of-memory error
    memory_history: bool = False
    memory_snapshot_step: int | None = None


@dataclass
class TensorBoardConfig:
    """logger=tensorboard: event files in the run dir (no options)."""


@dataclass
class MLflowConfig:
    """logger=mlflow (docs/tracking.md): one MLflow run per launch, continued by a resume."""

    tracking_uri: str | None = None  # null: the local store outputs/mlflow.db (no server; `make mlflow-ui`); else a server's URL
    experiment: str | None = None  # null: hydra-ddp, and for a sweep's jobs the sweep dir; else this name for every run


@dataclass
class WandbConfig:
    """logger=wandb (docs/tracking.md): one W&B run per launch, continued by a resume, files under <run dir>/wandb/."""

    project: str = "hydra-ddp"
    entity: str | None = None  # null: the W&B default of the logged-in user
    mode: str = "auto"  # auto | online | offline; auto: online when an API key is set up, else offline (`wandb sync` later)


@dataclass
class LoggerConfig:
    """The trackers a run logs to, picked in the `logger` group (logger=[tensorboard,mlflow]); unpicked ones are null."""

    tensorboard: TensorBoardConfig | None = None
    mlflow: MLflowConfig | None = None
    wandb: WandbConfig | None = None


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
    log_every_n_steps: int = 10  # at most 100 (ddp.config.checks.MAX_LOG_EVERY_N_STEPS): DDP ranks also agree on SIGTERM then
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
    # true: a save copies the state and training goes on while a thread writes it (one save in flight at most)
    async_save: bool = False


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
    slow_save_step: int = -1  # the background write of this step's checkpoint (checkpoint.async_save) ...
    slow_save_s: float = 0.0  # ... waits this long first, as on a slow filesystem
    plan: str | None = None  # a JSON file of faults, each thrown once at its step (ddp/training/faults.py's FaultPlan; tests/soak.py)


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
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    mode: str = "train"  # train | eval: evaluate the checkpoint that `resume` names, train nothing
    resume: str | None = None  # auto | a run dir | a checkpoint file; auto after a torchrun restart
    # The GPUs this run may use, e.g. [0, 2] (seen as cuda:0 and cuda:1); null: all that CUDA_VISIBLE_DEVICES leaves
    devices: list[int] | None = None
    backend: str = "auto"  # auto | nccl | gloo; auto is nccl when CUDA is available, else gloo
    syncbn: bool = False  # synchronize BatchNorm statistics across ranks (strategy=ddp, fsdp or hsdp)
    # none | full: recompute every block's activations in the backward instead of keeping them | selective:
    # every activation_checkpointing_every-th block's (the blocks: strategy.block_types; ddp/training/activation_checkpointing.py)
    activation_checkpointing: str = "none"
    activation_checkpointing_every: int = 2
    deterministic: bool = False  # cuDNN picks deterministic algorithms only (exact resume on GPUs; slower)
    precision: str = "32"  # 32 | bf16 | 16 (fp16, with a GradScaler): autocast on the run's device
    channels_last: bool = False  # model and every input batch in channels_last memory format
    keep_freed_host_memory: bool = True  # glibc's malloc keeps what a step frees for the next, as on GPUs (no page faults)
    compile: bool = False  # torch.compile the model (before wrapping; checkpoints keep the plain keys)
    compile_mode: str | None = None  # torch.compile(mode=...): null (default), reduce-overhead, max-autotune
    seed: int = 0


# The schemas of the groups whose options are fixed here. A model's, dataset's or task's own options
# have no entry: their schema is their builder's signature (builder_options).
SCHEMAS = {
    "strategy": {"single": StrategyConfig, "dp": StrategyConfig, "ddp": StrategyConfig, "fsdp": FSDPStrategyConfig,
                 "hsdp": HSDPStrategyConfig},
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
