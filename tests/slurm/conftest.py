"""The SLURM tests' shared fixture: ``slurm``, one real cluster for the session (tests/slurm_cluster.py)."""
from slurm_cluster import slurm  # noqa: F401  (a fixture: pytest finds it here for every test in this folder)
