"""Front ends that drive runs: the run's command line (``cli``), benchmarks, planning on paper, the
equivalence check, multi-node SLURM scripts and μP's coordinate check."""
