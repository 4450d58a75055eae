"""report.md and report.html of a fit, rendered from one list of blocks built from fit.json.

The HTML is one self-contained file: the figures are embedded as base64 PNG and the styles are
inline, so it can be mailed or attached on its own. The Markdown links the PNG files beside it.
"""

from __future__ import annotations

import base64
import html
import math
from datetime import datetime, timezone

from analysis.compare import APPROACHES, TITLES, disagreement_note
from analysis.forms import forms_cells
from lab.measure.laws import FORMS
from analysis.identify import MAX_A_WIDTH, MAX_CONDITION
from analysis.plots import CURVES_FIGURE, DOWNSTREAM_FIGURE, FIGURES
from analysis.published import BESIROGLU, HOFFMANN, KAPLAN, LAWS, MUENNIGHOFF, TABLE3, comparable, listed_note
from analysis.synthetic import law_optimum

# Warnings repeated in the alert box at the top of the report: they change how every number below is read.
LOUD_WARNINGS = ("noiseless", "outliers")
Block = tuple  # ("h", level, text) | ("p", text) | ("ul", items) | ("warn", items) | ("alert", items)
#                | ("table", header, rows) | ("img", stem, caption)

_CSS = """body{font-family:system-ui,sans-serif;max-width:1150px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:0.8em 0;font-size:0.85em}th,td{border:1px solid #ccc;padding:3px 7px;
text-align:left;vertical-align:top}th{background:#f2f2f2}
figure{margin:1.5em 0}img{max-width:100%;border:1px solid #eee}figcaption{font-size:0.9em;color:#555}
code{background:#f4f4f4;padding:0 3px}ul.warn li{color:#8a4b00}
.alert{border:2px solid #b00;background:#fff0f0;padding:0.4em 1em;margin:1em 0}.alert li{color:#900;font-weight:600}"""


def fmt(x: float | None, digits: int = 4) -> str:
    """A number to ``digits`` significant figures; '-' for a missing value."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{digits}g}"


def _with_ci(value: float | None, ci: list | None, digits: int = 4) -> str:
    return fmt(value, digits) + (f" [{fmt(ci[0], digits)}, {fmt(ci[1], digits)}]" if ci else "")


def _ci(section: dict | None, key: str) -> list | None:
    return ((section or {}).get("ci") or {}).get(key)


def _identified(section: dict) -> bool:
    return bool((section.get("identification") or {}).get("identified"))


def _status(section: dict) -> str:
    if section.get("skipped"):
        return "not run"
    return "yes" if _identified(section) else "NO"


def build_blocks(doc: dict, title: str = "Scaling-law fit") -> list[Block]:
    """The report, top to bottom, from a fit.json document."""
    data, a3, cfg = doc["data"], doc["approach3"], doc["config"]
    boot = a3.get("bootstrap")
    level = f"{cfg['ci_level']:.0%}"
    blocks: list[Block] = [
        ("h", 1, title),
        ("p", f"Generated {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC from {data['n_runs']} runs in "
              f"`{doc['source']}`. Intervals in brackets are "
              + (f"{level} bootstrap percentile intervals over {boot['resamples']} resamples of the runs "
                 f"(seed {boot['seed']}); every approach is refitted on the same resamples."
                 if boot else "absent: the bootstrap was disabled, so no law can be checked for spread.")),
    ]
    blocks += _verdict(doc)
    blocks += [("h", 2, "What was fitted"), ("ul", _fitted(doc))]
    dataset = data.get("dataset")
    listed = [law for law in LAWS if not comparable(law, dataset)]
    blocks += [("h", 2, "Results"), _table3(doc),
               ("p", "In the style of Hoffmann et al. (2022), Table 3: N_opt ∝ C^a and D_opt ∝ C^b per approach, "
                     "with N_opt and D_opt at the prediction budgets. Published rows are as printed in the cited "
                     "papers; for the published laws a and b follow from their alpha and beta, and N_opt, D_opt "
                     "from the law with C = 6ND, shown only for runs on the law's data set. "
                     + (listed_note(listed, dataset) if listed else "")),
               published_laws_table(),
               ("p", "Published parametric laws L(N, D) = E + A/N^alpha + B/D^beta as printed in the cited papers "
                     "(the data-constrained law adds R_D* and R_N*, the decay constants of repeated tokens and excess "
                     "parameters); E, A and B are in nats per token on each paper's own data and tokenizer.")]
    blocks += [("h", 2, "Identification"),
               ("p", "An approach is used only when every check passes (thresholds in analysis/identify.py: "
                     f"interval of a at most {MAX_A_WIDTH:g} wide, alpha and beta in (0, 2), condition number of "
                     f"J^T J at most {MAX_CONDITION:g}, at least 3 budgets or envelope sizes)."),
               _identification_table(doc)]
    blocks += [("h", 2, "Approach 3: parameters, goodness of fit, covariance")] + _approach3_blocks(a3, level)
    blocks += [("h", 2, "Every form side by side")] + _forms_blocks(a3)
    blocks += [("h", 2, "Outliers and dropped runs")] + _outlier_blocks(doc)
    blocks += [("h", 2, "Sensitivity to the Huber delta")] + _delta_blocks(doc)
    if doc["law"]:
        blocks += [("h", 2, f"Another form: the {doc['law']['form']} law")] + _law_blocks(doc["law"])
    blocks += [("h", 2, "Approaches compared: predictions")] + _predictions_blocks(doc)
    if doc.get("downstream"):
        blocks += [("h", 2, "Downstream tasks")] + _downstream_blocks(doc["downstream"])
    blocks += [("h", 2, "Data")] + _data_blocks(doc)
    blocks += [("h", 2, "Hold-out check")] + _holdout_blocks(doc["holdout"])
    figures = FIGURES + ((CURVES_FIGURE,) if data["n_curves"] else ()) + \
        ((DOWNSTREAM_FIGURE,) if any(not d["skipped"] for d in doc.get("downstream") or []) else ())
    blocks += [("h", 2, "Figures")] + [("img", stem, caption) for stem, caption in figures]
    warnings = doc["warnings"]
    blocks += [("h", 2, "Warnings"),
               ("warn", [f"[{w['code']}] {w['message']}" for w in warnings]) if warnings else ("p", "None.")]
    if doc.get("design_notes"):
        blocks += [("h", 3, "What the design cannot identify"), ("ul", doc["design_notes"])]
    blocks += [("h", 2, "Method"), ("p", _METHOD), ("h", 2, "References"),
               ("ul", [HOFFMANN + ". Approaches 1-3, Table 3, appendix D.", BESIROGLU + ".", KAPLAN + ".",
                       MUENNIGHOFF + "."])]
    return blocks


def _verdict(doc: dict) -> list[Block]:
    comp = doc["comparison"]
    loud = [f"{TITLES[k]} is NOT identified: {'; '.join(doc[k]['identification']['reasons'])}"
            for k in APPROACHES if not doc[k].get("skipped") and not _identified(doc[k])
            and not doc[k]["identification"].get("by_design")]
    loud += [f"Approaches disagree: {x['message']}" for x in comp["disagreements"]]
    loud += [w["message"] for w in doc["warnings"] if w["code"] in LOUD_WARNINGS]
    if comp["preferred"] is None:
        return [("alert", [f"No approach gives an identified law, so `python -m analysis plan` refuses to plan "
                           f"from this fit: {comp['why']}."] + loud)]
    used = ("p", f"**Law used for planning: {TITLES[comp['preferred']]}**, because {comp['why']}"
                 f"{disagreement_note(comp['preferred'], comp['disagreements'])}.")
    return [used] + ([("alert", loud)] if loud else [])


def _fitted(doc: dict) -> list[str]:
    data, a3, loss = doc["data"], doc["approach3"], doc["loss"]
    k = data["flops_per_param_token"]
    budgets = data["budgets"]
    return [
        f"Loss: {loss['source']}, in {loss['unit']} ({loss['note']}).",
        f"N: {doc['params_count']} parameter count" + ("; " + "; ".join(doc["notes"]) if doc["notes"] else "") + ".",
        "C: " + ("6ND (no FLOPs column)" if k["derived"] else
                  f"the FLOPs column, which follows C = {k['k']:.4g} N D (median over the runs)")
        + f"; compute-optimal allocations are taken along C = {a3['fit']['flops_k']:.4g} N D.",
        f"Approach 3: {a3.get('formula', 'L = E + A/N^alpha + B/D^beta')} ({a3.get('form', 'chinchilla')} form"
        + (f", chosen by the hold-out: {a3['form_choice']['why']}" if a3.get("form_choice") else "") + "), "
        + a3["fit"]["method"] + ".",
        f"Approach 2: {budgets['mode']} budgets within {budgets['tolerance']:.0%} of C; per budget the "
        f"{doc['isoflop']['minimum']} minimum (parabola in log N fitted in a window around the lowest run); "
        "N_opt = k_N C^a, D_opt = k_D C^b.",
        "Approach 1: " + (doc["envelope"]["source"] if not doc["envelope"]["skipped"]
                          else f"not run ({doc['envelope']['reason']})") + ".",
    ]


def _table3(doc: dict) -> Block:
    preds = doc["predictions"]
    header = ["approach", "identified", "a (N_opt ∝ C^a)", "b (D_opt ∝ C^b)"]
    for p in preds:
        header += [f"N_opt at C = {fmt(p['flops'], 3)}", f"D_opt at C = {fmt(p['flops'], 3)}"]
    rows = []
    for key in APPROACHES:
        section = doc[key]
        row = [TITLES[key], _status(section), _with_ci(section.get("a"), _ci(section, "a"), 3),
               _with_ci(section.get("b"), _ci(section, "b"), 3)]
        for p in preds:
            entry = p.get(key)
            row += ([_with_ci(entry["params"], (entry["ci"] or {}).get("params"), 3),
                     _with_ci(entry["tokens"], (entry["ci"] or {}).get("tokens"), 3)] if entry else ["-", "-"])
        rows.append(row)
    for name, a, a_ci, b, b_ci in TABLE3:
        rows.append([f"published: {name}", "", _with_ci(a, list(a_ci) if a_ci else None, 3),
                     _with_ci(b, list(b_ci) if b_ci else None, 3)] + ["-", "-"] * len(preds))
    for law in LAWS:
        row = [f"published law: {law.name}", "", fmt(law.a, 3), fmt(1 - law.a, 3)]
        for p in preds:
            n, d = (float(v[0]) for v in law_optimum([p["flops"]], law.as_dict()))
            row += [fmt(n, 3), fmt(d, 3)] if comparable(law, doc["data"].get("dataset")) else ["-", "-"]
        rows.append(row)
    return ("table", header, rows)


def published_laws_table() -> Block:
    """E, A, B, alpha, beta (and R_D*, R_N* where published) of every published law."""
    rows = [[law.name, law.dataset, fmt(law.E), fmt(law.A), fmt(law.B), fmt(law.alpha), fmt(law.beta),
             fmt(law.r_d_star), fmt(law.r_n_star), law.citation] for law in LAWS]
    return ("table", ["published law", "data", "E", "A", "B", "alpha", "beta", "R_D*", "R_N*", "source"], rows)


def _outlier_blocks(doc: dict) -> list[Block]:
    found, dropped = doc["outliers"], doc["dropped"]
    blocks: list[Block] = []
    if found.get("runs"):
        blocks += [("p", f"{len(found['runs'])} run(s) lie more than {found['threshold_z']:g} robust standard "
                         f"deviations (1.4826 x MAD of the log-loss residuals, here {fmt(found['robust_scale'], 3)}) "
                         "from approach 3's law; they are still fitted. Leave them out with `--exclude RUN_ID` or "
                         "`--drop-highest-loss K`."),
                   ("table", ["run", "N", "D", "loss", "predicted", "residual (nats)", "robust z"],
                    [[o["run_id"], fmt(o["params"]), fmt(o["tokens"]), fmt(o["loss"]), fmt(o["predicted"]),
                      fmt(o["residual"], 3), f"{o['z']:+.1f}"] for o in found["runs"]])]
    else:
        blocks.append(("p", f"No run lies more than {found.get('threshold_z', 0):g} robust standard deviations from "
                            "approach 3's law."))
    if dropped:
        blocks += [("p", f"{len(dropped)} run(s) were left out before fitting:"),
                   ("table", ["run", "N", "D", "loss", "why"],
                    [[d["run_id"], fmt(d["params"]), fmt(d["tokens"]), fmt(d["loss"]), f"`{d['reason']}`"]
                     for d in dropped])]
    else:
        blocks.append(("p", "No run was left out (`--exclude`, `--drop-highest-loss`)."))
    return blocks


def _law_blocks(law: dict) -> list[Block]:
    source = KAPLAN if law["form"] == "kaplan" else MUENNIGHOFF
    return [("p", f"Fitted beside approach 3 with `--law {law['form']}` ({source}), by the same Huber loss "
                  f"(delta = {law['huber_delta']:g}) of log-space residuals; no bootstrap, so no intervals. "
                  f"RMSE of log loss {fmt(law['rmse_log_loss'], 3)}, against {fmt(law['approach3_rmse_log_loss'], 3)} "
                  f"for approach 3; N_opt ∝ C^a with a = {fmt(law['a'])}."
                  + ("" if law["converged"] else " **The fit did not converge.**")),
            ("table", list(law["params"]), [[fmt(v) for v in law["params"].values()]])]


def _delta_blocks(doc: dict) -> list[Block]:
    rows = doc["delta_sensitivity"]
    names = [*FORMS[doc["approach3"].get("form", "chinchilla")].names, "a"]
    if not rows:
        return [("p", "Not computed.")]
    return [("p", "Approach 3 refitted at each Huber delta (from the fitted optimum; the fitted delta in bold). "
                  "A delta far above the residuals makes the loss least squares; far below, it approaches least "
                  "absolute deviations, which outliers move least."),
            ("table", ["delta", *names, "converged"],
             [[f"**{r['huber_delta']:g}**" if r["fitted"] else f"{r['huber_delta']:g}"]
              + [fmt(r[k]) for k in names] + ["yes" if r["converged"] else "NO"] for r in rows])]


def _identification_table(doc: dict) -> Block:
    rows = []
    for key in APPROACHES:
        for check in doc[key]["identification"]["checks"]:
            rows.append([TITLES[key], check["name"], "pass" if check["passed"] else "FAIL", check["detail"]])
    return ("table", ["approach", "check", "", "detail"], rows)


def _approach3_blocks(a3: dict, level: str) -> list[Block]:
    names = [*FORMS[a3.get("form", "chinchilla")].names, "a", "b", "G"]
    fit, good = a3["fit"], a3["goodness"]
    blocks: list[Block] = [
        ("table", ["parameter", f"value [{level} interval]"], [[n, _with_ci(a3.get(n), _ci(a3, n))] for n in names]),
        ("p", f"Goodness of fit over {good['n_runs']} runs: RMSE {fmt(good['rmse_loss'])} nats per token in loss "
              f"({fmt(good['rmse_log_loss'])} in log loss), largest residual {fmt(good['max_abs_residual'])} nats, "
              f"Huber objective (delta = {fit['huber_delta']:g}, summed over runs) {fmt(good['huber_objective'], 6)}. "
              f"Optimiser: {'converged' if fit['converged'] else 'NOT converged'} after {fit['evaluations']} "
              f"evaluations ({fit['message']}); {fit['starts_agreeing']} of {fit['n_starts']} starts reached the best "
              f"objective; the optimum lies {'inside' if fit['optimum_inside_grid'] else 'OUTSIDE'} the grid of "
              f"starts; condition number of J^T J {fmt(fit['condition_number'], 3)}."),
    ]
    cov = a3.get("covariance")
    if cov is None:
        blocks.append(("p", "Parameter covariance: not available (bootstrap disabled or too few refits)."))
    else:
        rows = [[name, fmt(cov["std"][i], 3)] + [fmt(v, 3) for v in cov["correlation"][i]]
                for i, name in enumerate(cov["names"])]
        blocks += [("p", "Parameter covariance from the bootstrap refits, as standard deviations and correlations "
                         f"(theta = {', '.join(cov['names'])}; a constant trades off against its exponent):"),
                   ("table", ["", "std"] + cov["names"], rows)]
    return blocks


def _predictions_blocks(doc: dict) -> list[Block]:
    rows = []
    for p in doc["predictions"]:
        for key in APPROACHES:
            entry = p.get(key)
            if entry is None:
                continue
            ci = entry["ci"] or {}
            rows.append([fmt(p["flops"]), f"{fmt(p['extrapolation'], 3)}x", TITLES[key],
                         "yes" if entry["identified"] else "NO",
                         _with_ci(entry["params"], ci.get("params")), _with_ci(entry["tokens"], ci.get("tokens")),
                         fmt(entry["tokens"] / entry["params"], 3),
                         _with_ci(entry.get("loss"), ci.get("loss")) if key == "approach3" else "-"])
    comp = doc["comparison"]
    note = (f"`plan` uses {TITLES[comp['preferred']]}: {comp['why']}." if comp["preferred"]
            else "`plan` refuses: no approach is identified.")
    identified = [key for key in APPROACHES if ((doc.get(key) or {}).get("identification") or {}).get("identified")]
    if comp["disagreements"]:
        agree = "Identified approaches DISAGREE: " + " ".join(x["message"] + "." for x in comp["disagreements"])
    elif len(identified) < 2:
        agree = "Fewer than two approaches are identified: their agreement was not checked."
    elif not doc["config"]["n_bootstrap"]:
        agree = "Without a bootstrap the identified approaches' agreement was not checked."
    else:
        agree = "Identified approaches agree within their paired bootstrap intervals at every budget."
    return [("table", ["C (FLOPs)", "C / data max", "approach", "identified", "N_opt", "D_opt", "D/N",
                       "loss (nats)"], rows), ("p", note + " " + agree)]


def _downstream_blocks(tasks: list[dict]) -> list[Block]:
    rows, skipped = [], []
    for d in tasks:
        if d["skipped"]:
            skipped.append(f"{d['task']}: {d['reason']}")
            continue
        ci = d["ci"]
        link = (f"{_with_ci(d['eps'], ci['eps'], 3)} − {_with_ci(d['k'], ci['k'], 3)}·exp(−"
                f"{_with_ci(d['gamma'], ci['gamma'], 3)}·L)")
        for p in d["predictions"]:
            rows.append([d["task"], str(d["runs"]), link, fmt(d["rmse"], 3), fmt(p["flops"]), fmt(p["loss"]),
                         _with_ci(p["score"], p["ci"], 3)])
    blocks: list[Block] = [
        ("p", "Each task's top-1 error against the run's loss, error = eps − k·exp(−gamma·L) (Gadre et al. 2024, "
              "Language models scale reliably with over-training and on downstream tasks), fitted on the runs "
              "scored by `python -m lab eval`; the score (1 − error) is predicted at approach 3's compute-optimal "
              "loss of each prediction budget. Its interval spans the resampled links at that loss and at both ends "
              "of the loss's own interval.")]
    if rows:
        blocks.append(("table", ["task", "runs", "error(L)", "RMSE", "C (FLOPs)", "loss at C", "score at C"], rows))
    if skipped:
        blocks.append(("ul", skipped))
    return blocks


def _data_blocks(doc: dict) -> list[Block]:
    data, iso = doc["data"], doc["isoflop"]
    k, budgets = data["flops_per_param_token"], data["budgets"]
    off = ", ".join(f"{o['run_id']} ({o['ratio']:.3g}x)" for o in k["outliers"][:10])
    derivation = "(derived)" if k["derived"] else (f"(median); {len(k['outliers'])} run(s) off by more than 2x"
                                                   + (f": {off}" if off else ""))
    checks = [f"FLOPs: C = {k['k']:.4g} N D {derivation}"]
    how = {"keep": "each run kept as its own point", "mean": "averaged into one run each"}
    checks.append(f"Runs sharing N and D: {len(data['duplicates'])} group(s)"
                  + (f", {how[data['duplicate_policy']]}; largest loss range within a group "
                     f"{max(g['loss_range'] for g in data['duplicates']):.3g} nats "
                     f"({max(g['loss_spread'] for g in data['duplicates']):.2%})" if data["duplicates"] else ""))
    checks.append(f"Budgets: {budgets['mode']}; {len(budgets['groups'])} budget(s) within {budgets['tolerance']:.0%} "
                  f"of C, {budgets['unassigned']} run(s) in no budget"
                  + (f", {len(budgets['wide'])} chain(s) of C wider than the tolerance" if budgets["wide"] else ""))
    blocks: list[Block] = [
        ("table", ["", "min", "max"],
         [[name, fmt(data[key][0]), fmt(data[key][1])] for name, key in
          (("parameters N", "params"), ("tokens D", "tokens"), ("compute C (FLOPs)", "flops"),
           ("loss (nats per token)", "loss"), ("tokens per parameter", "tokens_per_param"))]),
        ("ul", checks)]
    if iso["minima"]:
        blocks.append(("table", ["budget C", "runs", "N range", "lowest run: N (loss)", "vertex: N (loss)",
                                 "spline minimum: N (loss)", "window N", "sizes below / above", "status",
                                 f"used ({iso['minimum']})"],
                       [[fmt(m["flops"]), str(m["n_runs"]),
                         f"{fmt(m['params_range'][0], 3)} - {fmt(m['params_range'][1], 3)}",
                         f"{fmt(m['lowest']['params'])} ({fmt(m['lowest']['loss'])})",
                         f"{fmt(m['vertex']['params'])} ({fmt(m['vertex']['loss'])})" if m["vertex"] else "-",
                         f"{fmt(m['spline']['params'])} ({fmt(m['spline']['loss'])})" if m["spline"] else "-",
                         f"{fmt(m['window']['params'][0], 3)} - {fmt(m['window']['params'][1], 3)} "
                         f"({m['window']['n_runs']} runs)", f"{m['sizes_below']} / {m['sizes_above']}",
                         m["status"], "yes" if m["used"][iso["minimum"]] else "no"] for m in iso["minima"]]))
    return blocks


_METHOD = (
    "Approach 3 minimises the summed Huber loss (delta = 1e-3 unless --huber-delta says otherwise) of log-space "
    "residuals, LSE(a - alpha log N, b - beta log D, e) - log L, as in Hoffmann et al. (2022), appendix D. The "
    "objective is evaluated on the paper's whole 4,500-point grid of starts at once; least squares with the Huber "
    "loss (analysis/robust.py: trust-region reflective, analytic Jacobian, log N and log D centred) runs from the "
    "best few grid points and the best result is kept. Runs are grouped into budgets by clustering log C "
    "(analysis/budgets.py); when C does not cluster, no IsoFLOP profiles are formed. A budget's minimum is its "
    "lowest run or the vertex of a parabola in log N fitted in a window symmetric about the lowest run "
    "(analysis/isoflop.py), because a parabola through a lopsided profile is pulled towards its longer side; "
    "budgets with fewer than two sizes on a side of their lowest run are left out. The envelope uses end points "
    "only by default: per budget (or per run's own C when C is continuous) the lowest final loss, where it beats "
    "every smaller budget, since the intermediate points of a run's single schedule are not the losses runs of "
    "those lengths reach; with --envelope curves it takes, at each FLOP count, the run whose training curve is "
    "lowest. Each bootstrap resample draws the runs with replacement and refits every approach on it; approaches "
    "are compared pair by pair on the same resamples. The hold-out check refits approach 3 without the largest "
    "budgets (--holdout-budgets K, default 1; or the runs above --holdout-above C; with continuous C the top "
    "fifth) and predicts each run held out. Runs sharing N and D are each their own point by default, as in the "
    "published fits; outliers are flagged from robust (median and MAD) z-scores of the log-loss residuals. "
    "Approach 3 may fit another form, Kaplan et al.'s (2020) with an irreducible E, E + ((N_c/N)^(alpha_N/alpha_D) "
    "+ D_c/D)^alpha_D (its own grid of 675 starts), or Gadre et al.'s (2024) E + A/N^alpha + B/D^alpha with one "
    "exponent (four parameters; 900 starts), in the same way; with --form auto (the default) every form is "
    "refitted without the hold-out's runs and the one that predicts them with the smallest mean relative error is "
    "used for everything that follows (Chinchilla's with --no-holdout). Every form's fit is reported side by side.")


def _forms_blocks(a3: dict) -> list[Block]:
    forms = a3.get("forms") or []
    if not forms:
        return [("p", "Not recorded (a fit.json from before every form was fitted).")]
    header, cells = forms_cells(forms)
    skipped = next(row["holdout_skipped"] for row in forms if not row["skipped"])
    choice = a3.get("form_choice")
    why = (f"Chosen (*) by --form auto: {choice['why']}." if choice else
           f"Chosen (*) by --form {a3['form']}.")
    return [("p", "Each form fitted to all runs in the same way (Huber loss of log residuals, least squares from "
                  "its own grid of starts); the hold-out columns refit each without the hold-out's runs and predict "
                  "them"
                  + (f" (not run: {skipped})" if skipped else "") + ". " + why),
            ("table", header, cells)]


def _holdout_blocks(hold: dict) -> list[Block]:
    if hold.get("skipped"):
        return [("p", f"Skipped: {hold['reason']}.")]
    a3 = hold["approach3"]
    rows = [["approach 3: loss of the held-out runs", f"mean abs {fmt(a3['mean_abs_error'])}",
             f"mean rel {a3['mean_rel_error']:.2%}", f"max rel {a3['max_rel_error']:.2%}"]]
    if "bias" in a3:
        rows.append(["approach 3: bias of the held-out losses", f"mean signed rel {a3['bias']:+.2%}",
                     f"{a3['too_high']} of {hold['n_holdout']} predicted too high", ""])
    if hold["isoflop"]:
        iso = hold["isoflop"]
        rows.append(["IsoFLOP: N_opt at the held-out budget", f"predicted {fmt(iso['params_opt_predicted'])}",
                     f"observed {fmt(iso['params_opt_observed'])}", f"rel error {iso['rel_error']:.2%}"])
        rows.append(["approach 3: N_opt at the held-out budget", f"predicted {fmt(a3['params_opt_predicted'])}",
                     f"observed {fmt(iso['params_opt_observed'])}", f"rel error {a3['params_opt_rel_error']:.2%}"])
    per_run = [[r["run_id"], fmt(r["params"]), fmt(r["tokens"]), fmt(r.get("flops")), fmt(r["loss"]),
                fmt(r["predicted"]), fmt(r.get("error"), 3), f"{r['rel_error']:+.2%}" if "rel_error" in r else "-"]
               for r in a3["runs"]]
    return [("p", f"Fitted on {hold['n_train']} runs without {hold['held_out']}, then predicted its "
                  f"{hold['n_holdout']} runs."),
            ("table", ["check", "", "", ""], rows),
            ("p", "Predicted against actual loss for each held-out run (approach 3 refitted without them):"),
            ("table", ["run", "N", "D", "C", "actual loss", "predicted", "error (nats)", "rel error"], per_run)]


def render_markdown(blocks: list[Block]) -> str:
    """Blocks as GitHub-flavoured Markdown (figures linked as the PNG files beside it)."""
    out = []
    for block in blocks:
        kind = block[0]
        if kind == "h":
            out.append("#" * block[1] + " " + block[2])
        elif kind == "p":
            out.append(block[1])
        elif kind in ("ul", "warn", "alert"):
            prefix = "- **!** " if kind == "alert" else "- "
            out.append("\n".join(f"{prefix}{item}" for item in block[1]))
        elif kind == "table":
            cells = [block[1]] + block[2]
            lines = ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in cells]
            lines.insert(1, "|" + "---|" * len(block[1]))
            out.append("\n".join(lines))
        elif kind == "img":
            out.append(f"![{block[2]}]({block[1]}.png)\n\n*{block[2]}*")
    return "\n\n".join(out) + "\n"


def _inline(text: str) -> str:
    """Escape text for HTML, turning `code` spans into <code> and **bold** into <strong>."""
    parts = html.escape(text).split("`")
    text = "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))
    parts = text.split("**")
    return "".join(f"<strong>{p}</strong>" if i % 2 else p for i, p in enumerate(parts))


def render_html(blocks: list[Block], images: dict[str, bytes]) -> str:
    """Blocks as one self-contained HTML page: inline CSS, figures embedded from ``images`` (PNG bytes)."""
    title = next(b[2] for b in blocks if b[0] == "h")
    body = []
    for block in blocks:
        kind = block[0]
        if kind == "h":
            body.append(f"<h{block[1]}>{_inline(block[2])}</h{block[1]}>")
        elif kind == "p":
            body.append(f"<p>{_inline(block[1])}</p>")
        elif kind in ("ul", "warn"):
            body.append(f'<ul class="{kind}">' + "".join(f"<li>{_inline(i)}</li>" for i in block[1]) + "</ul>")
        elif kind == "alert":
            body.append('<div class="alert"><ul>' + "".join(f"<li>{_inline(i)}</li>" for i in block[1]) + "</ul></div>")
        elif kind == "table":
            head = "".join(f"<th>{_inline(str(h))}</th>" for h in block[1])
            rows = "".join("<tr>" + "".join(f"<td>{_inline(str(c))}</td>" for c in row) + "</tr>" for row in block[2])
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        elif kind == "img":
            stem, caption = block[1], html.escape(block[2])
            data = base64.b64encode(images[stem]).decode("ascii")
            body.append(f'<figure><img src="data:image/png;base64,{data}" alt="{caption}">'
                        f"<figcaption>{caption}</figcaption></figure>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><link rel=\"icon\" href=\"data:,\">"
            f"<style>{_CSS}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n")
