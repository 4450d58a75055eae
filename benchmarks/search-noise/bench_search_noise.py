"""How much the search's hyperparameter laws reduce the noise of IsoFLOP profiles, against fixed [rules].

Runs the default sweep's grid at its smallest budgets a second time with the file's ``[rules]`` instead
of the search's laws (``--folder`` beside the default sweep's), then measures, per budget, the noise of
each profile: the RMS residual of a parabola in log N through its final losses. Both sweeps must use
the same sizes, so the comparison is of the hyperparameters only.

    python benchmarks/search-noise/bench_search_noise.py                      # after `make sweep` (or `sweeps run`)
    python benchmarks/search-noise/bench_search_noise.py --budgets 3          # the 3 smallest budgets (default)
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from sweeps import export, spec  # noqa: E402
from sweeps.registry import Registry  # noqa: E402


def without_search(text: str, budgets: list[float]) -> str:
    """The sweep file's text without its [search] table and with only ``budgets``."""
    text = re.sub(r"^\[search\]\n(?:(?!\[).*\n)*", "", text, flags=re.M)
    return re.sub(r"^budgets = .*$", f"budgets = [{', '.join(f'{b:g}' for b in budgets)}]", text, count=1, flags=re.M)


def profile_noise(table: pd.DataFrame) -> pd.DataFrame:
    """Per budget: runs, the lowest loss, and the RMS residual of a parabola in log N through the losses."""
    rows = []
    for budget, group in table.groupby("budget"):
        x, y = np.log(group["params"].to_numpy(float)), group["loss"].to_numpy(float)
        residual = y - np.polyval(np.polyfit(x, y, 2), x)
        rows.append({"budget": budget, "runs": len(group), "lowest loss": y.min(),
                     "parabola RMS residual": float(np.sqrt(np.mean(residual ** 2)))})
    return pd.DataFrame(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--file", default=str(REPO / "sweeps" / "tiny_isoflop.toml"))
    p.add_argument("--budgets", type=int, default=3, help="the K smallest budgets")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "search-noise" / "README.md"))
    args = p.parse_args()
    sweep = spec.load(args.file)
    budgets = sorted(sweep.budgets)[:args.budgets]
    rules_file = sweep.folder.with_name(sweep.folder.name + "-rules.toml")
    rules_folder = sweep.folder.with_name(sweep.folder.name + "-rules")
    rules_file.parent.mkdir(parents=True, exist_ok=True)
    rules_file.write_text(without_search(Path(args.file).read_text(), budgets))
    subprocess.run([sys.executable, "-m", "sweeps", "run", str(rules_file), "--folder", str(rules_folder)],
                   cwd=REPO, check=True)
    tables = {}
    for label, folder in (("search laws", sweep.folder), ("fixed [rules]", rules_folder)):
        table = export.results(Registry.open(folder).rows())
        tables[label] = profile_noise(table[table["budget"].isin(budgets)])
    merged = tables["search laws"].merge(tables["fixed [rules]"], on="budget", suffixes=(" (search)", " (rules)"))
    lines = ["# IsoFLOP profile noise: the search's laws against fixed [rules]", "",
             f"Sweep file `{Path(args.file).relative_to(REPO)}`, its {len(budgets)} smallest budgets; noise = RMS "
             "residual of a parabola in log N through each budget's final losses.", "",
             "| " + " | ".join(merged.columns) + " |", "|" + "---:|" * len(merged.columns)]
    lines += ["| " + " | ".join(f"{v:.4g}" for v in row) + " |" for row in merged.itertuples(index=False)]
    lines.append("")
    ratio = merged["parabola RMS residual (search)"].mean() / merged["parabola RMS residual (rules)"].mean()
    lines.append(f"Mean noise with the search's laws / with fixed rules: {ratio:.2f}")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
