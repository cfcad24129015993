"""The mutual study's rules, written before its runs (issue 60), and its reports: report/mutual/<pair>/ (the study)
and report/mutual/<pair>/pilot/ (the budget's pilot), with report/mutual/REPORT.md, every pair's answers.

PILOT_RULE sets each pair's budget (lr and run length) from GRPO alone, on a seed of its own, before any GRAFT run.
MUTUAL_RULE reads the study: every number is read from the runs' outputs, every interval and label is demo.stats's
(paired by (start, seed), stratified by start, the sign-flip test), and the answers follow from them as the rule says.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from demo.config import DemoConfig
from demo.report import LOCAL_FILE, header_lines, paired_values, primary, save_fig, write_summary
from demo.report import run_record as rl_run_record
from demo.stats import (
    ALPHA,
    RULE_VERSION,
    STRONG_MARGIN,
    VERDICT_RULE,
    WEAK_MIN_GAIN,
    Interval,
    p_text,
    pct,
    stratified_interval,
    verdict,
    verdict_text,
)
from graft.rollouts.files import write_text_atomic

ROLES = ("learner", "peer")  # DemoConfig's two build slots: A is built in the learner's, B in the peer's
NAME = {"learner": "A", "peer": "B"}
OTHER = {"learner": "peer", "peer": "learner"}


def strong_family(cfg: DemoConfig, role: str) -> str:
    return cfg.task.strong_family if role == "learner" else cfg.task.weak_family


def weak_family(cfg: DemoConfig, role: str) -> str:
    return strong_family(cfg, OTHER[role])


# ---- the rules, written before the runs -----------------------------------------------------------------------------

PILOT_LRS = [1e-4, 3e-4, 1e-3]
PILOT_STEPS = 160
PILOT_SEED = 100  # none of the study's seeds
PILOT_MIN_STEPS = 40
PILOT_SHARE = 0.8
PILOT_RULE = (
    f"per task pair, on seed {PILOT_SEED} only, before any GRAFT run of this design: GRPO alone, each model from each of "
    f"its two starts, at each lr of {PILOT_LRS} for {PILOT_STEPS} steps, evaluated every 20 steps (the curves are the "
    f"pilot's report); an lr is kept when each of the pair's four runs keeps its strong family within "
    f"{100 * STRONG_MARGIN:.0f} points of its start (the mean of its evaluations at step >= {PILOT_STEPS // 2}); GRPO's "
    f"best lr is the kept lr with the largest weak-family gain over the start (each run's mean at step >= "
    f"{PILOT_STEPS // 2} minus its start, averaged over the four runs); the run length is the first evaluated step >= "
    f"{PILOT_MIN_STEPS} at which the four runs' mean weak-family gain at that lr reaches {100 * PILOT_SHARE:.0f}% of its "
    f"largest over the {PILOT_STEPS} steps; if no lr is kept, the smallest lr at {PILOT_STEPS} steps, and the pilot says so")

CEILING_SHARE = 0.25  # the bar tied to the ceiling: GRAFT - GRPO >= this share of (ceiling - GRPO)
ARMS = ("cotrain", "offline")  # GRAFT, the two ways the claim names
MODE_LABEL = {
    "grpo": "GRPO alone",
    "cotrain": "GRAFT co-training (the other model as it trains)",
    "offline": "GRAFT offline (the other's stored groups of the same start)",
    "grpo_matched": "GRPO + the offline run's grafted correct rows, supervised at their step",
    "ceiling": "ceiling: 24 of the other's correct answers a step, supervised",
    "ceiling_gated": "ceiling on the gate's prompts: 24 a step from the groups the offline run grafted",
}
# control -> (mode, baseline, what their difference is)
CONTROLS = {
    "loss form": ("grpo_matched", "offline", "the same grafted rows at the same dose as supervised rows beside GRPO, "
                                             "against GRAFT's loss (w, A~, the PPO ratio) on them"),
    "the rows as supervised rows": ("grpo_matched", "grpo", "what the grafted rows add to GRPO as supervised rows"),
    "prompts": ("ceiling", "ceiling_gated", "24 rows a step on any weak-family prompt, against 24 on the gate's prompts"),
}
MUTUAL_RULE = (
    "per task pair and model, each run paired by (start, seed) over 2 starts x the seeds, the metric the model's held-out "
    "sampled accuracy on its weak family (and on its strong family for non-inferiority) averaged over the evaluations "
    "at step >= half the run, every interval, p and label demo.stats's (the demo's rule of the same date). (1) "
    "Co-training beats offline for a model when the demo's verdict of co-training against offline (offline in GRPO's "
    "place) is gain; it does not when that verdict is small gain, no gain, loss or harm; otherwise undecided. (2) For "
    "each of co-training and offline against GRPO, two bars: the 2-point bar is reached when the weak family's gain is "
    f"shown (interval above 0, p < {ALPHA}) with its mean at least +{100 * WEAK_MIN_GAIN:.0f} points, and short when "
    f"its interval lies below +{100 * WEAK_MIN_GAIN:.0f}; the ceiling bar, with d = (GRAFT - GRPO) - "
    f"{CEILING_SHARE:g} x (ceiling - GRPO) per pair (the ceiling run of the same start and seed), is reached when the "
    "gain is shown and d's mean is at least 0, and short when d's interval lies below 0; otherwise undecided. (3) The "
    "controls are read, each against its baseline by the demo's rule, not decided on: GRPO plus the offline run's "
    "grafted correct rows (the loss's form: against offline; the rows' worth: against GRPO), and the ceiling on the "
    "gate's prompts (the prompts: the full ceiling against it). (4) The peers' change: in each co-training run, the "
    "partner's accuracy on its strong family (the family whose groups it gives) at its last evaluation minus at its "
    "start, pooled over the model's pairs; offline's peer does not change by construction. (5) The paper's claim holds "
    "for a pair when both models' co-training reaches the 2-point bar and offline's mean gain is at least half of "
    "co-training's for each; it does not when either model's co-training is short of it; otherwise undecided")


def bar(weak: Interval, d: Interval | None = None) -> str:
    """reached / short / undecided for one bar: the 2-point bar on the gain itself (`d` None), the ceiling bar on d."""
    shown = weak.low > 0 and weak.p_value < ALPHA
    if d is None:
        return "reached" if shown and weak.mean >= WEAK_MIN_GAIN else "short" if weak.high < WEAK_MIN_GAIN else "undecided"
    return "reached" if shown and d.mean >= 0 else "short" if d.high < 0 else "undecided"


def compare(records: list[dict], mode: str, baseline: str, weak: str, strong: str) -> dict:
    """`mode` against `baseline` by the demo's rule, paired by (start, seed): weak and strong intervals, the verdict."""
    weak_i, strong_i = (stratified_interval(paired_values(records, mode, f, baseline=baseline)) for f in (weak, strong))
    return {"weak": weak_i.as_dict(), "strong": strong_i.as_dict(), "verdict": verdict(weak_i, strong_i)}


def ceiling_bar_interval(records: list[dict], arm: str, weak: str) -> Interval:
    """d = (arm - GRPO) - CEILING_SHARE x (ceiling - GRPO) per (start, seed), stratified by start."""
    def by_pair(mode: str) -> dict[tuple, float]:
        return {(r["start"], r["seed"]): r["primary"][weak] for r in records if r["mode"] == mode}

    arm_v, grpo_v, ceiling_v = by_pair(arm), by_pair("grpo"), by_pair("ceiling")
    strata: dict[str, list[float]] = {}
    for start, seed in sorted(set(arm_v) & set(grpo_v) & set(ceiling_v)):
        key = (start, seed)
        strata.setdefault(start, []).append(arm_v[key] - grpo_v[key] - CEILING_SHARE * (ceiling_v[key] - grpo_v[key]))
    return stratified_interval(strata)


def peer_change(records: list[dict], partner: str, strong: str, starts: dict[str, dict]) -> Interval | None:
    """The partner's strong family over a co-training run: its last evaluation minus its start, stratified by start."""
    strata: dict[str, list[float]] = {}
    for r in records:
        if r["model"] == partner and r["mode"] == "cotrain":
            strata.setdefault(r["start"], []).append(r["evals"][-1]["acc_sampled"][strong]
                                                     - starts[r["start"]]["acc_sampled"][strong])
    return stratified_interval(strata) if strata else None


def answer(records: list[dict], model: str, partner: str, weak: str, strong: str, partner_strong: str,
           starts: dict[str, dict]) -> dict:
    """MUTUAL_RULE for one model of a pair."""
    mine = [r for r in records if r["model"] == model]
    vs_grpo = {mode: compare(mine, mode, "grpo", weak, strong) for mode in MODE_LABEL if mode != "grpo"}
    head = compare(mine, "cotrain", "offline", weak, strong)
    outcome = {"gain": "yes"}.get(head["verdict"], "no" if head["verdict"] in ("small gain", "no gain", "loss", "harm")
                                  else "undecided")
    bars = {}
    for arm in ARMS:
        weak_i = Interval(**vs_grpo[arm]["weak"])
        d = ceiling_bar_interval(mine, arm, weak)
        bars[arm] = {"two_points": bar(weak_i), "ceiling": bar(weak_i, d), "d": d.as_dict()}
    controls = {name: compare(mine, mode, base, weak, strong) for name, (mode, base, _) in CONTROLS.items()}
    change = peer_change(records, partner, partner_strong, starts)
    return {"weak_family": weak, "strong_family": strong, "vs_grpo": vs_grpo, "cotrain_vs_offline": {**head, "answer": outcome},
            "bars": bars, "controls": controls, "peer_change": change.as_dict() if change else None}


def claim(answers: dict[str, dict]) -> str:
    """MUTUAL_RULE (5) for one pair's two models."""
    cotrain = [a["bars"]["cotrain"]["two_points"] for a in answers.values()]
    if "short" in cotrain:
        return "does not hold"
    if all(c == "reached" for c in cotrain):
        kept = all(a["vs_grpo"]["offline"]["weak"]["mean"] >= 0.5 * a["vs_grpo"]["cotrain"]["weak"]["mean"]
                   for a in answers.values())
        return "holds" if kept else "does not hold"
    return "undecided"


# ---- the study's report -------------------------------------------------------------------------------------------

def run_record(run: dict, families: list[str]) -> dict[str, Any]:
    """One run's entry: an RL run's (demo.report.run_record) or a ceiling's (its evaluations), with its pair, model
    and the evaluations that draw its curve."""
    steps = run["steps"]
    if run["mode"].startswith("ceiling"):
        done = json.loads((Path(run["dir"]) / "done.json").read_text())
        from demo.records import run_provenance

        record = {"name": run["name"], "mode": run["mode"], "start": run["start"], "seed": run["seed"],
                  "primary": {f: primary(done["evals"], steps, f) for f in families}, "evals": done["evals"],
                  "rows_per_step": done.get("gated_rows_per_step"), "steps_without_rows": done.get("steps_without_rows"),
                  **run_provenance(done)}
    else:
        record = rl_run_record(run, families, steps)
    return {**record, "pair": run["pair"], "model": run["model"], "lr": run["lr"]}


def write_report(plans: dict, report_dir: Path, record: dict, timings: dict, wall_time_s: float,
                 committed_pilots: Path) -> None:
    """report/mutual/<pair>/: each pair's summary.json (with its record), REPORT.md and curves; then report/mutual/
    REPORT.md, the answers of every pair whose report is there (`write_index`). A pair's report is its invocation's:
    the pairs can run apart (`--pairs`), each under the code and at the time its record names."""
    for name, plan in plans.items():
        cfg = plan.cfg
        families = list(cfg.task.n_eval)
        records = [run_record(r, families) for r in plan.runs]
        starts = {NAME[role]: {s: {k: v for k, v in info.items() if k != "checkpoint"}
                               for s, info in plan.models[role]["starts"].items()} for role in ROLES}
        answers = {NAME[role]: answer(records, NAME[role], NAME[OTHER[role]], weak_family(cfg, role), strong_family(cfg, role),
                                      strong_family(cfg, OTHER[role]), starts[NAME[OTHER[role]]]) for role in ROLES}
        pair = {
            "families": families, "models": {NAME[role]: {k: plan.models[role][k] for k in ("architecture", "parameters",
                                                                                         "vocab_size", "sft_steps")}
                                             for role in ROLES},
            "starts": starts, "stored_groups": plan.stored, "answers": answers, "claim": claim(answers),
            "runs": records, "config": cfg.model_dump(mode="json"),
        }
        pilot = committed_pilots / name / "pilot" / "summary.json"
        summary = {"study": "mutual", "record": record, "rule": MUTUAL_RULE, "rule_verdicts": VERDICT_RULE,
                   "rule_version": RULE_VERSION, "pilot_rule": PILOT_RULE, "pairs": {name: pair},
                   "pilot": {name: {k: json.loads(pilot.read_text())["pairs"][name][k] for k in ("chosen_lr", "steps", "kept")}}
                   if pilot.exists() else None,  # the committed one, which set this pair's budget
                   "job_wall_s": {k: round(v, 1) for k, v in timings.items() if k.startswith(f"{name}: ")},
                   "wall_time_s": wall_time_s}
        render(write_summary(report_dir / name, summary), report_dir / name)
    write_index(report_dir)


def render(summary: dict, pair_dir: Path) -> None:
    """A pair's REPORT.md and curves from its summary.json alone (studies.rerender calls it too)."""
    for name, pair in summary["pairs"].items():
        families = {model: (a["weak_family"], a["strong_family"]) for model, a in pair["answers"].items()}
        _curves(pair, name, pair_dir / "curves.png", families,
                {label: (lambda r, mode=mode: r["mode"] == mode) for mode, label in MODE_LABEL.items()})
    write_text_atomic(pair_dir / "REPORT.md", markdown(summary))


def write_index(report_dir: Path) -> None:
    """report/mutual/REPORT.md: the answers of every pair reported under it, each with when and where it ran."""
    summaries = [json.loads(path.read_text()) for path in sorted(report_dir.glob("*/summary.json"))]
    summaries = [s for s in summaries if s.get("study") == "mutual"]
    if not summaries:
        return
    merged = {"pairs": {name: pair for s in summaries for name, pair in s["pairs"].items()}}
    lines = ["# GRAFT mutual study: two models each strong where the other is weak", "",
             f"The rule (written before the runs; every pair's report prints it whole): {MUTUAL_RULE}.", "",
             *answer_lines(merged), ""]
    for s in summaries:
        (name, pair), = s["pairs"].items()
        record, host = s.get("record") or {}, (s.get("record") or {}).get("host", {})
        budget = s.get("pilot") or {}
        lines.append(f"- **{name}: the paper's claim {pair['claim']}.** [{name}/REPORT.md]({name}/REPORT.md): ran "
                     f"{record.get('started')} to {record.get('finished')} at commit {str(record.get('commit'))[:12]} "
                     f"({'clean' if record.get('clean') else 'tree NOT clean'}) on {host.get('cpu')}; budget "
                     + (f"lr {budget[name]['chosen_lr']:g}, {budget[name]['steps']} steps, from its pilot "
                        f"([{name}/pilot/REPORT.md]({name}/pilot/REPORT.md))" if name in budget else "not from a committed pilot"))
    write_text_atomic(report_dir / "REPORT.md", "\n".join(lines) + "\n")


def rerender(pair_dir: Path, summary: dict, stamp) -> dict:
    """A pair's report under the current rule (studies.rerender): every answer computed again from its runs; the
    index beside it again."""
    for pair in summary["pairs"].values():
        cfg = DemoConfig.model_validate(pair["config"])
        starts = pair["starts"]
        pair["answers"] = {NAME[role]: answer(pair["runs"], NAME[role], NAME[OTHER[role]], weak_family(cfg, role),
                                              strong_family(cfg, role), strong_family(cfg, OTHER[role]),
                                              starts[NAME[OTHER[role]]]) for role in ROLES}
        pair["claim"] = claim(pair["answers"])
    summary.update(rule=MUTUAL_RULE, rule_verdicts=VERDICT_RULE)
    committed = write_summary(pair_dir, stamp(summary))
    write_text_atomic(pair_dir / "REPORT.md", markdown(committed))
    write_index(pair_dir.parent)
    return committed


def _row(label: str, c: dict) -> str:
    weak_i, strong_i = Interval(**c["weak"]), Interval(**c["strong"])
    return (f"| {label} | {weak_i.pairs} | {pct(weak_i)} | {p_text(weak_i)} | {pct(strong_i)} | "
            f"**{verdict_text(c['verdict'], weak_i)}** |")


def answer_lines(summary: dict) -> list[str]:
    """The answers first: per pair and model, co-training against offline, and each arm's two bars."""
    lines = ["| pair | model (weak family) | co-training beats offline? co-training - offline [95% CI], p | GRAFT "
             "co-training - GRPO [95% CI]: 2-point bar / ceiling bar | GRAFT offline - GRPO [95% CI]: 2-point bar / "
             "ceiling bar | ceiling - GRPO [95% CI] | the peer's change over co-training (its strong family) |",
             "|---|---|---|---|---|---|---|"]
    for name, pair in summary["pairs"].items():
        for model, a in pair["answers"].items():
            head = a["cotrain_vs_offline"]
            head_i = Interval(**head["weak"])
            arms = []
            for arm in ARMS:
                weak_i = Interval(**a["vs_grpo"][arm]["weak"])
                arms.append(f"{pct(weak_i)}: **{a['bars'][arm]['two_points']}** / **{a['bars'][arm]['ceiling']}**")
            ceiling = Interval(**a["vs_grpo"]["ceiling"]["weak"])
            change = f"{pct(Interval(**a['peer_change']))}" if a["peer_change"] else "-"
            lines.append(f"| {name} | {model} (`{a['weak_family']}`) | **{head['answer']}** "
                         f"({verdict_text(head['verdict'], head_i)}): {pct(head_i)}, p {p_text(head_i)} | {arms[0]} | "
                         f"{arms[1]} | {pct(ceiling)} | {change} |")
    return lines


def markdown(summary: dict) -> str:
    lines = [f"# GRAFT mutual study, {', '.join(summary['pairs'])}: two models each strong where the other is weak", "",
             *header_lines(summary),
             f"**The verdicts' rule** ({summary['rule_version']}): {summary['rule_verdicts']}.", ""]
    if summary.get("pilot"):
        budget = "; ".join(f"{name}: lr {p['chosen_lr']:g}, {p['steps']} steps" for name, p in summary["pilot"].items())
        lines += [f"**Budget** (set by the pilot's GRPO runs before any GRAFT run, [pilot/REPORT.md](pilot/REPORT.md)): {budget}.", ""]
    lines += [*answer_lines(summary), ""]
    for name, pair in summary["pairs"].items():
        lines.append(f"**{name}: the paper's claim {pair['claim']}.**")
    lines += ["", "<!-- table-end -->", ""]
    for name, pair in summary["pairs"].items():
        cfg = pair["config"]
        lines += [f"## {name}", "",
                  f"{cfg['rl']['steps']} RL steps of {cfg['rl']['prompts_per_step']} prompts x {cfg['rl']['group_size']} "
                  f"rollouts, lr {cfg['rl']['lr']:g}, seeds {cfg['rl']['seeds']} at the starts "
                  f"{', '.join(f'{k} ({100 * v:.0f}%)' for k, v in cfg['starts'].items())} of each model's weak family.",
                  "", "| model | start | step | weak family sampled (held-out) | strong family sampled | architecture |",
                  "|---|---|---|---|---|---|"]
        for model, starts in pair["starts"].items():
            a = pair["answers"][model]
            for start, s in starts.items():
                lines.append(f"| {model} | {start} | {s['step']} | `{a['weak_family']}` {100 * s['acc_sampled'][a['weak_family']]:.1f} | "
                             f"`{a['strong_family']}` {100 * s['acc_sampled'][a['strong_family']]:.1f} | "
                             f"{pair['models'][model]['architecture']} ({pair['models'][model]['parameters']:,}) |")
        lines += ["", "Every arm against GRPO alone (the weak family's gain, the strong family's change):", "",
                  "| model: arm | pairs | weak family [95% CI] | p | strong family [95% CI] | verdict |",
                  "|---|---|---|---|---|---|"]
        for model, a in pair["answers"].items():
            for mode, c in a["vs_grpo"].items():
                lines.append(_row(f"{model}: {MODE_LABEL[mode]}", c))
        lines += ["", "The controls (read, not decided on):", "",
                  "| model: control (what the difference is) | pairs | weak family [95% CI] | p | strong family [95% CI] | label |",
                  "|---|---|---|---|---|---|"]
        for model, a in pair["answers"].items():
            for control, c in a["controls"].items():
                lines.append(_row(f"{model}: {control} ({CONTROLS[control][2]})", c))
        for key, stored in pair["stored_groups"].items():
            lines.append(f"\n{key}'s stored groups: {stored['indexed_groups']}, {stored['informative_groups']} informative, "
                         f"success rate {100 * stored['success_rate']:.1f}%.")
        lines += ["", f"![{name}: curves](curves.png)", ""]
    lines += [f"Every job's times are in `{LOCAL_FILE}` beside this file, which git ignores.", ""]
    return "\n".join(lines)


def _curves(pair: dict, name: str, path: Path, families: dict[str, tuple[str, str]], series: dict[str, Any]) -> None:
    """Absolute curves: per model and start, its weak and strong family's held-out sampled accuracy over the run from
    its start, one line per series (label -> which runs: their mean, the band their range)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(model, start) for model in pair["starts"] for start in pair["starts"][model]]
    fig, axes = plt.subplots(len(rows), 2, figsize=(11, 3.2 * len(rows)), squeeze=False)
    for row, (model, start) in enumerate(rows):
        for col, family in enumerate(families[model]):
            ax = axes[row][col]
            begin = pair["starts"][model][start]["acc_sampled"][family]
            for index, (label, wanted) in enumerate(series.items()):
                runs = [r for r in pair["runs"] if r["model"] == model and r["start"] == start and wanted(r)]
                if not runs:
                    continue
                steps = [0] + [e["step"] for e in runs[0]["evals"]]
                values = [[begin] + [e["acc_sampled"][family] for e in r["evals"]] for r in runs]
                ax.plot(steps, [100 * statistics.fmean(v[i] for v in values) for i in range(len(steps))],
                        color=f"C{index}", marker="o", markersize=3, label=label)
                ax.fill_between(steps, [100 * min(v[i] for v in values) for i in range(len(steps))],
                                [100 * max(v[i] for v in values) for i in range(len(steps))], color=f"C{index}", alpha=0.1)
            ax.set_title(f"{name}: {model} from {start}, `{family}` ({'weak' if col == 0 else 'strong'})", fontsize=9)
            ax.set_xlabel("RL step")
            ax.set_ylabel("held-out sampled accuracy (%)")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    save_fig(fig, path)
    plt.close(fig)


# ---- the pilot ----------------------------------------------------------------------------------------------------

def pilot_choice(records: list[dict], starts: dict[str, dict[str, dict]], strong: dict[str, str], weak: dict[str, str]) -> dict:
    """PILOT_RULE on one pair's pilot runs: per lr, whether it keeps the strong families and its mean weak-family gain
    curve; the chosen lr and run length."""
    rows = []
    for lr in PILOT_LRS:
        runs = [r for r in records if r["lr"] == lr]
        if not runs:
            continue

        def start_of(r: dict, family: str) -> float:
            return starts[r["model"]][r["start"]]["acc_sampled"][family]

        kept = all(r["primary"][strong[r["model"]]] >= start_of(r, strong[r["model"]]) - STRONG_MARGIN for r in runs)
        gain = statistics.fmean(r["primary"][weak[r["model"]]] - start_of(r, weak[r["model"]]) for r in runs)
        steps = [e["step"] for e in runs[0]["evals"]]
        curve = [statistics.fmean(r["evals"][i]["acc_sampled"][weak[r["model"]]] - start_of(r, weak[r["model"]])
                                  for r in runs) for i in range(len(steps))]
        rows.append({"lr": lr, "kept": kept, "weak_gain": gain, "steps": steps, "gain_curve": curve,
                     "strong_change": {f"{r['model']} {r['start']}": r["primary"][strong[r["model"]]] - start_of(r, strong[r["model"]])
                                       for r in runs}})
    kept = [row for row in rows if row["kept"]]
    chosen = max(kept, key=lambda row: row["weak_gain"]) if kept else min(rows, key=lambda row: row["lr"])
    best = max(chosen["gain_curve"])
    length = next((s for s, g in zip(chosen["steps"], chosen["gain_curve"])
                   if s >= PILOT_MIN_STEPS and best > 0 and g >= PILOT_SHARE * best), chosen["steps"][-1])
    return {"rows": rows, "kept": bool(kept), "chosen_lr": chosen["lr"], "steps": length}


def write_pilot(plans: dict, report_dir: Path, record: dict, timings: dict, wall_time_s: float) -> dict:
    """report/mutual/<pair>/pilot/: PILOT_RULE's choice for each pair, its runs and curves, with its record."""
    results = {}
    for name, plan in plans.items():
        cfg = plan.cfg
        out = report_dir / name / "pilot"
        out.mkdir(parents=True, exist_ok=True)
        families = list(cfg.task.n_eval)
        records = [run_record(r, families) for r in plan.runs]
        starts = {NAME[role]: plan.models[role]["starts"] for role in ROLES}
        strong = {NAME[role]: strong_family(cfg, role) for role in ROLES}
        weak = {NAME[role]: weak_family(cfg, role) for role in ROLES}
        pair = {**pilot_choice(records, starts, strong, weak), "weak_family": weak, "strong_family": strong,
                "starts": {m: {s: {k: v for k, v in info.items() if k != "checkpoint"} for s, info in ss.items()}
                           for m, ss in starts.items()},
                "runs": records, "config": cfg.model_dump(mode="json")}
        _curves(pair, name, out / "pilot.png", {m: (weak[m], strong[m]) for m in weak},
                {f"GRPO, lr {lr:g}": (lambda r, lr=lr: r["lr"] == lr) for lr in PILOT_LRS})
        result = {"study": "mutual-pilot", "record": record, "rule": PILOT_RULE, "rule_version": RULE_VERSION,
                  "pairs": {name: pair}, "job_wall_s": {k: round(v, 1) for k, v in timings.items() if k.startswith(f"{name}: ")},
                  "wall_time_s": wall_time_s}
        committed = write_summary(out, result)
        write_text_atomic(out / "REPORT.md", "# The mutual study's budget pilot\n\n" + "\n".join(pilot_lines(committed)) + "\n")
        results[name] = committed
    return results


def pilot_lines(result: dict) -> list[str]:
    lines = [*header_lines(result), "",
             "| pair | lr | strong families kept (each run's change, points) | weak-family gain over the start (mean of 4 "
             "runs, second half) | mean weak-family gain at each evaluation |", "|---|---|---|---|---|"]
    for name, pair in result["pairs"].items():
        for row in pair["rows"]:
            changes = ", ".join(f"{k} {100 * v:+.1f}" for k, v in row["strong_change"].items())
            curve = " ".join(f"{s}:{100 * g:+.1f}" for s, g in zip(row["steps"], row["gain_curve"]))
            lines.append(f"| {name} | {row['lr']:g} | {'yes' if row['kept'] else 'no'} ({changes}) | "
                         f"{100 * row['weak_gain']:+.1f} | {curve} |")
    lines.append("")
    for name, pair in result["pairs"].items():
        lines.append(f"**{name}: lr {pair['chosen_lr']:g}, {pair['steps']} steps**"
                     + ("" if pair["kept"] else " (no lr kept the strong families: the smallest, said)") + "; "
                     f"![{name}](pilot.png)")
    return lines
