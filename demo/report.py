"""report/: summary.json, REPORT.md (the verdicts first) and the plots, from what the runs wrote. (One module of just
over 600 lines on purpose: the summary, the page and the plots read together in the order REPORT.md prints them, and
every study's report builds on its pieces; the mutual study's own tables live in studies/mutual_report.py.)

Nothing here is tuned: every number is read from the runs' outputs, and every verdict is demo.stats's rule, written
before the runs. The primary metric of a run is its weak family's sampled accuracy averaged over its late evaluations
(`primary`); comparisons are paired with GRPO by (start, seed).

The committed files hold what was computed, nothing the invocation measured about itself: times, clock times and paths
go to local.json beside them, which git ignores (`write_summary`), so `make demo` on a fresh clone leaves the tree as it
was (issue 51). The times are printed at the end of the run (`time_lines`).
"""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path
from typing import Any

import orjson

from demo.compare_runs import measured_here
from demo.config import PEER_MODEL_ID, DemoConfig
from demo.records import cpu_model, run_provenance
from demo.stats import (
    RULE_HISTORY,
    RULE_VERSION,
    VERDICT_RULE,
    Interval,
    p_text,
    paired_interval,
    pct,
    stratified_interval,
    verdict,
    verdict_text,
)
from graft.rollouts.files import write_text_atomic

MODE_LABEL = {
    "grpo": "GRPO",
    "graft": "GRAFT, the trainer's default",
    "graft_spec": "GRAFT, the spec's formulas (b = min(pi_old/mu, 2), w, peer negatives)",
    "graft_cotrain": "GRAFT co-training (the default GRAFT, peer trained beside the learner)",
    "graft_no_peer_neg": "GRAFT, peer negatives x0",
    "graft_no_seq_weight": "GRAFT, no sequence weight (w = 1)",
    "graft_b1": "GRAFT, b = 1 (no token-level ratio)",
    "graft_b1_no_peer_neg": "GRAFT, b = 1 and peer negatives x0",
    "graft_fix": "GRAFT changed: LUFFY shaping (w = 1), peer negatives x0, peer rows x4",
}


# graft.preset -> what it is, as a report names the runs of a GRAFT whose settings match it (issue 60: a row named "the
# trainer's default" must say which GRAFT that was when it ran)
PRESET_LABEL = {"spec": "the spec's formulas (b = min(pi_old/mu, 2), w, peer negatives)",
                "b1_no_peer_neg": "b = 1 and peer negatives x0"}


def label(mode: str, summary: dict | None = None) -> str:
    """A method's name in the report. `graft` and `graft_cotrain` (the trainers' default) are named by what they ran:
    the preset their resolved settings match (summary.json's `graft_presets`; for runs from before issue 60, the
    record's `graft_default`)."""
    if mode in ("graft", "graft_cotrain") and summary is not None:
        ran = (summary.get("graft_presets") or {}).get(mode) or (summary.get("record") or {}).get("graft_default")
        if ran in PRESET_LABEL:
            kind = "GRAFT co-training (peer trained beside the learner)" if mode == "graft_cotrain" else "GRAFT"
            return f"{kind}, {PRESET_LABEL[ran]}: the trainers' default when it ran"
    return MODE_LABEL.get(mode, mode)


def graft_preset(train: dict) -> str | None:
    """The graft.preset whose every field a trainer config's resolved graft section has, or None."""
    from graft.trainer.config import GRAFT_PRESETS, TrainConfig

    resolved = TrainConfig.model_validate(train).graft.model_dump()
    return next((name for name, fields in GRAFT_PRESETS.items()
                 if all(resolved[field] == value for field, value in fields.items())), None)


def _finite_mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None and isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(kept) / len(kept) if kept else None


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "train" / "metrics.jsonl"
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def primary(evals: list[dict], steps: int, family: str, key: str = "acc_sampled") -> float:
    """A run's metric on `family`: its `key` accuracy averaged over the evaluations at step >= steps / 2 (the late ones)."""
    late = [e[key][family] for e in evals if e["step"] >= steps / 2]
    if not late:
        raise ValueError(f"no evaluation at step >= {steps / 2} among {[e['step'] for e in evals]}")
    return statistics.fmean(late)


def run_record(run: dict, families: list[str], steps: int) -> dict[str, Any]:
    """One run's entry of summary.json."""
    run_dir = Path(run["dir"])
    done = json.loads((run_dir / "done.json").read_text())
    metrics = read_metrics(run_dir)
    evals = done["evals"]
    record: dict[str, Any] = {
        "name": run["name"], "mode": run["mode"], "start": run.get("start"), "seed": run["seed"],
        "primary": {f: primary(evals, steps, f) for f in families},  # sampled, late evaluations
        "greedy_late": {f: primary(evals, steps, f, "acc_greedy") for f in families},
        "final_greedy": evals[-1]["acc_greedy"], "final_sampled": evals[-1]["acc_sampled"],
        "frac_all_fail_mean": _finite_mean([m["frac_all_fail"] for m in metrics]),
        "peer_hit_rate_mean": _finite_mean([m["peer_hit_rate"] for m in metrics]),
        "frac_grafted_mean": _finite_mean([m["frac_grafted"] for m in metrics]),
        "groups_capped_per_step": _finite_mean([m.get("groups_capped", 0) for m in metrics]),
        "grafted_groups_short_per_step": _finite_mean([m.get("grafted_groups_short", 0) for m in metrics]),
        "rollouts_generated": int(sum(m["rollouts_generated"] for m in metrics)),
        "peer_rollouts_consumed": int(sum(m["peer_rollouts_consumed"] for m in metrics)),
        "compat_weight_mean": _finite_mean([m["compat_weight_mean"] for m in metrics]),
        "behaviour_ratio_hardest_p50_mean": _finite_mean([m.get("behaviour_ratio_hardest_p50") for m in metrics]),
        "log_rho_p50_mean": _finite_mean([m["log_rho_p50"] for m in metrics]),
        "frac_dropped_retokenize_mean": _finite_mean([m["frac_dropped_retokenize"] for m in metrics]),
        "steps": len(metrics), "train_s": done["train_s"], "cpu_s": done.get("cpu_s"),
        "stage_s": stage_times(metrics, done),
        "evals": evals,
        "frac_all_fail_by_step": [m["frac_all_fail"] for m in metrics],
        **run_provenance(done),
    }
    if run.get("peer_dir"):
        peer_dir = Path(run["peer_dir"])
        peer_done = json.loads((peer_dir / "done.json").read_text())
        peer_metrics = read_metrics(peer_dir)
        record["cotrain_peer"] = {
            "evals": peer_done["evals"],
            "frac_all_fail_mean": _finite_mean([m["frac_all_fail"] for m in peer_metrics]),
            "peer_hit_rate_mean": _finite_mean([m["peer_hit_rate"] for m in peer_metrics]),
            "frac_grafted_mean": _finite_mean([m["frac_grafted"] for m in peer_metrics]),
            "rollouts_generated": int(sum(m["rollouts_generated"] for m in peer_metrics)),
            "peer_rollouts_consumed": int(sum(m["peer_rollouts_consumed"] for m in peer_metrics)),
            "cpu_s": peer_done.get("cpu_s"),
        }
    return record


def paired_values(records: list[dict], mode: str, family: str, key: str = "primary",
                  baseline: str = "grpo") -> dict[str, list[float]]:
    """mode minus baseline on `family` (`key`: primary or greedy_late), by start: one value per seed both ran there
    (demo.stats.stratified_interval pools the starts)."""
    def by_pair(m: str) -> dict[tuple, float]:
        return {(r["start"], r["seed"]): r[key][family] for r in records if r["mode"] == m}

    base, mine = by_pair(baseline), by_pair(mode)
    out: dict[str, list[float]] = {}
    for start, seed in sorted(set(base) & set(mine)):
        out.setdefault(start, []).append(mine[start, seed] - base[start, seed])
    return out


def comparison(records: list[dict], mode: str, weak: str, strong: str) -> dict:
    """A method against GRPO: the weak and strong families' paired intervals (primary metric, stratified by start), the
    verdict, the greedy intervals (secondary) and each start's own intervals (for reading, not for the verdict)."""
    weak_by_start, strong_by_start = paired_values(records, mode, weak), paired_values(records, mode, strong)
    weak_i, strong_i = stratified_interval(weak_by_start), stratified_interval(strong_by_start)
    return {
        "weak": weak_i.as_dict(), "strong": strong_i.as_dict(), "verdict": verdict(weak_i, strong_i),
        "weak_greedy": stratified_interval(paired_values(records, mode, weak, "greedy_late")).as_dict(),
        "strong_greedy": stratified_interval(paired_values(records, mode, strong, "greedy_late")).as_dict(),
        "per_start": {start: paired_interval(values).as_dict() for start, values in weak_by_start.items()},
        "strong_per_start": {start: paired_interval(values).as_dict() for start, values in strong_by_start.items()},
    }


def write_report(cfg: DemoConfig, models: dict, runs: list[dict], data: dict, store_stats: dict, timings: dict,
                 wall_time_s: float, server_stopped: bool, store_root: Path, probes: dict[str, dict] | None = None,
                 kernels: str = "own", record: dict | None = None) -> dict:
    weak, strong = cfg.task.weak_family, cfg.task.strong_family
    families = list(cfg.task.n_eval)
    aliases = {r["mode"]: r["same_as"] for r in runs if r.get("same_as")}
    records = [run_record(r, families, cfg.rl.steps) for r in runs if r["mode"] != "peer_imitation" and not r.get("same_as")]
    imitation = [{"start": r["start"], "seed": r["seed"], **json.loads((Path(r["dir"]) / "done.json").read_text())}
                 for r in runs if r["mode"] == "peer_imitation"]
    starts = list(cfg.starts)
    modes = [m for m in dict.fromkeys(r["mode"] for r in records) if m != "grpo"]
    comparisons = {mode: comparison(records, mode, weak, strong) for mode in modes}
    for alias, target in aliases.items():
        comparisons[alias] = {"same_as": target}
    peer_groups_done = store_root / f"groups-done-{PEER_MODEL_ID}.json"
    summary = {
        "record": record,
        "rule": VERDICT_RULE,
        "rule_version": RULE_VERSION,
        "graft_presets": {r["mode"]: r.get("graft_preset") for r in runs if r["mode"] not in ("grpo", "peer_imitation")},
        "primary_metric": f"{weak} sampled accuracy ({cfg.rl.eval_samples} samples per held-out problem at T = 1), "
                          f"averaged over the evaluations at step >= {cfg.rl.steps // 2}",
        "comparisons": comparisons,
        "runs": records,
        "per_mode": per_mode(records, weak, strong),
        "peer_imitation": imitation,
        "starts": models["learner"]["starts"],
        "peer_start": models["peer"]["starts"]["peer"],
        "models": {role: {k: v for k, v in info.items() if k not in ("starts", "start_dirs")} for role, info in models.items()},
        "probes": probes or {},
        "peer_groups": json.loads(peer_groups_done.read_text()) if peer_groups_done.exists() else None,
        "store_stats": store_stats,
        "server_stopped": server_stopped,
        "machine": machine(kernels),
        "job_wall_s": {k: round(v, 1) for k, v in timings.items()},
        "wall_time_s": wall_time_s,
        "weak_family": weak,
        "strong_family": strong,
        "config": cfg.model_dump(mode="json"),
    }
    report_dir = cfg.report_dir
    committed = write_summary(report_dir, summary)
    _plots(records, report_dir, weak, strong, models, starts, {mode: label(mode, summary) for mode in summary["per_mode"]})
    if any(probe["batches"] for probe in (probes or {}).values()):
        _probe_plot({start: probe for start, probe in probes.items() if probe["batches"]}, report_dir)
    write_text_atomic(report_dir / "REPORT.md", markdown(committed, cfg))
    return summary


LOCAL_FILE = "local.json"  # beside summary.json; .gitignore lists it


def write_summary(report_dir: Path, summary: dict) -> dict:
    """`summary` as report_dir/summary.json without what only this invocation says (times, clock times, paths:
    demo.compare_runs.measured_here; the config as it is), and those fields at their places in local.json. Two
    invocations that computed the same write the same summary.json. Returns what summary.json holds."""
    committed, local = split_local(summary)
    report_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(report_dir / "summary.json", json.dumps(committed, indent=2, default=str))
    write_text_atomic(report_dir / LOCAL_FILE, json.dumps(local or {}, indent=2, default=str))
    return committed


def split_local(value: Any) -> tuple[Any, Any]:
    """(value without its `measured_here` fields, those fields in the same nesting; None if none), `config` kept whole."""
    if isinstance(value, dict):
        kept, local = {}, {}
        for key, item in value.items():
            if key != "config" and measured_here(key):
                local[key] = item
                continue
            kept[key], inner = (item, None) if key == "config" else split_local(item)
            if inner:
                local[key] = inner
        return kept, local or None
    if isinstance(value, list):
        parts = [split_local(item) for item in value]
        inner = [inner for _, inner in parts]
        return [kept for kept, _ in parts], (inner if any(inner) else None)
    return value, None


def per_mode(records: list[dict], weak: str, strong: str) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for mode in dict.fromkeys(r["mode"] for r in records):
        rs = [r for r in records if r["mode"] == mode]
        out[mode] = {
            "pairs": len(rs),
            "weak_primary_mean": statistics.fmean(r["primary"][weak] for r in rs),
            "strong_primary_mean": statistics.fmean(r["primary"][strong] for r in rs),
            "weak_greedy_mean": statistics.fmean(r["greedy_late"][weak] for r in rs),
            **{key: _finite_mean([r[key] for r in rs]) for key in (
                "frac_all_fail_mean", "peer_hit_rate_mean", "frac_grafted_mean", "groups_capped_per_step",
                "grafted_groups_short_per_step", "compat_weight_mean", "behaviour_ratio_hardest_p50_mean",
                "log_rho_p50_mean", "frac_dropped_retokenize_mean")},
            "rollouts_generated_mean": statistics.fmean(r["rollouts_generated"] for r in rs),
            "peer_rollouts_consumed_mean": statistics.fmean(r["peer_rollouts_consumed"] for r in rs),
        }
    return out


def machine(kernels: str) -> dict:
    """The CPU the numbers came from (they move with it: docs/demo.md)."""
    import torch

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_kernels": torch.backends.cpu.get_cpu_capability(),
            "kernels": kernels, "torch": torch.__version__}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def verdict_lines(summary: dict) -> list[str]:
    """The table every reader sees first (and `make demo` prints): each method's paired intervals and verdict."""
    weak, strong = summary["weak_family"], summary["strong_family"]
    lines = [f"| method vs GRPO, paired by (start, seed) | pairs | `{weak}` (weak) gain, points [95% CI] | p | "
             f"`{strong}` (strong) change [95% CI] | verdict | `{weak}` greedy gain [95% CI] |",
             "|---|---|---|---|---|---|---|"]
    for mode, c in summary["comparisons"].items():
        if "same_as" in c:
            lines.append(f"| {label(mode, summary)} | = {label(c['same_as'], summary)} (the same runs: the same trainer "
                         "settings when they ran) | | | | | |")
            continue
        weak_i, strong_i = Interval(**c["weak"]), Interval(**c["strong"])
        lines.append(f"| {label(mode, summary)} | {weak_i.pairs} | {pct(weak_i)} | {p_text(weak_i)} | {pct(strong_i)} | "
                     f"**{verdict_text(c['verdict'], weak_i)}** | {pct(Interval(**c['weak_greedy']))} |")
    return lines


def rule_version_text(version: str) -> str:
    """`2026-12-04 (issue 48)` with what that version changed (demo.stats.RULE_HISTORY)."""
    what = next((f": {change}" for date, issue, change in RULE_HISTORY if f"{date} ({issue})" == version), "")
    return f"the version of {version}{what}"


OWN_KERNELS = "none (the CPU's own)"


def header_lines(summary: dict) -> list[str]:
    """What ran and under which rule, as every report's header says it (issue 60): the record's commit, tree, host,
    kernels and dates, the jobs it took from a cache and the code they ran; the rule's version the runs were judged
    under when they ran and, when re-rendered under a later one (studies.rerender), that one and when."""
    record = summary.get("record") or {}
    lines = []
    if record.get("reconstructed"):
        lines.append(f"**Record** (reconstructed at re-rendering, from git history: the runs wrote none): "
                     f"{record['reconstructed']}")
    elif record:
        host = record.get("host", {})
        tree = "clean" if record.get("clean") else "NOT clean: " + ", ".join(record.get("changed", [])[:5])
        lines.append(
            f"**Record**: `{record.get('command', '?')}` from {record.get('started')} to {record.get('finished')} (UTC) "
            f"at commit {str(record.get('commit'))[:12]}, tree {tree}; host {host.get('cpu')}, {host.get('cores')} "
            f"cores, kernel settings {host.get('kernel_settings') or OWN_KERNELS}. Jobs: {record.get('jobs_ran')} run "
            f"by this invocation, {record.get('jobs_found_done')} found done; every job's commit "
            f"{record.get('job_commits')}, CPU {record.get('job_cpus')}, kernels {record.get('job_kernels')}.")
        if record.get("accepted_from_other_code"):
            taken = "; ".join(f"{name} ({why})" for name, why in record["accepted_from_other_code"].items())
            lines.append(f"**Taken from a cache though other code computed them** (--accept-cached-code): {taken}.")
    else:
        lines.append("**Record**: none (this report's runs wrote none).")
    ran_under = summary.get("rule_version") or record.get("rule") or "?"
    rerendered = summary.get("rerendered")
    if rerendered:
        lines.append(f"**Rule**: these runs were judged, when they ran, under {rule_version_text(ran_under)}. This "
                     f"report was re-rendered from its summary.json on {rerendered['date']} at commit "
                     f"{str(rerendered['commit'])[:12]} (its code's tree {'clean' if rerendered.get('code_clean') else 'NOT clean'}) "
                     f"under {rule_version_text(rerendered['rule_version'])}, written after these runs: {summary['rule']}.")
    else:
        lines.append(f"**Rule** ({rule_version_text(ran_under)}; fixed before these runs): {summary['rule']}.")
    return lines


def markdown(summary: dict, cfg: DemoConfig) -> str:
    weak, strong = summary["weak_family"], summary["strong_family"]
    per = summary["per_mode"]
    m = summary["machine"]
    lines = [
        f"# GRAFT CPU demo ({cfg.mode})",
        "",
        f"Learner: {summary['models']['learner']['architecture']} ({summary['models']['learner']['parameters']:,} parameters, "
        f"character-level tokenizer); peer: {summary['models']['peer']['architecture']} ({summary['models']['peer']['parameters']:,} "
        f"parameters, byte-level BPE). Weak family `{weak}`, strong family `{strong}`. {cfg.rl.steps} RL steps of "
        f"{cfg.rl.prompts_per_step} prompts x {cfg.rl.group_size} rollouts from each of {len(cfg.starts)} starts x "
        f"{len(cfg.rl.seeds)} seeds. Primary metric: {summary['primary_metric']}. Machine: {m['cpu']}, {m['cores']} "
        f"cores, torch {m['torch']} on its {m['torch_kernels']} kernels ({m['kernels']}).",
        "",
        *header_lines(summary),
        "",
        *verdict_lines(summary),
        "",
        "<!-- table-end -->",
        "",
        "![accuracy vs step](accuracy_vs_step.png)",
        "",
        "## The starts (chosen by level, not by step)",
        "",
        f"| start | level: `{weak}` sampled on dev | step | dev `{weak}` sampled | held-out `{weak}` sampled / greedy | "
        f"held-out `{strong}` sampled / greedy |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in summary["starts"].items():
        lines.append(f"| {name} | {_pct(s['level'])} | {s['step']} | {_pct(s['dev_sampled'][weak])} | "
                     f"{_pct(s['acc_sampled'][weak])} / {_pct(s['acc_greedy'][weak])} | "
                     f"{_pct(s['acc_sampled'][strong])} / {_pct(s['acc_greedy'][strong])} |")
    p = summary["peer_start"]
    lines += ["", f"The peer: step {p['step']} (level {_pct(p['level'])}% sampled `{weak}` on dev, "
              f"{_pct(p['dev_sampled'][weak])}% there); held-out `{weak}` sampled {_pct(p['acc_sampled'][weak])}%, "
              f"greedy {_pct(p['acc_greedy'][weak])}%."]
    pg = summary["peer_groups"]
    if pg:
        lines += [f"Its groups in the store: {pg['indexed_groups']} ({pg['rollouts']} rollouts, written by "
                  f"`graft-generate`); {pg['informative_groups']} informative "
                  f"({pg['informative_groups'] / max(1, pg['indexed_groups']):.0%}); success rate {_pct(pg['success_rate'])}%."]

    lines += ["", "## Per start (the verdicts pool them: the mean of the per-start means, stratified intervals)", "",
              f"| method | start | pairs | `{weak}` gain over GRPO [95% CI] | p | `{strong}` change [95% CI] |",
              "|---|---|---|---|---|---|"]
    for mode, c in summary["comparisons"].items():
        for start, interval in c.get("per_start", {}).items():
            weak_i, strong_i = Interval(**interval), c.get("strong_per_start", {}).get(start)  # none before issue 48
            lines.append(f"| {label(mode, summary)} | {start} | {weak_i.pairs} | {pct(weak_i)} | {p_text(weak_i)} | "
                         f"{pct(Interval(**strong_i)) if strong_i else '-'} |")

    lines += ["", "## What each run did (means over its runs)", "",
              f"| run | pairs | `{weak}` primary | `{strong}` primary | `{weak}` greedy (late) | all-fail frac | peer hit rate | "
              "grafted frac | groups over the graft cap, per step | grafted groups that lost rows, per step | "
              "w (mean) | b at the decisive token (median) | peer rollouts consumed |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode, r in per.items():
        lines.append(f"| {label(mode, summary)} | {r['pairs']} | {_pct(r['weak_primary_mean'])} | {_pct(r['strong_primary_mean'])} | "
                     f"{_pct(r['weak_greedy_mean'])} | {_num(r['frac_all_fail_mean'])} | {_num(r['peer_hit_rate_mean'])} | "
                     f"{_num(r['frac_grafted_mean'])} | {_num(r['groups_capped_per_step'])} | "
                     f"{_num(r['grafted_groups_short_per_step'])} | {_num(r['compat_weight_mean'])} | "
                     f"{_num(r['behaviour_ratio_hardest_p50_mean'], 3)} | {r['peer_rollouts_consumed_mean']:.0f} |")
    lines += ["", f"The graft cap (at most {100 * 0.5:.0f}% of a step's groups grafted, graft.max_grafted_fraction) skips "
              "the groups counted above; a grafted group that lost rows to re-tokenisation has its advantages recomputed "
              "over the rows that train."]

    probes = {start: probe for start, probe in summary["probes"].items() if probe["batches"]}
    for start, probe in summary["probes"].items():
        if not probe["batches"]:
            lines += ["", f"The mechanism probe at start {start} had nothing to probe: {probe['empty']}."]
    if probes:
        lines += ["", "## The mechanism probe: what each correction does to a grafted group's gradient", "",
                  "From each start, on weak-family RL prompts the learner fails (8 of 8 samples) that have an informative "
                  "peer group: the grafted rows as graft-train builds them, their loss's gradient at theta_old, per batch "
                  "of prompts (the same batches for every correction). cos: with the gradient of the held-out gold "
                  "answers' log-likelihood (positive: the step teaches); effective weight: |d loss / d log pi| per unit of "
                  "advantage at the decisive token of a correct row (the one the learner finds least likely).", "",
                  "| start | correction | cos with the gold direction [95% CI over batches] | minus the spec's [95% CI] | "
                  "gradient norm | effective weight at the decisive token (median) | share below 0.05 |",
                  "|---|---|---|---|---|---|---|"]
        for start, probe in probes.items():
            for name, entry in probe["corrections"].items():
                cos = Interval(**entry["cos"])
                diff = Interval(**entry["cos_minus_spec"]) if "cos_minus_spec" in entry else None
                lines.append(f"| {start} | {name} | {cos.mean:+.3f} [{cos.low:+.3f}, {cos.high:+.3f}] | "
                             f"{'-' if diff is None else f'{diff.mean:+.3f} [{diff.low:+.3f}, {diff.high:+.3f}]'} | "
                             f"{entry['grad_norm_mean']:.3g} | {_num(entry.get('decisive_weight_p50'), 3)} | "
                             f"{_num(entry.get('decisive_weight_below_0.05'))} |")
        first = next(iter(probes.values()))
        lines += ["", f"{first['probed_prompts']} prompts in {first['batches']} batches of {first['batch_prompts']} at the "
                  f"first start (of {first['failed_prompts']} failed prompts among {first['weak_prompts']}); "
                  f"{first['gold_problems']} held-out gold answers.", "", "![probe](probe.png)"]

    for run in summary["peer_imitation"]:
        lines += ["", f"- The ceiling (start {run['start']}, seed {run['seed']}): supervised training on the peer's correct "
                  f"`{weak}` answers ({run['examples_per_step']} per update at full weight, from {run['peer_correct_answers']}) "
                  f"with the RL runs' optimizer, lr, {run['steps']} updates and anchor reaches `{weak}` sampled "
                  f"{_pct(run['acc_sampled'][weak])}% (greedy {_pct(run['acc_greedy'][weak])}%), `{strong}` sampled "
                  f"{_pct(run['acc_sampled'][strong])}%: what the peer's answers could teach in this budget."]

    cotrain = [r for r in summary["runs"] if "cotrain_peer" in r]
    if cotrain:
        start_acc = summary["peer_start"]["acc_sampled"]
        steps = [e["step"] for e in cotrain[0]["cotrain_peer"]["evals"]]
        path = " -> ".join(["warm start", *(f"step {s}" for s in steps)])
        lines += ["", "## Co-training, the peer's side", "",
                  "It trains too, with the learner's RL settings, anchored on its own strong family "
                  f"(`{weak}`) as the learner is on `{strong}`, taking the learner's groups for its all-fail prompts. "
                  "Held-out sampled accuracy (%), and the learner's peer hit rate in the same run:", "",
                  f"| start, seed | peer `{weak}`: {path} | peer `{strong}`: {path} | peer all-fail frac | peer grafted frac | "
                  "learner's peer hit rate |", "|---|---|---|---|---|---|"]
        for r in cotrain:
            p = r["cotrain_peer"]
            by_family = {f: " -> ".join(_pct(a) for a in [start_acc[f], *(e["acc_sampled"][f] for e in p["evals"])])
                         for f in (weak, strong)}
            lines.append(f"| {r['start']}, {r['seed']} | {by_family[weak]} | {by_family[strong]} | "
                         f"{_num(p['frac_all_fail_mean'])} | {_num(p['frac_grafted_mean'])} | {_num(r['peer_hit_rate_mean'])} |")
    else:
        lines += ["", "## Co-training, the peer's side", "",
                  "Not run in this invocation (`rl.cotrain_seeds` is empty: a co-training pair costs two processes for a "
                  "run). `make demo-study` runs the pairs; on their own, after this run, "
                  "`.venv/bin/python -m demo.run --set 'rl.cotrain_seeds=[0,1,2,3]' --report-dir report/cotrain`, whose "
                  "report shows the co-training peer's held-out accuracy at every evaluation beside the learner's peer "
                  "hit rate (docs/demo.md, \"Co-training in the demo's design\")."]

    lines += ["", "## Every run", "",
              f"| run | `{weak}` primary | `{strong}` primary | `{weak}` greedy, last | all-fail | hit rate | grafted | "
              "capped/step | peer rollouts |", "|---|---|---|---|---|---|---|---|---|"]
    for r in summary["runs"]:
        lines.append(f"| {r['name']} | {_pct(r['primary'][weak])} | {_pct(r['primary'][strong])} | "
                     f"{_pct(r['final_greedy'][weak])} | {_num(r['frac_all_fail_mean'])} | {_num(r['peer_hit_rate_mean'])} | "
                     f"{_num(r['frac_grafted_mean'])} | {_num(r['groups_capped_per_step'])} | {r['peer_rollouts_consumed']} |")
    lines += ["", "## Time", "",
              f"The run prints its times when it ends; every job's wall and CPU seconds are in `{LOCAL_FILE}` beside this "
              "file, with the store's clock times and where the files went. They differ between two runs that compute the "
              f"same, so git ignores `{LOCAL_FILE}` and a rerun leaves this report and summary.json as committed."]
    lines += ["", "Produced by `make demo` (`python -m demo.run`); every number is read from the runs' outputs in `demo_out/`.", ""]
    return "\n".join(lines)


def committed_table_lines(summary: dict, committed: Path, report_dir: Path) -> list[str]:
    """How this run's verdict table compares with the committed report's (`committed`, report/): the same to the last
    digit, or which rows differ, with where each ran (the numbers move with the CPU and its kernels)."""
    path = committed / "summary.json"
    if report_dir.resolve() == committed.resolve() or not path.exists():
        return []
    theirs = json.loads(path.read_text())
    record, machine = theirs.get("record") or {}, theirs.get("machine") or {}
    kernels = f"{machine.get('torch_kernels', '?')} kernels"
    if record.get("commit"):
        cpu = (record.get("host") or {}).get("cpu", "?")
        where = f"ran {record.get('started', '?')} at commit {record['commit'][:12]} on {cpu} ({kernels})"
    else:  # runs from before records (issue 60): what is known is its summary's machine and reconstructed record
        cpu = machine.get("cpu", "a CPU its summary does not name")
        where = f"on {cpu} ({kernels}), its record reconstructed after the runs"
    mine_host = (summary.get("machine") or {})
    here = f"this run: {mine_host.get('cpu', '?')} ({mine_host.get('torch_kernels', '?')} kernels)"
    table = ("weak", "strong", "verdict")
    differing = [label(mode, summary) for mode, c in summary["comparisons"].items()
                 if {k: c.get(k) for k in table} != {k: theirs["comparisons"].get(mode, {}).get(k) for k in table}]
    missing = sorted(set(theirs["comparisons"]) - set(summary["comparisons"]))
    if not differing and not missing:
        return [f"The committed report ({committed.name}/, {where}): this run's verdict table is the same to the last "
                f"digit ({here})."]
    return [f"The committed report ({committed.name}/, {where}) differs from this run's in: "
            f"{', '.join(differing + missing)} ({here}; the starts, and with them every number, move with the CPU and "
            "its kernels: docs/demo.md, \"Numbers across x86-64 CPUs\")."]


# stage -> the trainer's per-step metric (graft.trainer.loop's clock laps)
STAGES = {"sampling and scoring": "generation_s", "gate and grafted rows": "gate_s", "update": "update_s"}


def stage_times(metrics: list[dict], done: dict) -> dict[str, float]:
    """A run's wall seconds by stage, measured: the trainer's per-step stage times summed (STAGES), the rest of its
    steps, start-up and checkpoints (the trainer's time outside its steps), and the held-out evaluation (the job's time
    after training)."""
    stages = {stage: sum(m.get(key, 0.0) for m in metrics) for stage, key in STAGES.items()}
    steps_total = sum(m["step_time_s"] for m in metrics)
    stages["rest of the steps"] = steps_total - sum(stages.values())
    stages["start-up and checkpoints"] = done["train_s"] - steps_total
    stages["evaluation"] = done["wall_s"] - done["train_s"]
    return {stage: round(seconds, 1) for stage, seconds in stages.items()}


def time_lines(summary: dict, workers: int) -> list[str]:
    """What the run took (`summary` as write_report returns it, times included): printed when `make demo` ends."""
    job_cpu = [r.get("cpu_s") for r in summary["runs"]] + [r.get("cotrain_peer", {}).get("cpu_s") for r in summary["runs"]]
    job_cpu += [info.get("cpu_s") for info in summary["models"].values()]
    job_cpu += [run.get("cpu_s") for run in summary["peer_imitation"]]
    total_cpu = sum(c for c in job_cpu if c)
    return [f"Wall time of this invocation {summary['wall_time_s']:.0f} s with {workers} processes at once (jobs found "
            "done in `demo_out/` from an earlier invocation are not rerun; their times below are the ones they took then); "
            f"the jobs used {total_cpu:.0f} CPU seconds (warm starts and RL runs, evaluation included; the generator, the "
            "probes and the store server not counted). Job wall times (s): "
            + ", ".join(f"{k} {v:.0f}" for k, v in summary["job_wall_s"].items()) + ".", *stage_lines(summary["runs"])]


def stage_lines(runs: list[dict]) -> list[str]:
    """The RL runs' time by stage, summed over the runs (each run's `stage_s`, in local.json)."""
    measured = [r["stage_s"] for r in runs if r.get("stage_s")]
    if not measured:
        return []
    total = {stage: sum(m[stage] for m in measured) for stage in measured[0]}
    whole = sum(total.values()) or 1.0
    return [f"The {len(measured)} RL runs' time by stage (s, share): "
            + ", ".join(f"{stage} {seconds:.0f} ({100 * seconds / whole:.0f}%)" for stage, seconds in total.items()) + "."]


def _plots(records: list[dict], report_dir: Path, weak: str, strong: str, models: dict, starts: list[str],
           names: dict[str, str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(r["mode"] for r in records))
    colors = {mode: plt.get_cmap("tab10")(i % 10) for i, mode in enumerate(modes)}
    fig, axes = plt.subplots(len(starts), 2, figsize=(12, 4 * len(starts)), squeeze=False)
    for row, start in enumerate(starts):
        begin = models["learner"]["starts"][start]["acc_sampled"]
        for col, family in enumerate((weak, strong)):
            ax = axes[row][col]
            seen = set()
            for r in (r for r in records if r["start"] == start):
                steps = [0] + [e["step"] for e in r["evals"]]
                acc = [100 * begin[family]] + [100 * e["acc_sampled"][family] for e in r["evals"]]
                ax.plot(steps, acc, color=colors[r["mode"]], alpha=0.7, marker="o", markersize=3,
                        label=names.get(r["mode"], r["mode"]) if r["mode"] not in seen else None)
                seen.add(r["mode"])
            ax.set_title(f"start {start}: held-out sampled accuracy, {family} ({'weak' if family == weak else 'strong'})")
            ax.set_xlabel("RL step")
            ax.set_ylabel("accuracy (%)")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    save_fig(fig, report_dir / "accuracy_vs_step.png")
    plt.close(fig)


def _probe_plot(probes: dict[str, dict], report_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    names = list(next(iter(probes.values()))["corrections"])
    offsets = {start: i * 0.25 for i, start in enumerate(probes)}
    for start, probe in probes.items():
        for index, name in enumerate(names):
            entry = probe["corrections"][name]
            cos = [b["cos"] for b in entry["batches"]]
            x = index + offsets[start]
            axes[0].scatter([x] * len(cos), cos, s=10, alpha=0.5, color=f"C{list(probes).index(start)}",
                            label=f"start {start}" if index == 0 else None)
            axes[0].errorbar(x, entry["cos"]["mean"], yerr=[[entry["cos"]["mean"] - entry["cos"]["low"]],
                                                             [entry["cos"]["high"] - entry["cos"]["mean"]]],
                             color="black", capsize=3)
            weights = [w for b in entry["batches"] for w in b.get("decisive_weights", [])]
            if weights:
                axes[1].boxplot([max(w, 1e-6) for w in weights], positions=[x], widths=0.2, showfliers=False)
    for ax in axes:
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=20, ha="right", fontsize=7)
        ax.grid(alpha=0.3)
    axes[0].axhline(0, color="grey", lw=0.8)
    axes[0].set_title("grafted rows' update vs the gold answers' gradient (cosine, per batch)")
    axes[0].legend(fontsize=7)
    axes[1].set_yscale("log")
    axes[1].set_title("effective weight at the decisive token of correct rows")
    fig.tight_layout()
    save_fig(fig, report_dir / "probe.png")
    plt.close(fig)


def save_fig(fig, path: Path) -> None:
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)
