"""The fits compared in compare.py, run under whichever tree is first on sys.path (the code before the one engine,
889a9c8, or this one): approach 3 (two forms), Kaplan's law and approach 3's bootstrap refits, on the arrays
compare.py saved. Prints one JSON object of thetas and objectives."""

import importlib
import json
import os
import sys
from pathlib import Path

import numpy as np

import analysis
from analysis.parametric import fit_parametric, fit_weighted
from lab.measure.laws import CHINCHILLA, KAPLAN_E

tree = Path(analysis.__file__).parents[1]
if (tree / "analysis/robust.py").exists() and os.environ.get("OBJECTIVE_TOLERANCE"):  # compare.py --ftol
    importlib.import_module("analysis.robust").OBJECTIVE_TOLERANCE = float(os.environ["OBJECTIVE_TOLERANCE"])
# 889a9c8's analysis/laws.py is this tree's other_laws.py (an editable install would find this one's from the old tree)
fit_kaplan = importlib.import_module("analysis.other_laws" if (tree / "analysis/other_laws.py").exists()
                                     else "analysis.laws").fit_kaplan

data = np.load(sys.argv[1])
out = {}
for name in ("sweep", "chinchilla"):
    n, d, loss = data[f"{name}_n"], data[f"{name}_d"], data[f"{name}_loss"]
    for form in (CHINCHILLA, KAPLAN_E):
        fit = fit_parametric(n, d, loss, n_starts=8, form=form)
        out[f"{name}/approach3-{form.name}"] = {"theta": fit.theta.tolist(), "objective": fit.objective}
        thetas, _ = fit_weighted(data[f"{name}_{form.name}_theta0"], n, d, loss, data[f"{name}_weights"], form=form)
        out[f"{name}/bootstrap-{form.name}"] = {"thetas": thetas.tolist()}
    kaplan = fit_kaplan(n, d, loss, reference_rmse=0.0)
    out[f"{name}/kaplan"] = {"params": kaplan["params"], "objective": kaplan["objective"]}
loaded = [m.__file__ for name, m in sys.modules.items() if name.split(".")[0] in ("analysis", "lab")
          and getattr(m, "__file__", None)]
assert all(Path(f).is_relative_to(tree) for f in loaded), [f for f in loaded if not Path(f).is_relative_to(tree)]
json.dump(out, sys.stdout)
