"""report/mutual/: summary.json, REPORT.md (the verdicts first) and the plots of `make demo-mutual`; report/mutual/budget/:
the budget pilot's table and choice.

Every number is read from the runs' outputs; every verdict is demo.stats's rule per model (its weak family's paired
interval and permutation test against its own GRPO runs, its strong family as non-inferiority), and the claim's verdict
CLAIM_RULE, both written before the runs.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from demo.config import DemoConfig
from demo.report import LOCAL_FILE, header_lines, paired_values, primary, save_fig, write_summary
from demo.report import run_record as report_run_record
from demo.stats import STRONG_MARGIN, VERDICT_RULE, Interval, p_text, pct, stratified_interval, verdict, verdict_text
from graft.rollouts.files import write_text_atomic

# The pair, and the budget pilot's rule (studies.mutual runs them; this module judges them)
ROLES = ("learner", "peer")  # DemoConfig's two build slots: A is built in the learner's, B in the peer's
NAME = {"learner": "A", "peer": "B"}
OTHER = {"learner": "peer", "peer": "learner"}
BUDGET_LRS = [1e-4, 3e-4, 5e-4]
PILOT_SEED = 100  # the budget pilot's seed: none of the verdict's
BUDGET_MIN_CEILING = 0.10
BUDGET_RULE = (
    f"on seed {PILOT_SEED} only, before any GRAFT run, for each lr of {BUDGET_LRS} (each model anchored on its own strong "
    f"family): GRPO alone and the ceiling (supervised on the other's correct answers) for both models; keep the lrs at "
    f"which GRPO alone leaves each model's strong family within 2 points of its start (sampled, late evaluations), and "
    f"choose the smallest of those at which both ceilings raise their model's weak family by at least "
    f"{100 * BUDGET_MIN_CEILING:.0f} points; if none does, the kept lr with the largest smaller ceiling gain (and the "
    f"report says that no budget here moves a weak family that far); if none is kept, the demo stops and says so")


# The dose study (`python -m studies.mutual --dose`, issue 48), written before its runs. The mutual demo's GRAFT moved A's
# weak family by about a point where its ceiling (24 supervised answers a step) moved it by twenty: the single changes
# below tell the candidate causes apart, offline (no co-training timing), on seeds no mutual verdict uses.
DOSE_SEEDS = [10, 11, 12, 13, 14, 15]
DOSE_LR = 5e-4  # the main demo's lr (demo.config.RLConfig.lr)
# mode -> trainer overrides on the default GRAFT (None: GRPO), one change each
DOSE_RUNS: dict[str, list[str] | None] = {
    "grpo": None,
    "graft": [],
    # a grafted row's weight in the step's token-mean (~96 rows) against a ceiling row's (24 rows): x 96 / 24
    "graft_scale4": ["graft.peer_loss_scale=4.0"],
    # B's peer solves most of B's weak prompts, so most of its stored groups there are all-success and refused
    "graft_union": ["graft.union_all_success=true"],
    "grpo_lr": None,
    "graft_lr": [],
}
DOSE_LR_MODES = ("grpo_lr", "graft_lr")  # run at DOSE_LR (both: the change's effect is the gain over GRPO at that lr)
DOSE_CHANGES = {"graft_scale4": "peer loss scale x4", "graft_union": "all-success peer groups grafted (union)",
                "graft_lr": f"lr {DOSE_LR:g} (GRAFT's gain over GRPO, both at that lr)"}
DOSE_RULE = (
    f"offline, on seeds {DOSE_SEEDS} (none of the mutual demo's), per model, paired by seed: each single change against "
    "the default GRAFT at the demo's lr (the lr change: GRAFT's gain over GRPO at "
    f"{DOSE_LR:g} against its gain at the demo's lr), judged by the demo's rule with the default GRAFT in GRPO's place; "
    "a change is adopted for the mutual demo's next design when that verdict is gain or small gain for at least one "
    "model and harm for neither; the adopted changes go in together (their combination is then what the rerun tests); "
    "if none is adopted the design stays, and the study says what limits GRAFT here instead. The ceilings are read, "
    "not decided on: the full one (24 of the other's correct answers a step) and the dose-matched one (exactly the "
    "correct rows the default GRAFT run grafted, each step, over that step's token-mean denominator) against GRPO; "
    "what the matched ceiling gains beyond the default GRAFT is the loss's form (w, A, b), what the full ceiling gains "
    "beyond the matched one is the dose")


def strong_family(cfg: DemoConfig, role: str) -> str:
    return cfg.task.strong_family if role == "learner" else cfg.task.weak_family


def weak_family(cfg: DemoConfig, role: str) -> str:
    return strong_family(cfg, OTHER[role])


MOST = 0.5  # "offline keeps most of co-training's gain": at least half of it
CLAIM_RULE = (
    "the paper's claim holds when, under co-training with the trainers' default GRAFT, both models' weak families gain "
    "by the demo's rule (verdict gain: interval above 0, p < 0.05, mean at least +2 points, strong family kept within 2 "
    f"points) and offline from the other's stored groups keeps most of it (each model's mean offline gain at least "
    f"{100 * MOST:.0f}% of its co-training gain); it does not hold when a model's co-training verdict is small gain, no "
    "gain or harm, or offline keeps less than that for a model whose co-training gained; otherwise undecided")
MODE_LABEL = {"grpo": "GRPO alone", "cotrain": "co-training (the trainers' default GRAFT when it ran: b = 1, peer negatives x0)",
              "offline": "offline from the other's stored groups (the trainers' default GRAFT when it ran: b = 1, peer "
                         "negatives x0)"}


def mode_name(kind: str, method: str) -> str:
    """A GRAFT run's mode (and its jobs' name prefix): `cotrain` / `offline` for the default GRAFT (its runs keep their
    names and caches), `cotrain_<method>` / `offline_<method>` for each other entry of rl.methods."""
    return kind if method == "graft" else f"{kind}_{method}"


def graft_modes(methods: dict[str, list[str]]) -> list[str]:
    return [mode_name(kind, name) for name in methods for kind in ("cotrain", "offline")]


def mode_label(mode: str, methods: dict[str, list[str]]) -> str:
    if mode in MODE_LABEL:
        return MODE_LABEL[mode]
    kind, name = mode.split("_", 1)
    where = "co-training" if kind == "cotrain" else "offline from the other's stored groups"
    return f"{where}, `{name}` ({', '.join(methods[name]) or 'no overrides'})"


def run_record(run: dict, families: list[str], steps: int) -> dict[str, Any]:
    return {**report_run_record(run, families, steps), "model": run["model"]}


def compare(records: list[dict], name: str, mode: str, weak: str, strong: str, families: list[str]) -> dict:
    """One model's `mode` against its own GRPO runs, paired by seed: weak and strong intervals, the verdict, and every
    family's interval (interference)."""
    mine = [r for r in records if r["model"] == name]
    weak_i, strong_i = (stratified_interval(paired_values(mine, mode, f)) for f in (weak, strong))
    return {"weak": weak_i.as_dict(), "strong": strong_i.as_dict(), "verdict": verdict(weak_i, strong_i),
            "per_family": {f: stratified_interval(paired_values(mine, mode, f)).as_dict() for f in families}}


def claim(comparisons: dict[str, dict[str, dict]]) -> dict:
    """CLAIM_RULE on both models' co-training and offline comparisons."""
    cotrain = {name: c["cotrain"] for name, c in comparisons.items()}
    offline_share = {}
    for name, c in comparisons.items():
        gain = c["cotrain"]["weak"]["mean"]
        offline_share[name] = c["offline"]["weak"]["mean"] / gain if gain > 0 else None
    if any(c["verdict"] in ("small gain", "no gain", "harm") for c in cotrain.values()):
        outcome = "does not hold"
    elif all(c["verdict"] == "gain" for c in cotrain.values()):
        outcome = "holds" if all(share is not None and share >= MOST for share in offline_share.values()) else "does not hold"
    else:
        outcome = "undecided"
    return {"rule": CLAIM_RULE, "verdict": outcome, "cotrain_verdicts": {n: c["verdict"] for n, c in cotrain.items()},
            "offline_share_of_cotrain_gain": offline_share}


def write_report(cfg: DemoConfig, models: dict, runs: list[dict], stored: dict, timings: dict, wall_time_s: float) -> dict:
    families = list(cfg.task.n_eval)
    records = [run_record(r, families, cfg.rl.steps) for r in runs if r["mode"] != "ceiling"]
    ceilings = [{"model": r["model"], "seed": r["seed"], **json.loads((Path(r["dir"]) / "done.json").read_text())}
                for r in runs if r["mode"] == "ceiling"]
    role_of = {NAME[role]: role for role in ROLES}
    weak = {name: weak_family(cfg, role) for name, role in role_of.items()}
    strong = {name: strong_family(cfg, role) for name, role in role_of.items()}
    comparisons = {name: {mode: compare(records, name, mode, weak[name], strong[name], families)
                          for mode in graft_modes(cfg.rl.methods)} for name in role_of}
    starts = {name: {**next(iter(models[role]["starts"].values())), "architecture": models[role]["architecture"],
                     "parameters": models[role]["parameters"], "vocab_size": models[role]["vocab_size"],
                     "sft_steps": models[role]["sft_steps"]} for name, role in role_of.items()}
    budget_path = cfg.report_dir / "budget" / "summary.json"
    summary = {
        "rule": VERDICT_RULE, "claim": claim(comparisons),
        "primary_metric": f"sampled accuracy ({cfg.rl.eval_samples} samples per held-out problem at T = 1), averaged over "
                          f"the evaluations at step >= {cfg.rl.steps // 2}",
        "families": families, "weak_family": weak, "strong_family": strong, "comparisons": comparisons,
        "starts": starts, "ceilings": ceilings,
        "stored_groups": {NAME[role]: v for role, v in stored.items()},
        "budget": json.loads(budget_path.read_text()) if budget_path.exists() else None,
        "runs": records, "job_wall_s": {k: round(v, 1) for k, v in timings.items()}, "wall_time_s": wall_time_s,
        "config": cfg.model_dump(mode="json"),
    }
    committed = write_summary(cfg.report_dir, summary)
    _plot(committed, cfg.report_dir)
    write_text_atomic(cfg.report_dir / "REPORT.md", markdown(committed))
    return summary


def verdict_lines(summary: dict) -> list[str]:
    lines = ["| model | method vs its GRPO, paired by seed | pairs | weak family gain, points [95% CI] | p | strong family "
             "change [95% CI] | verdict | ceiling: weak family, start -> supervised on the other's answers |",
             "|---|---|---|---|---|---|---|---|"]
    for name, per_mode in summary["comparisons"].items():
        ceiling = [c for c in summary["ceilings"] if c["model"] == name]
        start = summary["starts"][name]["acc_sampled"][summary["weak_family"][name]]
        ceiling_text = " / ".join(f"{100 * start:.1f} -> {100 * c['acc_sampled'][summary['weak_family'][name]]:.1f}"
                                  for c in ceiling) or "-"
        for mode, c in per_mode.items():
            weak_i, strong_i = Interval(**c["weak"]), Interval(**c["strong"])
            lines.append(f"| {name} (weak `{summary['weak_family'][name]}`) | {mode_label(mode, summary['config']['rl']['methods'])} | {weak_i.pairs} | {pct(weak_i)} | "
                         f"{p_text(weak_i)} | {pct(strong_i)} | **{verdict_text(c['verdict'], weak_i)}** | {ceiling_text} |")
    return lines


def markdown(summary: dict) -> str:
    cfg = summary["config"]
    c = summary["claim"]
    lines = [
        "# GRAFT mutual demo: two models, each strong where the other is weak",
        "",
        f"{cfg['rl']['steps']} RL steps of {cfg['rl']['prompts_per_step']} prompts x {cfg['rl']['group_size']} rollouts, lr "
        f"{cfg['rl']['lr']:g}, each model anchored on its own strong family, seeds {cfg['rl']['seeds']}. Primary metric: "
        f"{summary['primary_metric']}.",
        "",
        *header_lines(summary),
        "",
        *verdict_lines(summary),
        "",
        f"**The claim: {c['verdict']}.** ({c['rule']}.)",
        "",
        "<!-- table-end -->",
        "",
        "## Interference: what each method does to every family of each model (points against its GRPO, 95% CI)",
        "",
        "| model | method | " + " | ".join(f"`{f}`" for f in summary["families"]) + " |",
        "|---|---|" + "---|" * len(summary["families"]),
    ]
    for name, per_mode in summary["comparisons"].items():
        for mode, comp in per_mode.items():
            lines.append(f"| {name} | {mode_label(mode, summary['config']['rl']['methods'])} | "
                         + " | ".join(pct(Interval(**comp["per_family"][f])) for f in summary["families"]) + " |")
    lines += ["", "## The pair and its starts", "",
              "| model | architecture | parameters | start: step | level: weak family sampled (dev) | held-out sampled, per family |",
              "|---|---|---|---|---|---|"]
    for name, s in summary["starts"].items():
        held = ", ".join(f"`{f}` {100 * a:.1f}" for f, a in s["acc_sampled"].items())
        lines.append(f"| {name} | {s['architecture']} | {s['parameters']:,} | {s['step']} | {100 * s['level']:.0f}% "
                     f"({100 * s['dev_sampled'][summary['weak_family'][name]]:.1f}% there) | {held} |")
    for name, stored in summary["stored_groups"].items():
        lines.append(f"\n{name}'s stored groups (its start, before any training): {stored['indexed_groups']} groups, "
                     f"{stored['informative_groups']} informative, success rate {100 * stored['success_rate']:.1f}%.")
    if summary["budget"]:
        lines += ["", "## The budget, chosen before any GRAFT run", "", *budget_lines(summary["budget"])]
    lines += ["", "![accuracy per family and step](accuracy_vs_step.png)", "",
              f"The run's times (every job's, and its own) are in `{LOCAL_FILE}` beside this file, which git ignores.", ""]
    return "\n".join(lines)


def _plot(summary: dict, report_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families, records = summary["families"], summary["runs"]
    names = list(summary["comparisons"])
    methods = summary["config"]["rl"]["methods"]
    modes = ["grpo", *graft_modes(methods)]
    fig, axes = plt.subplots(len(names), len(families), figsize=(4.2 * len(families), 3.6 * len(names)), squeeze=False)
    for row, name in enumerate(names):
        for col, family in enumerate(families):
            ax = axes[row][col]
            for index, mode in enumerate(modes):
                runs = [r for r in records if r["model"] == name and r["mode"] == mode]
                if not runs:
                    continue
                steps = [0] + [e["step"] for e in runs[0]["evals"]]
                begin = summary["starts"][name]["acc_sampled"][family]
                values = [[begin] + [e["acc_sampled"][family] for e in r["evals"]] for r in runs]
                mean = [100 * statistics.fmean(v[i] for v in values) for i in range(len(steps))]
                low = [100 * min(v[i] for v in values) for i in range(len(steps))]
                high = [100 * max(v[i] for v in values) for i in range(len(steps))]
                ax.plot(steps, mean, color=f"C{index}", marker="o", markersize=3, label=mode_label(mode, methods))
                ax.fill_between(steps, low, high, color=f"C{index}", alpha=0.12)
            kind = "strong" if family == summary["strong_family"][name] else "weak" if family == summary["weak_family"][name] else "shared"
            ax.set_title(f"model {name}, {family} ({kind})", fontsize=10)
            ax.set_xlabel("RL step")
            ax.set_ylabel("held-out sampled accuracy (%)")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    save_fig(fig, report_dir / "accuracy_vs_step.png")
    plt.close(fig)


# ---- the budget pilot ---------------------------------------------------------------------------------------------

def write_budget(cfg: DemoConfig, models: dict, runs: list[dict], timings: dict, wall_time_s: float) -> dict:
    """BUDGET_RULE on the pilot's runs; report/mutual/budget/."""
    families = list(cfg.task.n_eval)
    rows = []
    for lr in BUDGET_LRS:
        row: dict[str, Any] = {"lr": lr}
        for role in ROLES:
            name, start = NAME[role], next(iter(models[role]["starts"].values()))
            grpo = next(r for r in runs if r["mode"] == "grpo" and r["model"] == name and r["lr"] == lr)
            evals = json.loads((Path(grpo["dir"]) / "done.json").read_text())["evals"]
            ceiling = next(r for r in runs if r["mode"] == "ceiling" and r["model"] == name and r["lr"] == lr)
            done = json.loads((Path(ceiling["dir"]) / "done.json").read_text())
            strong, weak = strong_family(cfg, role), weak_family(cfg, role)
            row[name] = {
                "strong_start": start["acc_sampled"][strong], "strong_grpo": primary(evals, cfg.rl.steps, strong),
                "weak_start": start["acc_sampled"][weak], "weak_grpo": primary(evals, cfg.rl.steps, weak),
                "weak_ceiling": done["acc_sampled"][weak], "strong_ceiling": done["acc_sampled"][strong],
                "per_family_grpo": {f: primary(evals, cfg.rl.steps, f) for f in families},
            }
            row[name]["strong_kept"] = row[name]["strong_grpo"] >= row[name]["strong_start"] - STRONG_MARGIN
            row[name]["ceiling_gain"] = row[name]["weak_ceiling"] - row[name]["weak_start"]
        row["kept"] = all(row[NAME[r]]["strong_kept"] for r in ROLES)
        row["min_ceiling_gain"] = min(row[NAME[r]]["ceiling_gain"] for r in ROLES)
        rows.append(row)
    kept = [r for r in rows if r["kept"]]
    moving = [r for r in kept if r["min_ceiling_gain"] >= BUDGET_MIN_CEILING]
    chosen = min(moving, key=lambda r: r["lr"]) if moving else max(kept, key=lambda r: r["min_ceiling_gain"]) if kept else None
    result = {"rule": BUDGET_RULE, "rows": rows, "chosen_lr": chosen["lr"] if chosen else None,
              "moves_weak_family": bool(moving), "wall_time_s": wall_time_s, "job_wall_s": {k: round(v, 1) for k, v in timings.items()}}
    out = cfg.report_dir / "budget"
    write_summary(out, result)
    write_text_atomic(out / "REPORT.md", "# The mutual demo's budget\n\n" + "\n".join(budget_lines(result)) + "\n")
    return result


def budget_lines(result: dict) -> list[str]:
    lines = [*header_lines(result), "",
             "| lr | A strong: start -> GRPO | A weak: start -> GRPO / ceiling | B strong: start -> GRPO | "
             "B weak: start -> GRPO / ceiling | strong families kept |", "|---|---|---|---|---|---|"]
    for row in result["rows"]:
        cells = []
        for name in ("A", "B"):
            m = row[name]
            cells += [f"{100 * m['strong_start']:.1f} -> {100 * m['strong_grpo']:.1f}",
                      f"{100 * m['weak_start']:.1f} -> {100 * m['weak_grpo']:.1f} / {100 * m['weak_ceiling']:.1f}"]
        lines.append(f"| {row['lr']:g} | " + " | ".join(cells) + f" | {'yes' if row['kept'] else 'no'} |")
    chosen = result["chosen_lr"]
    lines += ["", f"Chosen lr: **{chosen:g}**" if chosen is not None else "No lr keeps both strong families: the demo stops here.",
              "" if result["moves_weak_family"] or chosen is None else
              f"No kept lr lets the ceiling raise both weak families by {100 * BUDGET_MIN_CEILING:.0f} points: the chosen one "
              "moves them most, and no method here can be expected to move them further."]
    return lines


# ---- the dose study -----------------------------------------------------------------------------------------------

def _ceiling_record(run: dict, families: list[str], steps: int) -> dict[str, Any]:
    done = json.loads((Path(run["dir"]) / "done.json").read_text())
    return {"name": run["name"], "mode": run["mode"], "model": run["model"], "start": run["start"], "seed": run["seed"],
            "primary": {f: primary(done["evals"], steps, f) for f in families}, "evals": done["evals"],
            "examples_per_step": done["examples_per_step"], "denominator_mean": done.get("denominator_mean")}


def _relative(records: list[dict], name: str, mode: str, baseline: str, weak: str, strong: str) -> dict:
    mine = [r for r in records if r["model"] == name]
    weak_i, strong_i = (stratified_interval(paired_values(mine, mode, f, baseline=baseline)) for f in (weak, strong))
    return {"weak": weak_i.as_dict(), "strong": strong_i.as_dict(), "verdict": verdict(weak_i, strong_i)}


def _lr_change(records: list[dict], name: str, weak: str, strong: str) -> dict:
    """Per seed, (GRAFT - GRPO) at DOSE_LR minus (GRAFT - GRPO) at the demo's lr, judged as a change against the default."""
    mine = [r for r in records if r["model"] == name]

    def by_seed(mode: str, family: str) -> dict[int, float]:
        return {r["seed"]: r["primary"][family] for r in mine if r["mode"] == mode}

    out = {}
    for key, family in (("weak", weak), ("strong", strong)):
        v = {m: by_seed(m, family) for m in ("grpo", "graft", "grpo_lr", "graft_lr")}
        seeds = sorted(set.intersection(*(set(x) for x in v.values())))
        out[key] = stratified_interval({name: [(v["graft_lr"][s] - v["grpo_lr"][s]) - (v["graft"][s] - v["grpo"][s])
                                               for s in seeds]})
    return {"weak": out["weak"].as_dict(), "strong": out["strong"].as_dict(), "verdict": verdict(out["weak"], out["strong"])}


def write_dose(cfg: DemoConfig, models: dict, runs: list[dict], timings: dict, wall_time_s: float) -> dict:
    """DOSE_RULE on the dose study's runs; report/mutual/dose/."""
    families, steps = list(cfg.task.n_eval), cfg.rl.steps
    records = [_ceiling_record(r, families, steps) if r["mode"].startswith("ceiling") else run_record(r, families, steps)
               for r in runs]
    result: dict[str, Any] = {"rule": DOSE_RULE, "rule_verdicts": VERDICT_RULE, "seeds": DOSE_SEEDS, "models": {}}
    for role in ROLES:
        name, weak, strong = NAME[role], weak_family(cfg, role), strong_family(cfg, role)
        vs_grpo = {mode: _relative(records, name, mode, "grpo_lr" if mode in DOSE_LR_MODES else "grpo", weak, strong)
                   for mode in [*DOSE_RUNS, "ceiling", "ceiling_matched"] if not mode.startswith("grpo")}
        changes = {mode: _relative(records, name, mode, "graft", weak, strong) for mode in DOSE_CHANGES if mode != "graft_lr"}
        changes["graft_lr"] = _lr_change(records, name, weak, strong)
        mine = [r for r in records if r["model"] == name]
        result["models"][name] = {
            "weak_family": weak, "strong_family": strong, "vs_grpo": vs_grpo, "changes": changes,
            "grafted_rows_per_step": statistics.fmean(r["frac_grafted_mean"] * cfg.rl.prompts_per_step * cfg.rl.group_size
                                                      for r in mine if r["mode"] == "graft"),
            "matched_examples_per_step": statistics.fmean(r["examples_per_step"] for r in mine if r["mode"] == "ceiling_matched"),
            "peer_hit_rate": {m: statistics.fmean(r["peer_hit_rate_mean"] for r in mine if r["mode"] == m)
                              for m in DOSE_RUNS if DOSE_RUNS[m] is not None},
        }
    adopted = [mode for mode in DOSE_CHANGES
               if any(result["models"][n]["changes"][mode]["verdict"] in ("gain", "small gain") for n in result["models"])
               and not any(result["models"][n]["changes"][mode]["verdict"] == "harm" for n in result["models"])]
    result["adopted"] = adopted
    result.update(runs=records, job_wall_s={k: round(v, 1) for k, v in timings.items()}, wall_time_s=wall_time_s,
                  config=cfg.model_dump(mode="json"))
    out = cfg.report_dir / "dose"
    committed = write_summary(out, result)
    write_text_atomic(out / "REPORT.md", "# The mutual demo's dose study\n\n" + "\n".join(dose_lines(committed)) + "\n")
    return result


def dose_lines(result: dict) -> list[str]:
    lines = [*header_lines(result), "",
             "| model | against its GRPO (same lr), paired by seed | weak family, points [95% CI] | p | strong family [95% CI] | verdict |",
             "|---|---|---|---|---|---|"]
    labels = {"graft": "the default GRAFT", "ceiling": "the full ceiling (24 answers a step)",
              "ceiling_matched": "the dose-matched ceiling (the grafted correct rows)", **DOSE_CHANGES}
    for name, m in result["models"].items():
        for mode, c in m["vs_grpo"].items():
            weak_i, strong_i = Interval(**c["weak"]), Interval(**c["strong"])
            lines.append(f"| {name} (weak `{m['weak_family']}`) | {labels[mode]} | {pct(weak_i)} | {p_text(weak_i)} | "
                         f"{pct(strong_i)} | {verdict_text(c['verdict'], weak_i)} |")
    lines += ["", "| model | single change, against the default GRAFT | weak family, points [95% CI] | p | strong family [95% CI] | verdict |",
              "|---|---|---|---|---|---|"]
    for name, m in result["models"].items():
        for mode, c in m["changes"].items():
            weak_i, strong_i = Interval(**c["weak"]), Interval(**c["strong"])
            lines.append(f"| {name} | {DOSE_CHANGES[mode]} | {pct(weak_i)} | {p_text(weak_i)} | {pct(strong_i)} | "
                         f"**{verdict_text(c['verdict'], weak_i)}** |")
    lines.append("")
    for name, m in result["models"].items():
        hits = ", ".join(f"{mode} {rate:.2f}" for mode, rate in m["peer_hit_rate"].items())
        lines.append(f"{name}: {m['grafted_rows_per_step']:.1f} grafted rows a step under the default GRAFT, "
                     f"{m['matched_examples_per_step']:.1f} of them correct (the matched ceiling's rows); peer hit rate {hits}.")
    lines += ["", "Read again (issue 60): the dose-matched ceiling is supervised learning on the grafted correct rows (and "
              "the anchor) alone, with none of the RL on the model's own groups that the GRAFT run also had, so it "
              "differs from that run in more than the loss's form and cannot isolate it, as the rule above hoped. The lr "
              "row is a change in GRAFT's gain over GRPO: in absolute terms GRAFT's weak family is about the same at both "
              "lrs while GRPO's falls at 5e-4 (the runs' primary metrics in summary.json)."]
    adopted = result["adopted"]
    lines += ["", f"**Adopted for the mutual demo's next design: {', '.join(DOSE_CHANGES[a] for a in adopted)}.**" if adopted
              else "**No change is adopted: the mutual demo's design stays.**"]
    return lines
