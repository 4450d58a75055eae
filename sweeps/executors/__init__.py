"""Executors run a sweep's attempts and report to the driver: ``local`` (torchrun processes on this
machine) and ``slurm`` (submitit job arrays, sbatch scripts for multi-node runs)."""
