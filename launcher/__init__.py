"""The `accum-sched` command: configs, launch (torchrun, SLURM), the per-rank worker, outputs.

Nothing here imports torch at module level: `accum-sched check` and SLURM rendering run on login nodes.
"""
