"""The pieces of a training run on one device or many, one concern per module, grouped by concern
(docs/layout.md says why each module sits where it does):

- run_context: RunContext, what every stage of a run reads (built by train.py's `run`).
- config/: what a run may be asked to do: schema (the typed config, ConfigError), checks (the startup
  checks), builder_options (a model's, dataset's or task's options against its builder's signature).
- distributed/: where a process stands and how the processes work together: env, process_group,
  dtensor (helpers below fsdp and process_group), fsdp, syncbn, wrap.
- loading/: the data's way into a rank: samplers, loaders, loader_workers.
- training/: one update and the loop's measures: update, optimizer, ema, progress, evaluation,
  housekeeping (what the loop does besides updating).
- checkpoints/: what survives the process: checkpoint, sharded_checkpoint, checkpointer, resume, best,
  export (`python -m ddp.checkpoints.export`).
- reporting/: what the run tells: rank_zero, meter, monitor, results, sweep_summary.
- jobs/: the job around the run: launch, launch_agreement, run_dir, dir_lock, preemption, failures,
  faults.
"""
