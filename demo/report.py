"""report/: summary.json, REPORT.md (the table first) and the plots, from what the runs wrote.

Nothing here is tuned: every number is read from the runs' metrics.jsonl and evaluation results.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path
from typing import Any

import orjson

from demo.config import PEER_MODEL_ID, DemoConfig
from rollouts.files import write_text_atomic

MODE_ORDER = ["grpo", "graft", "graft_cotrain", "graft_fix", "graft_no_peer_neg", "graft_no_seq_weight", "graft_no_token_is",
              "graft_fix_with_b", "graft_fix_with_neg", "graft_fix_x1"]
MODE_LABEL = {
    "grpo": "GRPO",
    "graft": "GRAFT offline (spec defaults)",
    "graft_cotrain": "GRAFT co-training",
    "graft_no_peer_neg": "GRAFT, peer negatives x0",
    "graft_no_seq_weight": "GRAFT, no sequence weight (w = 1)",
    "graft_no_token_is": "GRAFT, no token-level IS (b = 1)",
    "graft_fix": "GRAFT changed: LUFFY shaping (w = 1), peer negatives x0, peer rows x4",
    "graft_fix_with_b": "GRAFT changed, with the spec's b instead of LUFFY",
    "graft_fix_with_neg": "GRAFT changed, with peer negatives",
    "graft_fix_x1": "GRAFT changed, peer rows x1",
}
# Each ablation is compared with the method it changes one thing of.
ABLATION_BASE = {"graft_no_": "graft", "graft_fix_": "graft_fix"}
STRONG_TOLERANCE = 0.02  # "without losing the strong family": GRAFT's strong accuracy at most 2 points under GRPO's


def _finite_mean(values: list[float]) -> float | None:
    kept = [v for v in values if v is not None and isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(kept) / len(kept) if kept else None


def _std(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "train" / "metrics.jsonl"
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def run_record(run: dict, families: list[str]) -> dict[str, Any]:
    """One run's entry of summary.json."""
    run_dir = Path(run["dir"])
    done = json.loads((run_dir / "done.json").read_text())
    metrics = read_metrics(run_dir)
    final = done["evals"][-1]["acc_greedy"]
    record: dict[str, Any] = {
        "name": run["name"],
        "mode": run["mode"],
        "seed": run["seed"],
        "acc_by_family": final,
        "acc_mean": sum(final[f] for f in families) / len(families),
        "acc_sampled_by_family": done["final_acc_sampled"],
        "frac_all_fail_mean": _finite_mean([m["frac_all_fail"] for m in metrics]),
        "peer_hit_rate_mean": _finite_mean([m["peer_hit_rate"] for m in metrics]),
        "frac_grafted_mean": _finite_mean([m["frac_grafted"] for m in metrics]),
        "rollouts_generated": int(sum(m["rollouts_generated"] for m in metrics)),
        "peer_rollouts_consumed": int(sum(m["peer_rollouts_consumed"] for m in metrics)),
        "compat_weight_mean": _finite_mean([m["compat_weight_mean"] for m in metrics]),
        "behaviour_ratio_p50_mean": _finite_mean([m.get("behaviour_ratio_p50") for m in metrics]),
        "behaviour_ratio_hardest_p50_mean": _finite_mean([m.get("behaviour_ratio_hardest_p50") for m in metrics]),
        "log_rho_p50_mean": _finite_mean([m["log_rho_p50"] for m in metrics]),
        "frac_dropped_retokenize_mean": _finite_mean([m["frac_dropped_retokenize"] for m in metrics]),
        "store_wait_s_total": float(sum(m.get("store_wait_s", 0.0) for m in metrics)),
        "steps": len(metrics),
        "train_s": done["train_s"],
        "cpu_s": done.get("cpu_s"),
        "acc_by_step": [{"step": e["step"], **e["acc_greedy"]} for e in done["evals"]],
        "frac_all_fail_by_step": [m["frac_all_fail"] for m in metrics],
        "frac_grafted_by_step": [m["frac_grafted"] for m in metrics],
    }
    if run.get("peer_dir"):
        peer_dir = Path(run["peer_dir"])
        peer_done = json.loads((peer_dir / "done.json").read_text())
        peer_metrics = read_metrics(peer_dir)
        record["cotrain_peer"] = {
            "acc_by_family": peer_done["evals"][-1]["acc_greedy"],
            "acc_by_step": [{"step": e["step"], **e["acc_greedy"]} for e in peer_done["evals"]],  # its checkpoints
            "frac_all_fail_mean": _finite_mean([m["frac_all_fail"] for m in peer_metrics]),
            "peer_hit_rate_mean": _finite_mean([m["peer_hit_rate"] for m in peer_metrics]),
            "frac_grafted_mean": _finite_mean([m["frac_grafted"] for m in peer_metrics]),
            "rollouts_generated": int(sum(m["rollouts_generated"] for m in peer_metrics)),
            "peer_rollouts_consumed": int(sum(m["peer_rollouts_consumed"] for m in peer_metrics)),
            "cpu_s": peer_done.get("cpu_s"),
        }
    return record


def aggregate(records: list[dict], weak: str, strong: str) -> dict[str, dict]:
    by_mode: dict[str, list[dict]] = {}
    for r in records:
        by_mode.setdefault(r["mode"], []).append(r)
    out = {}
    for mode, rs in by_mode.items():
        weak_acc = [r["acc_by_family"][weak] for r in rs]
        strong_acc = [r["acc_by_family"][strong] for r in rs]
        weak_sampled = [r["acc_sampled_by_family"][weak] for r in rs]
        out[mode] = {
            "seeds": [r["seed"] for r in rs],
            "weak_mean": statistics.fmean(weak_acc), "weak_std": _std(weak_acc),
            "strong_mean": statistics.fmean(strong_acc), "strong_std": _std(strong_acc),
            "weak_sampled_mean": statistics.fmean(weak_sampled), "weak_sampled_std": _std(weak_sampled),
            "acc_mean": statistics.fmean(r["acc_mean"] for r in rs),
            "frac_all_fail_mean": _finite_mean([r["frac_all_fail_mean"] for r in rs]),
            "peer_hit_rate_mean": _finite_mean([r["peer_hit_rate_mean"] for r in rs]),
            "frac_grafted_mean": _finite_mean([r["frac_grafted_mean"] for r in rs]),
            "compat_weight_mean": _finite_mean([r["compat_weight_mean"] for r in rs]),
            "behaviour_ratio_p50_mean": _finite_mean([r["behaviour_ratio_p50_mean"] for r in rs]),
            "behaviour_ratio_hardest_p50_mean": _finite_mean([r["behaviour_ratio_hardest_p50_mean"] for r in rs]),
            "log_rho_p50_mean": _finite_mean([r["log_rho_p50_mean"] for r in rs]),
            "rollouts_generated_mean": statistics.fmean(r["rollouts_generated"] for r in rs),
            "peer_rollouts_consumed_mean": statistics.fmean(r["peer_rollouts_consumed"] for r in rs),
        }
    return out


def paired_difference(records: list[dict], mode: str, baseline: str, family: str) -> tuple[float | None, float | None, int]:
    """Mean and std over seeds of (mode - baseline) accuracy on `family`, paired by seed."""
    base = {r["seed"]: r["acc_by_family"][family] for r in records if r["mode"] == baseline}
    diffs = [r["acc_by_family"][family] - base[r["seed"]] for r in records if r["mode"] == mode and r["seed"] in base]
    if not diffs:
        return None, None, 0
    return statistics.fmean(diffs), _std(diffs), len(diffs)


def target_check(records: list[dict], per_mode: dict, mode: str, weak: str, strong: str) -> tuple[dict[str, bool], float]:
    """The issue's target for `mode` against GRPO: >= 5 points on the weak family (mean over paired seeds), more than
    the spread between seeds, the strong family kept within STRONG_TOLERANCE. Returns (criteria with `met`, spread)."""
    diff, diff_std, _ = paired_difference(records, mode, "grpo", weak)
    strong_diff, _, _ = paired_difference(records, mode, "grpo", strong)
    spread = max(per_mode.get("grpo", {}).get("weak_std", 0.0), per_mode.get(mode, {}).get("weak_std", 0.0), diff_std or 0.0)
    target = {
        "graft_minus_grpo_weak_at_least_5_points": diff is not None and diff >= 0.05,
        "larger_than_seed_spread": diff is not None and diff > spread,
        "strong_family_kept": strong_diff is not None and strong_diff >= -STRONG_TOLERANCE,
    }
    target["met"] = all(target.values())
    return target, spread


def write_report(cfg: DemoConfig, models: dict, runs: list[dict], data: dict, store_stats: dict, timings: dict,
                 wall_time_s: float, server_stopped: bool, store_root: Path) -> dict:
    weak, strong = cfg.task.weak_family, cfg.task.strong_family
    families = list(cfg.task.n_eval)
    records = [run_record(r, families) for r in runs if r["mode"] != "peer_imitation"]
    imitation = [{"seed": r["seed"], **json.loads((Path(r["dir"]) / "done.json").read_text())} for r in runs if r["mode"] == "peer_imitation"]
    per_mode = aggregate(records, weak, strong)
    diff, diff_std, n_pairs = paired_difference(records, "graft", "grpo", weak)
    strong_diff, _, _ = paired_difference(records, "graft", "grpo", strong)
    target, spread = target_check(records, per_mode, "graft", weak, strong)
    peer_groups_done = store_root / f"groups-done-{PEER_MODEL_ID}.json"
    summary = {
        "runs": records,
        "graft_minus_grpo_weak_family": diff,
        "graft_minus_grpo_weak_family_std": diff_std,
        "graft_minus_grpo_strong_family": strong_diff,
        "paired_seeds": n_pairs,
        "variants_minus_grpo_weak_family": {
            mode: dict(zip(("mean", "std", "paired_seeds"), paired_difference(records, mode, "grpo", weak)))
            for mode in cfg.rl.variants
        },
        "variants_minus_grpo_strong_family": {mode: paired_difference(records, mode, "grpo", strong)[0] for mode in cfg.rl.variants},
        "variants_target": {mode: target_check(records, per_mode, mode, weak, strong)[0] for mode in cfg.rl.variants},
        "seed_spread_weak_family": spread,
        "target": target,
        "per_mode": per_mode,
        "peer_imitation": imitation,
        "start": {"acc_greedy": models["learner"]["acc_greedy"], "acc_sampled": models["learner"]["acc_sampled"]},
        "models": {role: {k: v for k, v in info.items() if k != "checkpoint"} for role, info in models.items()},
        "peer_groups": json.loads(peer_groups_done.read_text()) if peer_groups_done.exists() else None,
        "store_stats": store_stats,
        "server_stopped": server_stopped,
        "job_wall_s": {k: round(v, 1) for k, v in timings.items()},
        "wall_time_s": wall_time_s,
        "weak_family": weak,
        "strong_family": strong,
        "config": cfg.model_dump(mode="json"),
    }
    report_dir = cfg.report_dir
    report_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(report_dir / "summary.json", json.dumps(summary, indent=2, default=str))
    _plots(records, report_dir, weak, strong, models)
    write_text_atomic(report_dir / "REPORT.md", markdown(summary, cfg))
    return summary


def _pct(x: float | None, std: float | None = None) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.1f}" if std is None else f"{100 * x:.1f} ± {100 * std:.1f}"


def _num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(summary: dict, cfg: DemoConfig) -> str:
    weak, strong = summary["weak_family"], summary["strong_family"]
    per_mode = summary["per_mode"]
    start = summary["start"]
    modes = MODE_ORDER + sorted(set(per_mode) - set(MODE_ORDER))
    lines = [
        f"# GRAFT CPU demo ({cfg.mode})",
        "",
        f"Learner: {summary['models']['learner']['architecture']} ({summary['models']['learner']['parameters']:,} parameters, "
        f"character-level tokenizer); peer: {summary['models']['peer']['architecture']} ({summary['models']['peer']['parameters']:,} "
        f"parameters, byte-level BPE). Weak family `{weak}` (3-digit + 2-digit), strong family `{strong}` (2-digit + 2-digit). "
        f"{cfg.rl.steps} RL steps of {cfg.rl.prompts_per_step} prompts x {cfg.rl.group_size} rollouts; held-out greedy accuracy "
        f"(mean ± std over seeds) at the last step; sampled = one sample at T=1.",
        "",
        f"| run | seeds | {weak} (weak) | {strong} (strong) | {weak} sampled | all-fail frac | peer hit rate | grafted frac | rollouts generated | peer rollouts consumed |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| start (SFT learner) | - | {_pct(start['acc_greedy'][weak])} | {_pct(start['acc_greedy'][strong])} | {_pct(start['acc_sampled'][weak])} | - | - | - | - | - |",
    ]
    for mode in modes:
        if mode not in per_mode:
            continue
        m = per_mode[mode]
        lines.append(
            f"| {MODE_LABEL.get(mode, mode)} | {len(m['seeds'])} | {_pct(m['weak_mean'], m['weak_std'])} | {_pct(m['strong_mean'], m['strong_std'])} | "
            f"{_pct(m['weak_sampled_mean'], m['weak_sampled_std'])} | {_num(m['frac_all_fail_mean'])} | {_num(m['peer_hit_rate_mean'])} | "
            f"{_num(m['frac_grafted_mean'])} | {m['rollouts_generated_mean']:.0f} | {m['peer_rollouts_consumed_mean']:.0f} |"
        )
    diff, diff_std = summary["graft_minus_grpo_weak_family"], summary["graft_minus_grpo_weak_family_std"]
    target = summary["target"]
    lines += [
        "",
        f"GRAFT (spec defaults) minus GRPO on `{weak}`: **{_pct(diff)} points** (std over {summary['paired_seeds']} paired seeds "
        f"{_pct(diff_std)}); on `{strong}`: {_pct(summary['graft_minus_grpo_strong_family'])} points. "
        f"Target (>= 5 points, larger than the seed spread {_pct(summary['seed_spread_weak_family'])}, strong family kept within "
        f"{100 * STRONG_TOLERANCE:.0f} points): **{'met' if target['met'] else 'not met'}** "
        f"({', '.join(f'{k}: {v}' for k, v in target.items() if k != 'met')}).",
    ]
    for mode, d in summary["variants_minus_grpo_weak_family"].items():
        met = summary["variants_target"][mode]["met"]
        lines.append(f"{MODE_LABEL.get(mode, mode)} (not the spec's defaults: `{' '.join(cfg.rl.variants[mode])}`) minus GRPO on "
                     f"`{weak}`: **{_pct(d['mean'])} points** (std over {d['paired_seeds']} paired seeds {_pct(d['std'])}); on "
                     f"`{strong}`: {_pct(summary['variants_minus_grpo_strong_family'][mode])} points. The same target with this "
                     f"method: **{'met' if met else 'not met'}**.")
    lines += [
        f"Wall time {summary['wall_time_s']:.0f} s.",
        "",
        "<!-- table-end -->",
        "",
        "![accuracy vs step](accuracy_vs_step.png)",
        "![all-fail fraction vs step](all_fail_vs_step.png)",
        "",
        "## Models (warm start)",
        "",
        "| model | architecture | parameters | vocab | `\\boxed{1046}` tokenised | SFT steps | SFT s | greedy " + " / ".join(summary["models"]["learner"]["acc_greedy"]) + " | sampled |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for role, info in summary["models"].items():
        lines.append(
            f"| {role} | {info['architecture']} | {info['parameters']:,} | {info['vocab_size']} | `{' '.join(info['tokenizer_tokens_of_example'])}` | "
            f"{info['sft_steps']} | {info['sft_s']:.0f} | {' / '.join(_pct(a) for a in info['acc_greedy'].values())} | "
            f"{' / '.join(_pct(a) for a in info['acc_sampled'].values())} |"
        )
    pg = summary["peer_groups"]
    if pg:
        lines += [
            "",
            f"Peer groups in the store: {pg['indexed_groups']} groups ({pg['rollouts']} rollouts) written by `graft-generate` in "
            f"{pg['wall_s']:.0f} s; {pg['informative_groups']} informative ({pg['informative_groups'] / max(1, pg['indexed_groups']):.0%}); "
            f"peer success rate {_pct(pg['success_rate'])}%.",
        ]
    lines += [
        "",
        "## Why: the grafting metrics",
        "",
        "b = min(pi_old / mu~, 2) is the token-level behaviour ratio; 'at the hardest token' is its median, over the peer's correct "
        "answers, at the token the learner found least likely: where the peer's answer departs from the learner's habit.",
        "",
        "| run | compat weight w (mean) | log rho per byte (median) | b (median) | b at the hardest token (median) | all-fail frac | grafted frac | peer rollouts consumed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode in modes:
        if mode in per_mode and mode != "grpo":
            m = per_mode[mode]
            lines.append(f"| {MODE_LABEL.get(mode, mode)} | {_num(m['compat_weight_mean'])} | {_num(m['log_rho_p50_mean'])} | "
                         f"{_num(m['behaviour_ratio_p50_mean'])} | {_num(m['behaviour_ratio_hardest_p50_mean'])} | "
                         f"{_num(m['frac_all_fail_mean'])} | {_num(m['frac_grafted_mean'])} | {m['peer_rollouts_consumed_mean']:.0f} |")
    for run in summary["peer_imitation"]:
        lines += ["", f"- The ceiling (seed {run['seed']}): supervised training on the peer's correct `{weak}` answers from the store "
                  f"({run['examples_per_step']} per update at full weight, drawn from {run['peer_correct_answers']}), with the RL runs' "
                  f"optimizer, lr, {run['steps']} updates and anchor, reaches `{weak}` {_pct(run['acc_greedy'][weak])} "
                  f"(sampled {_pct(run['acc_sampled'][weak])}) and `{strong}` {_pct(run['acc_greedy'][strong])}, from "
                  f"{_pct(start['acc_greedy'][weak])} / {_pct(start['acc_greedy'][strong])}. No way of consuming the peer's groups "
                  f"with this budget of updates can be expected to gain much more than this on `{weak}`."]
    for mode in modes:
        if mode in per_mode and mode != "graft":
            d, s, n = paired_difference(summary["runs"], mode, "grpo" if mode != "grpo" else "graft", weak)
            if mode == "grpo":
                continue
            line = f"- {MODE_LABEL.get(mode, mode)} minus GRPO on `{weak}`: {_pct(d)} ± {_pct(s)} points over {n} paired seeds"
            base = next((b for prefix, b in ABLATION_BASE.items() if mode.startswith(prefix)), None)
            if base is not None and base in per_mode:
                d2, s2, n2 = paired_difference(summary["runs"], mode, base, weak)
                line += f"; minus {MODE_LABEL[base]}: {_pct(d2)} ± {_pct(s2)} points over {n2} paired seeds"
            lines += ["", line + "."]
    cotrain = [r for r in summary["runs"] if "cotrain_peer" in r]
    if cotrain:
        start = summary["models"]["peer"]["acc_greedy"]  # its warm start, on the same held-out problems
        steps = [e["step"] for e in cotrain[0]["cotrain_peer"]["acc_by_step"]]
        path = " -> ".join(["warm start", *(f"step {s}" for s in steps)])
        lines += ["", "Co-training, the peer's side (it trains too, with the learner's RL settings but no anchor, taking the "
                  "learner's groups for its all-fail prompts); held-out greedy accuracy (%):", "",
                  f"| seed | peer {weak}: {path} | peer {strong}: {path} | peer all-fail frac | peer grafted frac |",
                  "|---|---|---|---|---|"]
        for r in cotrain:
            p = r["cotrain_peer"]
            by_family = {f: " -> ".join(_pct(a) for a in [start[f], *(e[f] for e in p["acc_by_step"])]) for f in (weak, strong)}
            lines.append(f"| {r['seed']} | {by_family[weak]} | {by_family[strong]} | "
                         f"{_num(p['frac_all_fail_mean'])} | {_num(p['frac_grafted_mean'])} |")
    lines += ["", "## Every run", "", f"| run | {weak} | {strong} | {weak} sampled | all-fail | hit rate | grafted | rollouts | peer rollouts | train s |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["runs"]:
        lines.append(f"| {r['name']} | {_pct(r['acc_by_family'][weak])} | {_pct(r['acc_by_family'][strong])} | "
                     f"{_pct(r['acc_sampled_by_family'][weak])} | {_num(r['frac_all_fail_mean'])} | {_num(r['peer_hit_rate_mean'])} | "
                     f"{_num(r['frac_grafted_mean'])} | {r['rollouts_generated']} | {r['peer_rollouts_consumed']} | {r['train_s']:.0f} |")
    job_cpu = [r.get("cpu_s") for r in summary["runs"]] + [r.get("cotrain_peer", {}).get("cpu_s") for r in summary["runs"]]
    job_cpu += [info.get("cpu_s") for info in summary["models"].values()]
    job_cpu += [run.get("cpu_s") for run in summary["peer_imitation"]]
    total_cpu = sum(c for c in job_cpu if c)
    lines += ["", "## Time", "",
              f"Wall time of this invocation {summary['wall_time_s']:.0f} s with {cfg.workers} processes at once (jobs found done "
              f"in `demo_out/` from an earlier invocation are not rerun; their times below are the ones they took then); "
              f"the jobs used {total_cpu:.0f} CPU seconds "
              f"(warm starts and RL runs, evaluation included; the generator and the store server not counted). Job wall times (s): "
              + ", ".join(f"{k} {v:.0f}" for k, v in summary["job_wall_s"].items()) + "."]
    lines += ["", "Produced by `make demo` (`python -m demo.run`); every number is read from the runs' outputs in `demo_out/`.", ""]
    return "\n".join(lines)


def _plots(records: list[dict], report_dir: Path, weak: str, strong: str, models: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = MODE_ORDER + sorted({r["mode"] for r in records} - set(MODE_ORDER))
    colors = {mode: plt.get_cmap("tab10")(i % 10) for i, mode in enumerate(modes)}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, family in zip(axes, (weak, strong)):
        seen = set()
        for r in records:
            steps = [e["step"] for e in r["acc_by_step"]]
            acc = [100 * e[family] for e in r["acc_by_step"]]
            if steps and steps[0] != 0:  # step 0 is the warm-started learner, the same for every run
                steps, acc = [0] + steps, [100 * models["learner"]["acc_greedy"][family]] + acc
            label = MODE_LABEL.get(r["mode"], r["mode"]) if r["mode"] not in seen else None
            seen.add(r["mode"])
            ax.plot(steps, acc, color=colors[r["mode"]], alpha=0.8, marker="o", markersize=3, label=label)
        ax.set_title(f"held-out greedy accuracy, {family} ({'weak' if family == weak else 'strong'} family)")
        ax.set_xlabel("RL step")
        ax.set_ylabel("accuracy (%)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    _save_fig(fig, report_dir / "accuracy_vs_step.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    seen = set()
    for r in records:
        values = r["frac_all_fail_by_step"]
        window = 5
        smooth = [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]
        label = MODE_LABEL.get(r["mode"], r["mode"]) if r["mode"] not in seen else None
        seen.add(r["mode"])
        ax.plot(range(1, len(smooth) + 1), smooth, color=colors[r["mode"]], alpha=0.8, label=label)
    ax.set_title("fraction of the learner's groups that are all-fail (5-step mean)")
    ax.set_xlabel("RL step")
    ax.set_ylabel("all-fail fraction")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save_fig(fig, report_dir / "all_fail_vs_step.png")
    plt.close(fig)


def _save_fig(fig, path: Path) -> None:
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)
