"""A committed report again under the current rule, from its summary.json alone (no run, no demo_out/ needed).

    python -m demo.rerender report report/avx2 report/mutual ...

For each report folder: every comparison is recomputed from its runs' values with demo.stats as it is now (and the
mutual demo's claim), the times, clock times and paths move to local.json (demo.report.write_summary: git ignores it),
and REPORT.md is written again; the plots do not depend on the rule and stay. A folder with a recommendation (`make
demo-choose`'s report/choose) gets demo.recommend's choice again. The runs' numbers are left as they were.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from demo import mutual_report, recommend, report
from demo.config import DemoConfig
from graft.rollouts.files import write_text_atomic


def rerender(report_dir: Path) -> dict:
    """One report folder under the current rule; returns its new summary (what summary.json now holds)."""
    summary = json.loads((report_dir / "summary.json").read_text())
    local = report_dir / report.LOCAL_FILE
    if local.exists():  # put back what an earlier rerender moved out, so that it stays in local.json
        summary = _merge(summary, json.loads(local.read_text()))
    cfg = DemoConfig.model_validate(summary["config"])
    if "claim" in summary:  # the mutual demo's
        families = summary["families"]
        summary["comparisons"] = {
            name: {mode: mutual_report.compare(summary["runs"], name, mode, summary["weak_family"][name],
                                               summary["strong_family"][name], families)
                   for mode in per_mode} for name, per_mode in summary["comparisons"].items()}
        summary.update(rule=mutual_report.VERDICT_RULE, claim=mutual_report.claim(summary["comparisons"]))
        budget = report_dir / "budget"
        if (budget / "summary.json").exists():
            report.write_summary(budget, _merge(json.loads((budget / "summary.json").read_text()),
                                                _read(budget / report.LOCAL_FILE)))
        committed = report.write_summary(report_dir, summary)
        write_text_atomic(report_dir / "REPORT.md", mutual_report.markdown(committed))
        return committed
    weak, strong = summary["weak_family"], summary["strong_family"]
    summary["comparisons"] = {mode: c if "same_as" in c else report.comparison(summary["runs"], mode, weak, strong)
                              for mode, c in summary["comparisons"].items()}
    summary["rule"] = report.VERDICT_RULE
    committed = report.write_summary(report_dir, summary)
    write_text_atomic(report_dir / "REPORT.md", report.markdown(committed, cfg))
    if (report_dir / "recommendation.json").exists():  # the choose run's, or the confirmatory run's (its own seeds)
        seeds = sorted({run["seed"] for run in summary["runs"]})
        recommend.main([str(report_dir / "summary.json")] + (["--confirm"] if seeds == recommend.CONFIRM_SEEDS else []))
    return committed


def _read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _merge(kept, local):
    """demo.report.split_local undone: `local`'s fields back at their places in `kept`."""
    if isinstance(kept, dict) and isinstance(local, dict):
        return {**{k: _merge(v, local.get(k)) for k, v in kept.items()}, **{k: v for k, v in local.items() if k not in kept}}
    if isinstance(kept, list) and isinstance(local, list):
        return [_merge(k, item) for k, item in zip(kept, local)]
    return kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demo.rerender", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report_dirs", type=Path, nargs="+", help="report folders holding a summary.json")
    for report_dir in parser.parse_args(argv).report_dirs:
        summary = rerender(report_dir)
        if "claim" in summary:
            print(f"{report_dir}: the claim {summary['claim']['verdict']}; co-training {summary['claim']['cotrain_verdicts']}")
            continue
        verdicts = {mode: c.get("verdict", f"= {c.get('same_as')}") for mode, c in summary["comparisons"].items()}
        print(f"{report_dir}: {verdicts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
