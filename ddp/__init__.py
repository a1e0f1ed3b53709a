"""The pieces of a training run on one device or many, one concern per module, grouped into folders
that are layers: each imports only the ones below it (docs/layout.md; pyproject.toml's import-linter
contracts hold it). Bottom to top:

- config/: what a run may be asked to do: schema (the typed config, ConfigError), checks (the startup
  checks of its values), builder_options (a model's, dataset's or task's options against its builder's signature).
- distributed/: where a process stands and how the processes work together: env, process_group,
  dtensor (helpers below fsdp and process_group), fsdp, syncbn.
- loading/: the data's way into a rank: samplers, loaders, loader_workers, batches, collate, sample_seeds;
  beside it run_context: RunContext, what every stage above reads (built by train.py's `run`).
- training/: one update and the loop's measures: wrap, update, optimizer, ema, frozen, progress,
  evaluation, faults (testing aids).
- checkpoints/: what survives the process: checkpoint, sharded_checkpoint, checkpointer, resume, best,
  export (`python -m ddp.checkpoints.export`); beside it reporting/: what the run tells: rank_zero,
  trackers and their checks, meter, monitor, profiling, results.
- jobs/: the job around the run: launch, launch_agreement, run_dir, dir_lock, preemption, housekeeping
  (what the loop does besides updating), failures, sweep_summary.
"""
