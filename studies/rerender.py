"""A committed report again under the current rule, from its summary.json alone (no run, no demo_out/ needed).

    python -m studies.rerender report report/avx2 report/confirm ...

For each report folder: every comparison is recomputed from its runs' values with demo.stats as it is now (and the
mutual study's claim), the times, clock times and paths move to local.json (demo.report.write_summary: git ignores it),
and REPORT.md is written again; the plots do not depend on the rule and stay. A folder with a recommendation (`make
demo-choose`'s report/choose) gets studies.recommend's choice again. The runs' numbers are left as they were.

The header says so (issue 60): summary.json's `rerendered` holds when, at which commit (and whether the code's tree
was clean) and under which version of the rule (demo.stats.RULE_HISTORY) it was rendered again, beside the version
its runs were judged under when they ran (`rule_version`, or the record's). A rerender that changes nothing keeps the
earlier stamp, so that a second one leaves the files as they are.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

from demo import report
from demo.config import DemoConfig
from demo.records import git_state
from demo.stats import RULE_VERSION
from graft.rollouts.files import write_text_atomic
from studies import recommend


RECOMPUTED = ("rule", "comparisons", "claim", "models", "adopted", "answers")  # what a rerender computes again


def stamp(before: dict, after: dict) -> dict:
    """`after` with its `rerendered` stamp: `before`'s (or none) when every recomputed field is as it was, else now's
    (the date, the commit and whether its code was clean, the rule's version), beside the version the runs were judged
    under when they ran (`rule_version`: the summary's, or its record's)."""
    if all(before.get(key) == after.get(key) for key in RECOMPUTED):
        return after
    state = git_state()
    code_clean = state["clean"] or all(path.startswith("report/") for path in state.get("changed", []))
    return {**after, "rule_version": before.get("rule_version") or (before.get("record") or {}).get("rule"),
            "rerendered": {"date": dt.date.today().isoformat(), "commit": state["commit"], "code_clean": code_clean,
                           "rule_version": RULE_VERSION}}


def rerender(report_dir: Path) -> dict:
    """One report folder under the current rule; returns its new summary (what summary.json now holds)."""
    before = json.loads((report_dir / "summary.json").read_text())
    summary = _merge(before, _read(report_dir / report.LOCAL_FILE))  # put back what an earlier rerender moved out
    if summary.get("study") == "mutual":  # the mutual study's (studies.mutual_report)
        from studies import mutual_report

        return mutual_report.rerender(report_dir, summary, lambda after: stamp(before, after))
    cfg = DemoConfig.model_validate(summary["config"])
    weak, strong = summary["weak_family"], summary["strong_family"]
    summary["comparisons"] = {mode: c if "same_as" in c else report.comparison(summary["runs"], mode, weak, strong)
                              for mode, c in summary["comparisons"].items()}
    summary["rule"] = report.VERDICT_RULE
    summary = stamp(before, summary)
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
    parser = argparse.ArgumentParser(prog="python -m studies.rerender", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report_dirs", type=Path, nargs="+", help="report folders holding a summary.json")
    for report_dir in parser.parse_args(argv).report_dirs:
        summary = rerender(report_dir)
        verdicts = {mode: c.get("verdict", f"= {c.get('same_as')}") for mode, c in summary["comparisons"].items()}
        print(f"{report_dir}: {verdicts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
