"""report.md and report.html of a fit, rendered from one list of blocks.

The HTML references the PNG figures beside it (and links their SVG versions), so the report
folder can be moved as a whole; it loads nothing else.
"""

from __future__ import annotations

import html
import math
from datetime import datetime, timezone

from analysis.plots import FIGURES

Block = tuple  # ("h", level, text) | ("p", text) | ("table", header, rows) | ("ul", items) | ("img", stem, caption)

_CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:0.8em 0;font-size:0.9em}th,td{border:1px solid #ccc;padding:3px 8px;
text-align:right}th{background:#f2f2f2}td:first-child,th:first-child{text-align:left}
figure{margin:1.5em 0}img{max-width:100%;border:1px solid #eee}figcaption{font-size:0.9em;color:#555}
code{background:#f4f4f4;padding:0 3px}.warn li{color:#8a4b00}"""


def fmt(x: float | None, digits: int = 4) -> str:
    """A number to ``digits`` significant figures; '-' for a missing value."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{digits}g}"


def _with_ci(value: float | None, ci: list | None) -> str:
    return fmt(value) + (f" [{fmt(ci[0])}, {fmt(ci[1])}]" if ci else "")


def _ci(section: dict | None, key: str) -> list | None:
    return ((section or {}).get("ci") or {}).get(key)


def _fits_table(doc: dict) -> Block:
    a3, iso, env = doc["approach3"], doc["isoflop"], doc["envelope"]
    columns = [("Approach 1: envelope", None if env["skipped"] else env),
               ("Approach 2: IsoFLOP, parabola vertex", iso["fits"]["vertex"]),
               ("Approach 2: IsoFLOP, lowest run", iso["fits"]["lowest"]),
               ("Approach 3: parametric", a3)]
    keys = [("a (N_opt ~ C^a)", "a"), ("b (D_opt ~ C^b)", "b"), ("k_N", "k_N"), ("k_D", "k_D"),
            ("E", "E"), ("A", "A"), ("B", "B"), ("alpha", "alpha"), ("beta", "beta")]
    rows = [[label] + [_with_ci(col.get(key), _ci(col, key)) if col and key in col else "-" for _, col in columns]
            for label, key in keys]
    return ("table", ["quantity"] + [name for name, _ in columns], rows)


def build_blocks(doc: dict, title: str = "Scaling-law fit") -> list[Block]:
    """The report, top to bottom, from a fit.json document."""
    data, a3, iso, hold = doc["data"], doc["approach3"], doc["isoflop"], doc["holdout"]
    cfg, warnings = doc["config"], doc["warnings"]
    boot = a3.get("bootstrap")
    level = f"{cfg['ci_level']:.0%}"
    blocks: list[Block] = [
        ("h", 1, title),
        ("p", f"Generated {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC from {data['n_runs']} runs in "
              f"`{doc['source']}`. Parameter count N: {doc['params_count']}. Loss: {doc['loss_source']}. "
              "Intervals in brackets are "
              + (f"{level} bootstrap percentile intervals over {boot['resamples']} resamples of the runs "
                 f"(seed {boot['seed']})." if boot else "absent (bootstrap disabled).")
              + (f" {len(warnings)} warning(s): see the end of the report." if warnings else " No warnings.")),
        ("h", 2, "Data"),
        ("table", ["", "min", "max"],
         [[name, fmt(data[key][0]), fmt(data[key][1])] for name, key in
          (("parameters N", "params"), ("tokens D", "tokens"), ("compute C (FLOPs)", "flops"),
           ("loss", "loss"), ("tokens per parameter", "tokens_per_param"))]),
        ("p", f"{len(data['budgets'])} compute budget(s) after grouping C within {cfg['budget_tol']:.0%}; "
              f"{data['n_curves']} training curve(s)"
              + (f" ({data['curve_loss']} loss)." if data["curve_loss"] else ".")
              + ("" if not doc["notes"] else " " + "; ".join(doc["notes"]) + ".")),
        ("table", ["budget C", "runs", "N range", "lowest-run N", "vertex N", "edge minimum",
                   f"used ({iso['minimum']})"],
         [[fmt(m["flops"]), str(m["n_runs"]), f"{fmt(m['params_range'][0])} - {fmt(m['params_range'][1])}",
           fmt(m["lowest"]["params"]), fmt((m["vertex"] or {}).get("params")), "yes" if m["edge"] else "no",
           "yes" if m["used"][iso["minimum"]] else "no"] for m in iso["minima"]]),
        ("h", 2, "Fits"),
        ("p", "N_opt = k_N C^a and D_opt = k_D C^b for every approach; approach 3 fits "
              "L(N, D) = E + A/N^alpha + B/D^beta and derives a = beta/(alpha+beta), b = alpha/(alpha+beta)."
              + (f" IsoFLOP skipped: {iso['reason']}." if iso["skipped"] else "")
              + ("" if not doc["envelope"]["skipped"] else f" Envelope skipped: {doc['envelope']['reason']}.")),
        _fits_table(doc),
    ]
    fit = a3["fit"]
    start = ", ".join(f"{k}={fmt(v)}" for k, v in fit["best_start"].items())
    blocks.append(("p", f"Approach 3 optimiser: {fit['method']}. Objective {fmt(fit['objective'], 6)}, "
                        f"{'converged' if fit['converged'] else 'NOT converged'} after {fit['iterations']} "
                        f"iterations ({fit['message']}); {fit['starts_agreeing']} of {fit['n_starts']} starts "
                        f"reached the best objective. Best start: {start}"
                        f" ({'on the edge of' if fit['best_start_on_grid_edge'] else 'inside'} the grid); "
                        "the optimum is "
                        f"{'inside' if fit['optimum_inside_grid'] else 'outside'} the grid."
                        + (f" Bootstrap refits: {boot['converged']} of {boot['resamples']} converged, "
                           f"{boot['refit']}." if boot else "")))
    blocks += [("h", 2, "Hold-out check")] + _holdout_blocks(hold)
    blocks += [("h", 2, "Predictions"), _predictions_table(doc)]
    blocks += [("h", 2, "Plots")] + [("img", stem, caption) for stem, caption in FIGURES]
    blocks += [("h", 2, "Warnings"),
               ("ul", [f"[{w['code']}] {w['message']}" for w in warnings]) if warnings else ("p", "None.")]
    blocks += [("h", 2, "Method"), ("p", _METHOD)]
    return blocks


_METHOD = (
    "Approach 3 minimises the summed Huber loss (delta = 1e-3) of log-space residuals, "
    "LSE(a - alpha log N, b - beta log D, e) - log L, as in Hoffmann et al. (2022), appendix D. "
    "The objective is evaluated on the paper's whole 4,500-point grid of starts at once; L-BFGS "
    "(analytic gradient, log N and log D centred) runs from the best few grid points and the best "
    "result is kept. Each bootstrap resample draws the runs with replacement and refits every "
    "approach; approach 3 refits run one L-BFGS from the full-data optimum (optionally over a "
    "process pool), and the IsoFLOP and envelope refits are vectorised over resamples. IsoFLOP "
    "budgets group runs whose C agree within the tolerance; a budget's minimum is the lowest run or "
    "the vertex of a parabola of loss in log N, and minima at the edge of the sampled N range are "
    "excluded unless asked for. The envelope takes, at each FLOP count, the run whose training "
    "curve is lowest. The hold-out check refits on all budgets but the largest and predicts that "
    "budget's losses.")


def _holdout_blocks(hold: dict) -> list[Block]:
    if hold.get("skipped"):
        return [("p", f"Skipped: {hold['reason']}.")]
    a3 = hold["approach3"]
    rows = [["approach 3: loss of the held-out runs", f"mean abs {fmt(a3['mean_abs_error'])}",
             f"mean rel {a3['mean_rel_error']:.2%}", f"max rel {a3['max_rel_error']:.2%}"]]
    if hold["isoflop"]:
        iso = hold["isoflop"]
        rows.append(["IsoFLOP: N_opt at the held-out budget", f"predicted {fmt(iso['params_opt_predicted'])}",
                     f"observed {fmt(iso['params_opt_observed'])}", f"rel error {iso['rel_error']:.2%}"])
        rows.append(["approach 3: N_opt at the held-out budget", f"predicted {fmt(a3['params_opt_predicted'])}",
                     f"observed {fmt(iso['params_opt_observed'])}", f"rel error {a3['params_opt_rel_error']:.2%}"])
    return [("p", f"Fitted on {hold['n_train']} runs below the largest budget (C = {fmt(hold['budget_flops'])}), "
                  f"then predicted its {hold['n_holdout']} runs."),
            ("table", ["check", "", "", ""], rows)]


def _predictions_table(doc: dict) -> Block:
    rows = []
    for p in doc["predictions"]:
        ci = p["ci"] or {}
        iso, env = p.get("isoflop"), p.get("envelope")
        rows.append([fmt(p["flops"]), f"{fmt(p['extrapolation'], 3)}x", _with_ci(p["params"], ci.get("params")),
                     _with_ci(p["tokens"], ci.get("tokens")),
                     _with_ci(p["tokens_per_param"], ci.get("tokens_per_param")), _with_ci(p["loss"], ci.get("loss")),
                     _with_ci(iso["params"], (iso["ci"] or {}).get("params")) if iso else "-",
                     _with_ci(env["params"], (env["ci"] or {}).get("params")) if env else "-"])
    return ("table", ["C (FLOPs)", "C / data max", "N_opt (approach 3)", "D_opt", "D/N", "loss",
                      "N_opt (IsoFLOP)", "N_opt (envelope)"], rows)


def render_markdown(blocks: list[Block]) -> str:
    """Blocks as GitHub-flavoured Markdown."""
    out = []
    for block in blocks:
        kind = block[0]
        if kind == "h":
            out.append("#" * block[1] + " " + block[2])
        elif kind == "p":
            out.append(block[1])
        elif kind == "ul":
            out.append("\n".join(f"- {item}" for item in block[1]))
        elif kind == "table":
            cells = [block[1]] + block[2]
            lines = ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in cells]
            lines.insert(1, "|" + "---|" * len(block[1]))
            out.append("\n".join(lines))
        elif kind == "img":
            out.append(f"![{block[2]}]({block[1]}.png)\n\n*{block[2]}* ([SVG]({block[1]}.svg))")
    return "\n\n".join(out) + "\n"


def _inline(text: str) -> str:
    """Escape text for HTML, turning `code` spans into <code>."""
    parts = html.escape(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))


def render_html(blocks: list[Block]) -> str:
    """Blocks as one HTML page with inline CSS."""
    title = next(b[2] for b in blocks if b[0] == "h")
    body = []
    for block in blocks:
        kind = block[0]
        if kind == "h":
            body.append(f"<h{block[1]}>{_inline(block[2])}</h{block[1]}>")
        elif kind == "p":
            body.append(f"<p>{_inline(block[1])}</p>")
        elif kind == "ul":
            body.append('<ul class="warn">' + "".join(f"<li>{_inline(i)}</li>" for i in block[1]) + "</ul>")
        elif kind == "table":
            head = "".join(f"<th>{_inline(str(h))}</th>" for h in block[1])
            rows = "".join("<tr>" + "".join(f"<td>{_inline(str(c))}</td>" for c in row) + "</tr>" for row in block[2])
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        elif kind == "img":
            stem, caption = block[1], html.escape(block[2])
            body.append(f'<figure><img src="{stem}.png" alt="{caption}"><figcaption>{caption} '
                        f'(<a href="{stem}.svg">SVG</a>)</figcaption></figure>')
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><link rel=\"icon\" href=\"data:,\">"
            f"<style>{_CSS}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n")
