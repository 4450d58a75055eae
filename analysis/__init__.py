"""Scaling-law analysis: fits with uncertainty, compute-optimal predictions, plots, reports, planning.

``python -m analysis fit RESULTS --out DIR`` checks a table of runs (``table``), groups it into
compute budgets (``budgets``) and fits it (``fit``, which runs ``parametric``, ``isoflop``,
``envelope`` and ``bootstrap``, judges each law with ``identify`` and sets them side by side with
``compare``), then writes fit.json, ``plots`` and ``report`` (with ``published`` laws for
reference); ``python -m analysis plan FIT_JSON ...`` turns an identified law into a run plan
(``planner``).
"""
