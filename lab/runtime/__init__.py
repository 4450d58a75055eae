"""What every part stands on: the configuration, atomic files, checkpoints, and the one door to private torch
and DeepSpeed internals (``compat``)."""
