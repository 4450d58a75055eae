"""The scaling lab: a GPT, parallelism strategies behind one interface, sweeps and scaling-law analysis."""

import os

# Read by torch's CPU allocator once, before torch is imported: blocks of 2 MiB or more ask for transparent huge
# pages, so that a tensor that lab.measure.memory has glibc return to the kernel costs few page faults to allocate
# again.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
