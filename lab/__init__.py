"""The scaling lab: a GPT, parallelism strategies behind one interface, sweeps and scaling-law analysis."""

import os

# Read by torch's CPU allocator once, before torch is imported: blocks of 2 MiB or more ask for transparent huge
# pages, so that a tensor that lab.measure.memory has glibc return to the kernel costs few page faults to allocate
# again.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
# Read by OpenMP once, when torch loads it: threads that wait for work sleep instead of spinning. On a machine
# whose cores other processes share (two runs side by side, a sweep beside a job), spinning threads take the cores
# the working ones need: benchmarks/threads/README.md measured two runs side by side at 1.94x one alone's step time with
# spinning threads and 1.00x without.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
