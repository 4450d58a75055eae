"""IsoFLOP sweeps: sweep files (``spec``), shapes from a target size (``shapes``), the planner (``plan``),
the SQLite registry (``registry``), executors (``executors.local``, ``executors.slurm``), the driver
(``driver``), the results table (``export``) and the command line (``cli``).

Runs are reached only through their command line (``launch/run.py``) and their run directory.
"""
