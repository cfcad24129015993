"""report/mutual/: summary.json, REPORT.md (the table first) and the plots of `make demo-mutual`.

Every number is read from the runs' metrics.jsonl and evaluations; the verdict applies the rule written in
VERDICT_RULE (issue 27, from the paper's claim) to them, and the recommendation the rule in RECOMMENDATION_RULE,
both fixed before any run was looked at.
"""

from __future__ import annotations

import json
import statistics
import textwrap
from pathlib import Path
from typing import Any

from demo.config import DemoConfig
from demo.report import _finite_mean, _save_fig, _std
from demo.report import run_record as report_run_record
from rollouts.files import write_text_atomic

MIN_GAIN = 0.02  # the paper's claim, as the issue states it: each model gains >= 2 points over its GRPO run
MOST = 0.5  # "offline keeps most of co-training's gain": at least half of it
VERDICT_RULE = (f"co-training helps both models when each model's paired gain over its own GRPO run, on its mean over the "
                f"families, is at least +{100 * MIN_GAIN:.0f} points and larger than that gain's spread over seeds (its "
                f"standard deviation); offline keeps most of it when each model's offline gain is at least "
                f"{100 * MOST:.0f}% of its gain from co-training with the spec's GRAFT")
RECOMMENDATION_RULE = ("the co-training GRAFT with the largest gain of the worse-off model (the smaller of A's and B's "
                       "paired gains on the mean over families); none when no variant gives both models a gain")
MODE_LABEL = {
    "grpo": "GRPO alone",
    "cotrain_graft": "co-training, GRAFT (spec defaults)",
    "cotrain_graft_b1": "co-training, GRAFT with b = 1",
    "cotrain_graft_fix": "co-training, changed GRAFT",
    "offline": "offline from the other's stored groups (spec defaults)",
}


def _stat(values: list[float]) -> dict[str, float | int]:
    return {"mean": statistics.fmean(values), "std": _std(values), "n": len(values)}


def run_record(run: dict, families: list[str]) -> dict[str, Any]:
    """One model's run: demo.report's record of it (accuracy at every evaluation, compute), and which model it is."""
    return {**report_run_record(run, families), "model": run["model"]}


def per_model(records: list[dict], families: list[str]) -> dict[str, dict[str, dict]]:
    """{model: {mode: accuracy per family and on the mean (mean, std over seeds), the paired gain over the model's GRPO
    run of the same seed, and compute}}."""
    out: dict[str, dict[str, dict]] = {}
    for model in sorted({r["model"] for r in records}):
        mine = [r for r in records if r["model"] == model]
        grpo = {r["seed"]: r for r in mine if r["mode"] == "grpo"}
        out[model] = {}
        for mode in [m for m in MODE_LABEL if any(r["mode"] == m for r in mine)] + sorted({r["mode"] for r in mine} - set(MODE_LABEL)):
            rows = sorted((r for r in mine if r["mode"] == mode), key=lambda r: r["seed"])
            entry: dict[str, Any] = {
                "seeds": [r["seed"] for r in rows],
                "acc": {f: _stat([r["acc_by_family"][f] for r in rows]) for f in families},
                "mean": _stat([r["acc_mean"] for r in rows]),
                "rollouts_generated": statistics.fmean(r["rollouts_generated"] for r in rows),
                "peer_rollouts_consumed": statistics.fmean(r["peer_rollouts_consumed"] for r in rows),
                "frac_grafted": _finite_mean([r["frac_grafted_mean"] for r in rows]),
                "cpu_s": _finite_mean([r["cpu_s"] for r in rows]),
            }
            paired = [r for r in rows if r["seed"] in grpo]
            if mode != "grpo" and paired:
                entry["gain"] = {"mean": _stat([r["acc_mean"] - grpo[r["seed"]]["acc_mean"] for r in paired]),
                                 **{f: _stat([r["acc_by_family"][f] - grpo[r["seed"]]["acc_by_family"][f] for r in paired]) for f in families}}
            out[model][mode] = entry
    return out


def verdict(models: dict[str, dict[str, dict]]) -> dict[str, Any]:
    """VERDICT_RULE applied to every co-training variant and to the offline runs, and RECOMMENDATION_RULE."""
    result: dict[str, Any] = {"rule": VERDICT_RULE, "cotrain": {}, "offline_keeps_most": {}}
    names = sorted(models)
    for mode in sorted({m for per in models.values() for m in per if m.startswith("cotrain_")}):
        gains = {name: models[name][mode]["gain"]["mean"] for name in names if "gain" in models[name].get(mode, {})}
        if len(gains) < len(names):
            continue
        checks = {
            "each_gains_at_least_2_points": all(g["mean"] >= MIN_GAIN for g in gains.values()),
            "each_gain_larger_than_seed_spread": all(g["mean"] > g["std"] for g in gains.values()),
        }
        result["cotrain"][mode] = {"gain_mean": {n: g["mean"] for n, g in gains.items()}, "gain_std": {n: g["std"] for n, g in gains.items()},
                                   **checks, "holds": all(checks.values())}
    for name in names:
        offline, cotrain = models[name].get("offline", {}).get("gain"), models[name].get("cotrain_graft", {}).get("gain")
        if offline is None or cotrain is None:
            continue
        kept = cotrain["mean"]["mean"]
        entry = {"offline_gain": offline["mean"]["mean"], "cotrain_gain": kept}
        if kept <= 0:
            entry.update(share=None, holds=None, why="co-training with the spec's GRAFT gained nothing over GRPO: nothing to keep")
        else:
            entry.update(share=offline["mean"]["mean"] / kept, holds=offline["mean"]["mean"] >= MOST * kept)
        result["offline_keeps_most"][name] = entry
    worse_off = {mode: min(v["gain_mean"].values()) for mode, v in result["cotrain"].items()}
    best = max(worse_off, key=worse_off.get) if worse_off else None
    result["recommendation"] = {"rule": RECOMMENDATION_RULE, "worse_off_gain": worse_off,
                                "chosen": best if best is not None and worse_off[best] > 0 else None}
    return result


def write_report(cfg: DemoConfig, models: dict, runs: list[dict], stored: dict, timings: dict, wall_time_s: float) -> dict:
    families = list(cfg.task.n_eval)
    records = [run_record(run, families) for run in runs]
    by_model = per_model(records, families)
    strong = {"A": cfg.task.strong_family, "B": cfg.task.weak_family}
    start = {}
    for role, name in (("learner", "A"), ("peer", "B")):
        info = models[role]
        start[name] = {"architecture": info["architecture"], "parameters": info["parameters"], "vocab_size": info["vocab_size"],
                       "sft_steps": info["sft_steps"], "acc_greedy": info["acc_greedy"], "acc_sampled": info["acc_sampled"],
                       "acc_mean": sum(info["acc_greedy"][f] for f in families) / len(families)}
    summary = {
        "families": families,
        "strong_family": strong,
        "start": start,
        "start_mean_difference": start["A"]["acc_mean"] - start["B"]["acc_mean"],
        "stored_groups": {("A" if role == "learner" else "B"): v for role, v in stored.items()},
        "per_model": by_model,
        "verdict": verdict(by_model),
        "runs": records,
        "job_wall_s": {k: round(v, 1) for k, v in timings.items()},
        "wall_time_s": wall_time_s,
        "config": cfg.model_dump(mode="json"),
    }
    report_dir = cfg.report_dir
    report_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(report_dir / "summary.json", json.dumps(summary, indent=2))
    _plots(summary, report_dir)
    write_text_atomic(report_dir / "REPORT.md", markdown(summary))
    return summary


def _pct(stat: dict | None, signed: bool = False) -> str:
    if not stat:
        return "-"
    mean = f"{100 * stat['mean']:+.1f}" if signed else f"{100 * stat['mean']:.1f}"
    return f"{mean} ± {100 * stat['std']:.1f}" if stat.get("n", 1) > 1 else mean


def markdown(summary: dict) -> str:
    families, strong = summary["families"], summary["strong_family"]
    cfg = summary["config"]
    seeds = cfg["rl"]["seeds"]
    lines = [
        "# GRAFT mutual demo: two models, each strong where the other is weak",
        "",
        f"Held-out greedy accuracy (%) after {cfg['rl']['steps']} RL steps, mean ± std over seeds {seeds}; gain: paired "
        f"over the same model's GRPO run of the same seed, on the mean over {', '.join(families)}. Every run of a model "
        f"generates the same rollouts ({cfg['rl']['prompts_per_step']} prompts x {cfg['rl']['group_size']} per step).",
        "",
    ]
    for name in sorted(summary["per_model"]):
        cells = [f"{f} (strong)" if f == strong[name] else f for f in families]
        header = "| model | run | " + " | ".join(cells) + " | mean | gain (paired) | rollouts generated | peer rollouts consumed |"
        lines += [header, "|" + "---|" * (len(families) + 6)]
        s = summary["start"][name]
        lines.append(f"| {name} | warm start | " + " | ".join(f"{100 * s['acc_greedy'][f]:.1f}" for f in families)
                     + f" | {100 * s['acc_mean']:.1f} | | | |")
        for mode, entry in summary["per_model"][name].items():
            gain = entry.get("gain", {}).get("mean")
            lines.append(f"| {name} | {MODE_LABEL.get(mode, mode)} | " + " | ".join(_pct(entry["acc"][f]) for f in families)
                         + f" | {_pct(entry['mean'])} | {_pct(gain, signed=True)} | {entry['rollouts_generated']:,.0f} | "
                         f"{entry['peer_rollouts_consumed']:,.0f} |")
        lines.append("")
    lines.append("<!-- table-end -->")
    v = summary["verdict"]
    lines += ["", "## Verdict", "", f"Rule (fixed before the runs): {v['rule']}.", ""]
    for mode, entry in v["cotrain"].items():
        gains = ", ".join(f"{n} {100 * entry['gain_mean'][n]:+.1f} ± {100 * entry['gain_std'][n]:.1f}" for n in sorted(entry["gain_mean"]))
        lines.append(f"- {MODE_LABEL.get(mode, mode)}: gains {gains}: **{'holds' if entry['holds'] else 'does not hold'}**"
                     f" (each >= +{100 * MIN_GAIN:.0f}: {entry['each_gains_at_least_2_points']}; each above its seed spread: "
                     f"{entry['each_gain_larger_than_seed_spread']}).")
    for name, entry in v["offline_keeps_most"].items():
        if entry["holds"] is None:
            lines.append(f"- offline, {name}: {100 * entry['offline_gain']:+.1f} points; {entry['why']}.")
        else:
            lines.append(f"- offline, {name}: {100 * entry['offline_gain']:+.1f} points against co-training's "
                         f"{100 * entry['cotrain_gain']:+.1f} ({100 * entry['share']:.0f}%): offline keeps most: "
                         f"**{'yes' if entry['holds'] else 'no'}**.")
    rec = v["recommendation"]
    chosen = MODE_LABEL.get(rec["chosen"], rec["chosen"]) if rec["chosen"] else "none"
    lines += ["", f"Recommendation, by the rule fixed before the runs ({rec['rule']}): **{chosen}**.", ""]
    start = summary["start"]
    lines += [
        "## The pair",
        "",
        f"- A: {start['A']['architecture']}, {start['A']['parameters']:,} parameters, vocabulary {start['A']['vocab_size']}, "
        f"warm start {start['A']['sft_steps']} steps, strong on {strong['A']}.",
        f"- B: {start['B']['architecture']}, {start['B']['parameters']:,} parameters, vocabulary {start['B']['vocab_size']}, "
        f"warm start {start['B']['sft_steps']} steps, strong on {strong['B']}.",
        f"- Mean over the families at the start: A {100 * start['A']['acc_mean']:.1f}, B {100 * start['B']['acc_mean']:.1f} "
        f"(difference {100 * summary['start_mean_difference']:+.1f} points).",
    ]
    for name, stored in summary["stored_groups"].items():
        lines.append(f"- {name}'s stored groups (its warm start, before any training): {stored['indexed_groups']} groups, "
                     f"{stored['informative_groups']} informative, success rate {100 * stored['success_rate']:.1f}%.")
    lines += ["", "![accuracy per family and step](accuracy_vs_step.png)", "", "![gain over GRPO](gain_over_grpo.png)", "",
              f"Wall time {summary['wall_time_s']:.0f} s.", ""]
    return "\n".join(lines)


def _plots(summary: dict, report_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families, records = summary["families"], summary["runs"]
    names = sorted(summary["per_model"])
    modes = list(MODE_LABEL) + sorted({r["mode"] for r in records} - set(MODE_LABEL))
    colors = {mode: plt.get_cmap("tab10")(i % 10) for i, mode in enumerate(modes)}
    fig, axes = plt.subplots(len(names), len(families), figsize=(4.2 * len(families), 3.6 * len(names)), squeeze=False)
    for row, name in enumerate(names):
        for col, family in enumerate(families):
            ax = axes[row][col]
            for mode in modes:
                runs = [r for r in records if r["model"] == name and r["mode"] == mode]
                if not runs:
                    continue
                # step 0 is the model's warm start, the same for each of its runs (the runs evaluate their checkpoints)
                begin = {"step": 0, **summary["start"][name]["acc_greedy"]}
                by_step = [{0: begin} | {e["step"]: e for e in r["acc_by_step"]} for r in runs]
                steps = sorted(set.intersection(*(set(b) for b in by_step)))  # the evaluations every seed has
                per_step = [[100 * b[step][family] for b in by_step] for step in steps]
                mean = [statistics.fmean(v) for v in per_step]
                spread = [_std(v) for v in per_step]
                ax.plot(steps, mean, color=colors[mode], marker="o", markersize=3, label=MODE_LABEL.get(mode, mode))
                ax.fill_between(steps, [m - s for m, s in zip(mean, spread)], [m + s for m, s in zip(mean, spread)], color=colors[mode], alpha=0.15)
            kind = "strong" if family == summary["strong_family"][name] else ("weak" if family in summary["strong_family"].values() else "shared")
            ax.set_title(f"model {name}, {family} ({kind})", fontsize=10)
            ax.set_xlabel("RL step")
            ax.set_ylabel("held-out greedy accuracy (%)")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    _save_fig(fig, report_dir / "accuracy_vs_step.png")
    plt.close(fig)

    shown = [m for m in modes if m != "grpo" and any("gain" in summary["per_model"][n].get(m, {}) for n in names)]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        gains = [summary["per_model"][name].get(m, {}).get("gain", {}).get("mean") for m in shown]
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(shown))]
        ax.bar(xs, [100 * g["mean"] if g else 0 for g in gains], width, yerr=[100 * g["std"] if g else 0 for g in gains],
               capsize=3, label=f"model {name}")
    ax.axhline(100 * MIN_GAIN, color="grey", linestyle="--", linewidth=1, label=f"+{100 * MIN_GAIN:.0f} points (the claim)")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(shown)))
    ax.set_xticklabels([textwrap.fill(MODE_LABEL.get(m, m), 24) for m in shown], fontsize=8)
    ax.set_ylabel("gain over the model's GRPO (points, mean over families)")
    ax.set_title("paired gain over GRPO, mean ± std over seeds")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    _save_fig(fig, report_dir / "gain_over_grpo.png")
    plt.close(fig)
