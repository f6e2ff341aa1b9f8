"""How workers are started: torchrun argv (torchrun.py) and SLURM batch scripts (slurm.py)."""
