"""Cooldown branches against separate runs at the same end points (issue 34, ``benchmarks/cooldowns/README.md``).

Run the two sweeps first (the same end points; the second with ``[sweep] cooldowns``), then compare:

    python -m sweeps run benchmarks/cooldowns/cooldowns-separate.toml --folder runs/bench/separate
    python -m sweeps run benchmarks/cooldowns/cooldowns-branched.toml --folder runs/bench/branched
    python benchmarks/cooldowns/bench_cooldowns.py runs/bench/separate runs/bench/branched [--reference SWEEP]

It prints, per end point, N, D, C and the final eval loss of the separate run and of the branch (and of a
``--reference`` sweep's run of that name, e.g. the default sweep's cosine runs), then the FLOPs each side spent
(the separate runs of those end points; the parents' stable phases and the branches' cooldowns), from the runs' own
summaries. The separate folder may be any sweep with runs of the same names (the default sweep itself, cosine).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sweeps.registry import Registry


def finished(folder: Path) -> dict[str, dict]:
    """Run name → summary plus plan figures, for the done runs of a sweep folder."""
    return {r.name: {**r.summary, "role": r.plan.role, "branch_step": r.plan.branch_step,
                     "batch_tokens": r.plan.batch_tokens}
            for r in Registry.open(folder).rows() if r.status == "done"}


def spent(runs: dict[str, dict]) -> float:
    """FLOPs the sweep's runs trained: a branch's from its branch step on, a parent's all."""
    return sum(s["flops"] - s["branch_step"] * s["batch_tokens"] * s["flops_per_token"] for s in runs.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("separate", type=Path)
    p.add_argument("branched", type=Path)
    p.add_argument("--reference", type=Path, help="a third sweep folder whose runs of the same names are shown")
    args = p.parse_args()
    separate, branched = finished(args.separate), finished(args.branched)
    reference = finished(args.reference) if args.reference else {}
    ends = [n for n, s in branched.items() if s["role"] == "sweep" and n in separate]
    print(f"| end point | N | D | C | separate | branch | branch − separate |"
          f"{' reference |' if reference else ''}")
    print(f"|---|---:|---:|---:|---:|---:|---:|{'---:|' if reference else ''}")
    diffs = []
    for name in sorted(ends, key=lambda n: (branched[n]["flops"], branched[n]["params"])):
        s, b = separate[name], branched[name]
        assert (s["params"], s["tokens"]) == (b["params"], b["tokens"]), name
        diff = b["final_eval_loss"] - s["final_eval_loss"]
        how = f"{diff:+.4f}" + ("" if b["branch_step"] else " (no branch: one end point)")
        if b["branch_step"]:
            diffs.append(diff)
        ref = reference.get(name, {}).get("final_eval_loss")
        print(f"| {name} | {b['params']:,} | {b['tokens']:,} | {b['flops']:.3g} | {s['final_eval_loss']:.4f} | "
              f"{b['final_eval_loss']:.4f} | {how} |" + (f" {ref:.4f} |" if reference and ref else
                                                         (" |" if reference else "")))
    if diffs:
        mean = sum(diffs) / len(diffs)
        print(f"\nbranches: {len(diffs)}, loss difference branch − separate: mean {mean:+.4f}, "
              f"min {min(diffs):+.4f}, max {max(diffs):+.4f}")
    for label, runs in (("separate", {n: separate[n] for n in ends}), ("branched", branched)):
        print(f"{label}: {len(runs)} runs, {spent(runs):.4g} FLOPs trained")


if __name__ == "__main__":
    main()
