"""Scaling-law analysis: fits with uncertainty, compute-optimal predictions, plots, reports, planning.

``python -m analysis fit RESULTS --out DIR`` fits a table of runs (``table`` -> ``fit``, which runs
``parametric``, ``isoflop``, ``envelope`` and ``bootstrap``) and writes fit.json, ``plots`` and
``report``; ``python -m analysis plan FIT_JSON ...`` turns a fit into a run plan (``planner``).
"""
