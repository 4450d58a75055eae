"""Executors run a sweep's attempts and report to the driver: ``local`` (processes on this machine,
through torchrun when a run has several) and ``slurm`` (submitit job arrays, sbatch scripts for multi-node runs)."""
