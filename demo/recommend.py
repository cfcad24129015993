"""Which GRAFT the trainers run by default, chosen by a rule written down before the runs it reads (issue 35).

GRAFT_SPEC's formulas are this project's reading of a paper whose exact formulas are not public, so its default is
what the evidence picks among the spec's own options, by RULE below, on dev seeds (`make demo-choose`:
configs/demo_choose.yaml, seeds 10-13 at both starts). The figure of the chosen default then comes from `make demo`
(seeds 0-3), which plays no part in choosing.

The candidates are the four combinations of the two options every GRAFT host runs (graft-train, the TRL adapter, verl):
the token-level correction b (the spec's min(pi_old / mu, 2), or 1) and the peer's negative advantages (x1, the spec's,
or x0). LUFFY's shaping replaces the PPO ratio inside the loss, which TRL computes: it is measured in the study, not a
candidate for the default.

    python -m demo.recommend report/choose/summary.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from demo.report import paired_values
from demo.stats import STRONG_MARGIN, Interval, paired_interval, pct
from graft.rollouts.files import write_text_atomic

# mode -> (what it is, its trainer overrides on top of the demo's offline GRAFT); the first is the spec
CANDIDATES = {
    "graft_spec": ("the spec's formulas", ["graft.token_is=tis", "graft.kappa=1.0", "graft.peer_negative_scale=1.0",
                                           "graft.peer_loss_scale=1.0"]),
    "graft_b1": ("b = 1 (no token-level ratio)", ["graft.token_is=none", "graft.kappa=1.0", "graft.peer_negative_scale=1.0",
                                                  "graft.peer_loss_scale=1.0"]),
    "graft_no_peer_neg": ("peer negatives x0", ["graft.token_is=tis", "graft.kappa=1.0", "graft.peer_negative_scale=0.0",
                                                "graft.peer_loss_scale=1.0"]),
    "graft_b1_no_peer_neg": ("b = 1 and peer negatives x0", ["graft.token_is=none", "graft.kappa=1.0",
                                                             "graft.peer_negative_scale=0.0", "graft.peer_loss_scale=1.0"]),
}
SPEC = "graft_spec"
CHOOSE_SEEDS = [10, 11, 12, 13]
RULE = (f"on seeds {CHOOSE_SEEDS} at every start, each candidate paired with GRPO and with the spec's GRAFT by (start, seed): "
        f"keep the candidates whose strong-family change against GRPO has its 95% interval's lower bound above "
        f"-{100 * STRONG_MARGIN:.0f} points; among those, the ones whose weak-family gain over the spec's GRAFT has its 95% "
        f"interval above 0 beat the spec, and the default is the one of them with the largest mean weak-family gain over "
        f"GRPO (a tie: the one listed first, with fewer changes); if none beats the spec, the spec stays the default")


def choose(summary: dict) -> dict:
    weak, strong, runs = summary["weak_family"], summary["strong_family"], summary["runs"]
    seeds = sorted({r["seed"] for r in runs})
    if seeds != CHOOSE_SEEDS:
        raise SystemExit(f"the summary's runs are on seeds {seeds}, not the dev seeds {CHOOSE_SEEDS}: run `make demo-choose`")
    table = {}
    for mode in CANDIDATES:
        if not any(r["mode"] == mode for r in runs):
            raise SystemExit(f"no {mode} runs in this summary: run `make demo-choose` (configs/demo_choose.yaml)")
        weak_gain = paired_interval(paired_values(runs, mode, weak))
        strong_change = paired_interval(paired_values(runs, mode, strong))
        over_spec = paired_interval(paired_values(runs, mode, weak, baseline=SPEC)) if mode != SPEC else None
        table[mode] = {"weak_gain": weak_gain.as_dict(), "strong_change": strong_change.as_dict(),
                       "weak_over_spec": over_spec.as_dict() if over_spec else None,
                       "strong_kept": strong_change.low > -STRONG_MARGIN,
                       "beats_spec": bool(over_spec and over_spec.low > 0)}
    winners = [m for m in CANDIDATES if table[m]["strong_kept"] and table[m]["beats_spec"]]
    chosen = max(winners, key=lambda m: table[m]["weak_gain"]["mean"]) if winners else SPEC  # max keeps the first of a tie
    return {"rule": RULE, "weak_family": weak, "strong_family": strong, "candidates": table, "chosen": chosen,
            "overrides": CANDIDATES[chosen][1]}


def lines(result: dict) -> list[str]:
    out = [f"Rule (written before the runs): {result['rule']}.", "",
           f"| candidate | `{result['weak_family']}` gain over GRPO [95% CI] | over the spec's GRAFT [95% CI] | "
           f"`{result['strong_family']}` change over GRPO [95% CI] | strong kept | beats the spec |", "|---|---|---|---|---|---|"]
    for mode, row in result["candidates"].items():
        over = pct(Interval(**row["weak_over_spec"])) if row["weak_over_spec"] else "-"
        out.append(f"| {mode}: {CANDIDATES[mode][0]} | {pct(Interval(**row['weak_gain']))} | {over} | "
                   f"{pct(Interval(**row['strong_change']))} | {'yes' if row['strong_kept'] else 'no'} | "
                   f"{'yes' if row['beats_spec'] else 'no'} |")
    out += ["", f"chosen: **{result['chosen']}** ({CANDIDATES[result['chosen']][0]}): `{' '.join(result['overrides'])}`"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demo.recommend", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("choose", type=Path, help="summary.json of the dev-seed runs (make demo-choose)")
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON here (default: recommendation.json beside it)")
    args = parser.parse_args(argv)
    result = choose(json.loads(args.choose.read_text()))
    text = "\n".join(lines(result))
    print(text)
    out = args.out or args.choose.with_name("recommendation.json")
    write_text_atomic(out, json.dumps(result, indent=2))
    write_text_atomic(out.with_name("RECOMMENDATION.md"), "# Which GRAFT is the default\n\n" + text + "\n")
    print(f"written to {out} and {out.with_name('RECOMMENDATION.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
