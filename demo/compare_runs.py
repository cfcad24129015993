"""What two demo runs computed, stage by stage, minus their timings: are they the same to the bit?

    python -m demo.compare_runs OUT_A REPORT_A OUT_B REPORT_B

OUT is a run's --out-dir, REPORT its --report-dir. One line per stage that differs (the warm starts' results and
weights, every RL run's metrics per step and checkpoints, the summary), with its first differing value. Times,
paths and throughputs are left out: they differ between any two runs. Exit status 1 if any stage differs.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

# Fields that measure time or where files went, not what was computed.
NOT_COMPUTED = {"run_dir", "checkpoint", "dir", "peer_dir", "out", "outside_sampling_share", "tokens_per_s"}


def measured_here(key: str) -> bool:
    """Whether a field says something about this invocation, not about what it computed: a time (every `*_s` and
    `*_s_total` field), a clock time (`*_at`: the store's ingest times), a path or a throughput. demo.report keeps
    such fields out of the committed summary.json (issue 51)."""
    return key in NOT_COMPUTED or key.endswith(("_s", "_s_total", "_at"))


def computed(value):
    """The value without its timings, clock times and paths (`measured_here`), and without its records (where, when
    and under which commit it ran: demo.records), which two runs of one computation differ in too."""
    if isinstance(value, dict):
        return {k: computed(v) for k, v in value.items() if not measured_here(k) and k != "record"}
    if isinstance(value, list):
        return [computed(v) for v in value]
    return value


def _run_name(path: Path, runs: Path) -> str:
    """`grpo-s0` (or `graft_cotrain-s0/peer`) from a file under runs/<name>-<hash>/."""
    parts = path.relative_to(runs).parts
    return parts[0].rsplit("-", 1)[0] + ("/peer" if parts[1] == "peer" else "")


def stages(out: Path, report: Path) -> dict[str, object]:
    found: dict[str, object] = {}
    for done in sorted(out.glob("models/*/done.json")):
        role = done.parent.name.split("-")[0]
        found[f"{role} warm start"] = computed(json.loads(done.read_text()))
        found[f"{role} weights"] = hashlib.sha256((done.parent / "sft" / "final" / "model.safetensors").read_bytes()).hexdigest()
    runs = out / "runs"
    for metrics in sorted(runs.glob("**/train/metrics.jsonl")):
        found[f"{_run_name(metrics, runs)} metrics"] = [computed(json.loads(line)) for line in metrics.read_text().splitlines()]
    for weights in sorted(runs.glob("**/checkpoints/*/model.safetensors")):
        found[f"{_run_name(weights, runs)} {weights.parent.name}"] = hashlib.sha256(weights.read_bytes()).hexdigest()
    summary = json.loads((report / "summary.json").read_text())
    found["summary"] = computed({k: v for k, v in summary.items() if k not in ("store_stats", "config", "models")})
    return found


def first_difference(a, b, where: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            found = first_difference(a.get(key), b.get(key), f"{where}.{key}")
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := first_difference(x, y, f"{where}[{i}]"))), None)
    return None if a == b else f"{where or 'value'}: {a!r} vs {b!r}"


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        raise SystemExit(__doc__)
    a, b = stages(Path(argv[0]), Path(argv[1])), stages(Path(argv[2]), Path(argv[3]))
    differing = {name: first_difference(a.get(name), b.get(name)) for name in sorted(set(a) | set(b))}
    differing = {name: diff for name, diff in differing.items() if diff}
    print(f"{len(a) - len(differing)} of {len(a)} stages the same to the bit")
    for name, diff in differing.items():
        print(f"  differs: {name}: {diff[:200]}")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
