"""Which GRAFT the demo recommends, chosen by a rule written down before the runs it reads (issue 27).

The rule (RULE below) picks among the GRAFT variants the demo and its study run, on seeds 0-5 (`make demo-choose`:
configs/demo_choose.yaml); the recommended variant's headline figure then comes from seeds 6-8, which play no part in
choosing (`make demo-headline`: the demo on those seeds with the chosen variant, from the config this writes).

    python -m demo.recommend report/choose/summary.json [--write-headline-config demo_out/headline.yaml]
    python -m demo.recommend report/choose/summary.json --headline report/headline/summary.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import yaml

from demo.config import DemoConfig
from rollouts.files import write_text_atomic

# mode in the demo's summary.json -> what it is (every one is GRAFT offline from the peer's stored groups)
CANDIDATES = {
    "graft": "the spec's defaults",
    "graft_no_peer_neg": "peer negatives x0",
    "graft_no_token_is": "b = 1 (no token-level IS)",
    "graft_fix": "the changed GRAFT (LUFFY shaping, w = 1, peer negatives x0, grafted rows x4)",
}
# Each candidate's trainer overrides on top of the demo's offline GRAFT (configs/demo_choose.yaml runs these; a test checks)
CANDIDATE_OVERRIDES = {
    "graft": [],
    "graft_no_peer_neg": ["graft.peer_negative_scale=0"],
    "graft_no_token_is": ["graft.token_is=none"],
    "graft_fix": DemoConfig().rl.variants["graft_fix"],
}
CHOOSE_SEEDS = [0, 1, 2, 3, 4, 5]
HEADLINE_SEEDS = [6, 7, 8]
STRONG_TOLERANCE = 0.02
RULE = (f"among {', '.join(CANDIDATES)}, paired with GRPO by seed over seeds {CHOOSE_SEEDS}: keep those whose mean "
        f"strong-family accuracy is at most {100 * STRONG_TOLERANCE:.0f} points under GRPO's, and recommend the one with the "
        f"largest mean weak-family gain over GRPO (a tie goes to the one listed first, the fewer changes from the spec); "
        f"its headline figure is the same paired gain on seeds {HEADLINE_SEEDS}")


def paired(runs: list[dict], mode: str, family: str, seeds: list[int]) -> list[float]:
    """mode minus GRPO on `family`, one value per seed of `seeds` that both ran."""
    def by_seed(m: str) -> dict[int, float]:
        return {r["seed"]: r["acc_by_family"][family] for r in runs if r["mode"] == m and r["seed"] in seeds}

    grpo, mine = by_seed("grpo"), by_seed(mode)
    return [mine[s] - grpo[s] for s in sorted(set(grpo) & set(mine))]


def _stat(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values) if values else None, "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "seeds": len(values)}


def choose(summary: dict) -> dict:
    weak, strong, runs = summary["weak_family"], summary["strong_family"], summary["runs"]
    table = {}
    for mode in CANDIDATES:
        weak_gain, strong_diff = paired(runs, mode, weak, CHOOSE_SEEDS), paired(runs, mode, strong, CHOOSE_SEEDS)
        if len(weak_gain) < len(CHOOSE_SEEDS):
            raise SystemExit(f"{mode} and GRPO share only {len(weak_gain)} of seeds {CHOOSE_SEEDS} in this summary: run "
                             "`make demo-choose` (configs/demo_choose.yaml) first")
        table[mode] = {"weak_gain": _stat(weak_gain), "strong_diff": _stat(strong_diff),
                       "strong_kept": statistics.fmean(strong_diff) >= -STRONG_TOLERANCE}
    kept = [m for m in CANDIDATES if table[m]["strong_kept"]]
    chosen = max(kept, key=lambda m: table[m]["weak_gain"]["mean"]) if kept else None  # max keeps the first of a tie
    return {"rule": RULE, "weak_family": weak, "strong_family": strong, "candidates": table, "chosen": chosen}


def headline(summary: dict, chosen: str) -> dict:
    weak, strong, runs = summary["weak_family"], summary["strong_family"], summary["runs"]
    weak_gain, strong_diff = paired(runs, chosen, weak, HEADLINE_SEEDS), paired(runs, chosen, strong, HEADLINE_SEEDS)
    if len(weak_gain) < len(HEADLINE_SEEDS):
        raise SystemExit(f"{chosen} and GRPO share only {len(weak_gain)} of seeds {HEADLINE_SEEDS} in this summary")
    return {"mode": chosen, "weak_gain": _stat(weak_gain), "strong_diff": _stat(strong_diff)}


def headline_config(chosen: str) -> dict:
    """DemoConfig fields of the headline runs: GRPO, the spec's GRAFT and the chosen variant on HEADLINE_SEEDS."""
    rl: dict = {"seeds": HEADLINE_SEEDS, "ablation_seeds": HEADLINE_SEEDS, "cotrain": False, "imitation_examples_per_step": 0,
                "ablations": {}, "variants": {}}
    if chosen == "graft_fix":
        rl["variants"] = {chosen: CANDIDATE_OVERRIDES[chosen]}
    elif chosen != "graft":  # the spec's GRAFT is a headline run of every config
        rl["ablations"] = {chosen: CANDIDATE_OVERRIDES[chosen]}
    return {"report_dir": "report/headline", "rl": rl}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demo.recommend", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("choose", type=Path, help="summary.json of the runs on seeds 0-5 (make demo-choose)")
    parser.add_argument("--headline", type=Path, default=None, help="summary.json of the runs on seeds 6-8 (make demo-headline)")
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON here (default: beside the first summary)")
    parser.add_argument("--write-headline-config", type=Path, default=None, metavar="YAML",
                        help="write the demo config of the headline runs (seeds 6-8, the chosen variant) here")
    args = parser.parse_args(argv)
    result = choose(json.loads(args.choose.read_text()))
    print(f"Rule: {RULE}.")
    print(f"| candidate | {result['weak_family']} gain over GRPO | {result['strong_family']} minus GRPO | strong family kept |")
    print("|---|---|---|---|")
    for mode, row in result["candidates"].items():
        print(f"| {mode}: {CANDIDATES[mode]} | {100 * row['weak_gain']['mean']:+.1f} ± {100 * row['weak_gain']['std']:.1f} | "
              f"{100 * row['strong_diff']['mean']:+.1f} | {'yes' if row['strong_kept'] else 'no'} |")
    print(f"chosen: {result['chosen'] or 'none (no candidate kept the strong family)'}")
    if args.headline is not None and result["chosen"]:
        result["headline"] = headline(json.loads(args.headline.read_text()), result["chosen"])
        h = result["headline"]
        print(f"headline, seeds {HEADLINE_SEEDS}: {result['chosen']} minus GRPO {100 * h['weak_gain']['mean']:+.1f} ± "
              f"{100 * h['weak_gain']['std']:.1f} on {result['weak_family']}, {100 * h['strong_diff']['mean']:+.1f} on "
              f"{result['strong_family']}")
    if args.write_headline_config is not None:
        if not result["chosen"]:
            raise SystemExit("no candidate kept the strong family: there is no recommended GRAFT to give a headline figure")
        args.write_headline_config.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(args.write_headline_config, yaml.safe_dump(headline_config(result["chosen"]), sort_keys=False))
        print(f"headline runs' config written to {args.write_headline_config}")
    out = args.out or args.choose.with_name("recommendation.json")
    write_text_atomic(out, json.dumps(result, indent=2))
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
