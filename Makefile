# hydra-ddp: `make help` lists the targets.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCHRUN := $(VENV)/bin/torchrun
# Each target installs what it uses: `make train` the runtime dependencies alone, `make test` the test extras
# (pytest, selenium and both trackers), `make install EXTRAS=mlflow` a tracker's. One stamp per set of extras.
EXTRAS ?=
TRACKER_EXTRAS := mlflow,wandb
# make bench times both trackers, and Lightning (the bench extra)
BENCH_EXTRAS := $(TRACKER_EXTRAS),bench
installed = $(VENV)/.installed-$(or $(1),runtime)
# A few steps on synthetic data, for the smoke runs.
SMOKE := data=synthetic data.num_samples=256 data.num_val_samples=64 data.batch_size=16 trainer.max_epochs=1 trainer.limit_train_batches=5 trainer.log_every_n_steps=1
# The same for segmentation: small shapes images, 2 images per rank (where SyncBN matters).
SMOKE_SEG := task=segmentation data=shapes model=small_segnet data.num_samples=32 data.num_val_samples=8 data.image_size=32 data.batch_size=2 trainer.max_epochs=1 trainer.limit_train_batches=5 trainer.log_every_n_steps=1
# And for detection: the small FCOS on generated shapes, 2 images per rank, grouped by aspect ratio.
SMOKE_DET := task=detection model=detection model.name=small_fcos data=detection_shapes data.num_samples=32 data.num_val_samples=8 data.batch_size=2 data.aspect_ratio_groups=3 trainer.max_epochs=1 trainer.limit_train_batches=5 trainer.log_every_n_steps=1

# gloo re-initialises reliably after torchrun restarts only without torchrun's shared store (pytorch#135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE := 1
# Bytecode is written on first import (pip install --no-compile, below).
export PYTHONDONTWRITEBYTECODE :=

.DEFAULT_GOAL := help
.PHONY: help install train test smoke-test soak gpu-check sweep bench tensorboard mlflow-ui export verify slurm-up slurm-down

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

install: $(call installed,$(EXTRAS)) ## Create or update .venv with the pinned runtime dependencies (EXTRAS=mlflow, wandb or mlflow,wandb: a tracker's too)

# uv installs what pip would (from the package sources pip is configured with: scripts/pip_sources.py) in a third
# of its time, unpacking wheels on every core; where uv can't be installed or fails, pip installs. Neither compiles
# bytecode at the install (about 90 s for all of torch's): each module's is written when a run first imports it,
# so the targets write bytecode even where PYTHONDONTWRITEBYTECODE is set, or every process would compile torch's
# modules again. Any extras bring the runtime dependencies, and the test extras both trackers' and the bench's
# (pyproject.toml): their stamps too
UV_VERSION := 0.13.9
project = '.$(if $(filter-out runtime,$(1)),[$(1)])'
$(VENV)/.installed-%: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	{ $(PY) -m pip install --quiet uv==$(UV_VERSION) \
		&& $(VENV)/bin/uv pip install --quiet --python $(PY) --index-strategy unsafe-best-match $$($(PY) scripts/pip_sources.py) \
			-e $(call project,$*); } \
	|| { echo "uv could not install; pip installs instead"; $(PY) -m pip install --quiet --no-compile -e $(call project,$*); }
	touch $@ $(call installed) $(if $(filter test,$*),$(call installed,mlflow) $(call installed,wandb) $(call installed,$(TRACKER_EXTRAS)) $(call installed,$(BENCH_EXTRAS)))

train: $(call installed) ## Train the default run (small_cnn on digits, one device); prints the run dir and metrics
	$(PY) train.py

# What the suite needs outside .venv/ (a browser, a one-node SLURM), installed and started where missing, as root or
# through sudo without a password; without either it says what is missing, and those tests skip (docs/tests.md).
# TEST_SETUP= runs the suite without it.
TEST_SETUP ?= scripts/test-setup.sh
test: $(call installed,test) ## Set up a browser and a one-node SLURM where missing (root), then run the whole test suite (CPU, gloo, real torchrun processes), four test processes at a time
	$(TEST_SETUP)
	$(PY) -m pytest -q -n 4 --dist worksteal

smoke-test: $(call installed) ## Eight short CPU runs: single, dp, torchrun ddp with SyncBN, the bf16/accumulation/cosine/EMA/MixUp recipe, and segmentation, detection, distillation and SimCLR on 2 ranks with SyncBN
	$(PY) train.py strategy=single $(SMOKE)
	$(PY) train.py strategy=dp $(SMOKE)
	$(TORCHRUN) --nproc_per_node=2 train.py strategy=ddp syncbn=true $(SMOKE)
	$(TORCHRUN) --nproc_per_node=2 train.py strategy=ddp precision=bf16 trainer.accumulate_grad_batches=2 scheduler=cosine scheduler.warmup_steps=1 ema.decay=0.9 trainer.label_smoothing=0.1 data.mixup_alpha=0.2 $(SMOKE)
	$(TORCHRUN) --nproc_per_node=2 train.py strategy=ddp syncbn=true $(SMOKE_SEG)
	$(TORCHRUN) --nproc_per_node=2 train.py strategy=ddp syncbn=true $(SMOKE_DET)
	$(TORCHRUN) --nproc_per_node=2 train.py strategy=ddp syncbn=true task=distillation model@task.teacher_model=small_cnn task.teacher_model.channels=[32,64] $(SMOKE)
	$(TORCHRUN) --nproc_per_node=2 train.py strategy=ddp syncbn=true task=simclr data.views=2 data.augment=true $(SMOKE)

# make soak's settings: the seed that draws the faults, and how many (as many of each kind)
SOAK_SEED ?= 0
SOAK_FAULTS ?= 30
soak: $(call installed) ## A long seeded fault soak: a 2-rank torchrun run hit by SOAK_FAULTS faults of 5 kinds must end bit-identical to it left alone (SOAK_SEED=)
	$(PY) tests/soak.py --seed $(SOAK_SEED) --faults $(SOAK_FAULTS)

gpu-check: ## The CUDA paths in one short run on one GPU; without one it says so (any Python with torch: PY=python3)
	$(PY) tests/gpu/gpu_check.py

sweep: $(call installed) ## A batch-size sweep on CPU: 3 jobs of self-launched DDP on 2 processes; prints the summary
	$(PY) train.py -m strategy=ddp strategy.nproc_per_node=2 trainer.max_epochs=3 data.batch_size=16,32,64

bench: $(call installed,$(BENCH_EXTRAS)) ## train.py against a plain hand-written DDP loop and Lightning, side by side: table, ratios and plot in benchmarks/results/ (BENCH_QUICK=1: a tiny version)
	$(PY) benchmarks/bench.py

# logger=mlflow's local store (docs/tracking.md)
MLFLOW_STORE ?= outputs/mlflow.db
MLFLOW_PORT ?= 5000
mlflow-ui: $(call installed,mlflow) ## Serve the runs of logger=mlflow (outputs/mlflow.db) on http://127.0.0.1:5000
	$(VENV)/bin/mlflow ui --backend-store-uri sqlite:///$(abspath $(MLFLOW_STORE)) --host 127.0.0.1 --port $(MLFLOW_PORT) --workers 1

export: $(call installed) ## A sharded (strategy=fsdp) checkpoint as one plain state_dict: make export CKPT=<run dir>/checkpoints/step-N writes <dir>/model.pt
	$(PY) -m ddp.checkpoints.export $(CKPT)

verify: $(call installed) ## Check checkpoints against their digests: make verify CKPT=<run dir or checkpoint> names each good, corrupt or unverified (exit 1 if one is corrupt)
	$(PY) -m ddp.checkpoints.verify $(CKPT)

tensorboard: $(call installed) ## Serve outputs/ on http://127.0.0.1:6006
	$(VENV)/bin/tensorboard --logdir outputs --host 127.0.0.1 --port 6006

slurm-up: ## Start a one-node SLURM on this machine, to try the cluster path (root; scripts/slurm/local-cluster.sh install first)
	scripts/slurm/local-cluster.sh start

slurm-down: ## Stop the one-node SLURM
	scripts/slurm/local-cluster.sh stop
