"""A run's peer groups and outcomes, recorded step by step, and a rerun of the run from that record that notices
where it parts from it.

- `PeerGroupRecord` appends one line per step to <run_dir>/peer_groups.jsonl (data parallel: rank r > 0 to
  peer_groups.rank<r>.jsonl): every peer group the step's gate chose from, by prompt, as its group id and the sha256
  of its content (`group_digest`), which of them were grafted, what the lookup said besides (ok, miss reasons, the
  co-trainer's silence), and a digest of the learner's own rewards of each prompt (`rewards_digest`): everything the
  gate reads, so that a rerun's gate decides alike, and what the rerun's sampler must reproduce for it to be one.
- `RecordedRun` is that record as a rerun reads it (the replay source, peers.source replay, `graft-train replay
  RUN_DIR`: graft.trainer.peers.Replay): step by step, exactly those groups, fetched from the store by id
  (GET /v1/groups/{id}): no lookup, no wait, no partner. A group the store no
  longer has, or whose content hashes otherwise, stops the rerun with its id; so does the first step whose own
  rewards or grafted groups differ from the record (a sampler that is not bit-identical, another machine's kernels),
  naming the step, the prompts and what differed (ReplayMismatch): never a rerun that runs on with other metrics.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import yaml

from graft.schemas import ROLLOUT_ARROW_SCHEMA, RolloutGroup
from graft.trainer.checkpoint import changed_fields
from graft.trainer.config import TrainConfig
from graft.trainer.gate import GateDecision
from graft.trainer.metrics import truncate_lines
from graft.trainer.store_link import LookupResult

RECORD_NAME = "peer_groups.jsonl"
# What a replay may change from the recorded run's config: where it writes and logs, where the store answers, and
# how peers arrive (its own source, replay) (and `steps`, to fewer: the run's first steps).
REPLAY_MAY_CHANGE = ("run_dir", "peers", "store.url", "store.token", "logging")


class ReplayMismatch(RuntimeError):
    """A replay cannot give the recorded run's step, or parts from it: a group gone or changed, a record missing,
    another config, other own rewards, other grafts."""


STORED_FIELDS = tuple(ROLLOUT_ARROW_SCHEMA.names)  # what a stored row holds, in the schema's order


def group_digest(group: RolloutGroup) -> str:
    """sha256 of the group's stored rows (every stored field of each row, in the schema's order, as JSON): the same for
    the group as a lookup returns it and as GET /v1/groups/{id} returns it, different if any stored field changed.
    Every step records one per peer group the gate chose from: built from the rows' values as they are (~50 us a
    group), not through an Arrow table (~1 ms)."""
    rows = [[getattr(r, name) for name in STORED_FIELDS] for r in group.rollouts]
    return hashlib.sha256(orjson.dumps(rows, option=orjson.OPT_NAIVE_UTC)).hexdigest()


def rewards_digest(rewards: list[float | None]) -> str:
    """16 hex chars of sha256 over a group's rewards, in the order sampled (None for a reward that could not be scored)."""
    return hashlib.sha256(orjson.dumps(rewards)).hexdigest()[:16]


def record_path(run_dir: Path, rank: int = 0) -> Path:
    return Path(run_dir) / (RECORD_NAME if rank == 0 else f"peer_groups.rank{rank}.jsonl")


class PeerGroupRecord:
    """<run_dir>/peer_groups.jsonl, one line per step, appended and flushed as metrics.jsonl is; on resume, the lines
    of steps after the checkpoint are forgotten (those steps run again)."""

    def __init__(self, run_dir: Path, resumed_step: int, rank: int = 0):
        self.path = record_path(run_dir, rank)
        truncate_lines(self.path, resumed_step)

    def write(self, step: int, found: LookupResult | None, decisions: list[GateDecision],
              learner_rewards: list[tuple[str, list[float | None]]]) -> None:
        """The line of metrics step `step` (policy step + 1): the groups the gate chose from, what it grafted, and the
        digests of the learner's own rewards by prompt."""
        with open(self.path, "ab") as f:
            f.write(orjson.dumps(record_line(step, found, decisions, learner_rewards)) + b"\n")
            f.flush()


def record_line(step: int, found: LookupResult | None, decisions: list[GateDecision],
                learner_rewards: list[tuple[str, list[float | None]]]) -> dict[str, Any]:
    found = found or LookupResult()
    return {
        "step": step,
        "ok": found.ok,
        "miss_reasons": found.miss_reasons,
        "peer_silent_steps": None if math.isnan(found.peer_silent_steps) else found.peer_silent_steps,
        "groups": {prompt_id: [{"group_id": g.group_id, "sha256": group_digest(g)} for g in groups]
                   for prompt_id, groups in found.groups.items()},
        "grafted": [d.peer_group.group_id for d in decisions if d.grafts],
        "rewards": {prompt_id: rewards_digest(rewards) for prompt_id, rewards in learner_rewards},
    }


class RecordedRun:
    """The recorded run a replay reruns (peers.source replay): its config checked against the replay's, its record read,
    and each step's groups and outcomes as the record has them."""

    def __init__(self, cfg: TrainConfig, rank: int = 0):
        self.run_dir = Path(cfg.peers.run_dir)
        self.config = check_replay_config(cfg, self.run_dir)
        path = record_path(self.run_dir, rank)
        if not path.is_file():
            raise ReplayMismatch(f"peers.run_dir: {path} does not exist: only a GRAFT run made by this version of "
                                 "graft-train records its peer groups; run it again, then replay it")
        self.lines = {line["step"]: line for line in map(orjson.loads, path.read_bytes().splitlines()) if line}
        unchecked = sorted(step for step, line in self.lines.items() if "rewards" not in line)
        if unchecked:
            raise ReplayMismatch(f"{path} records no digest of the learner's own rewards (steps {unchecked[0]}..."
                                 f"{unchecked[-1]}): an older graft-train wrote it, and a replay of it could not notice "
                                 "where it parts from the run; run it again with this version, then replay it")

    def lookup(self, step: int, fetch: Callable[[str], RolloutGroup | None], store: str) -> LookupResult:
        """The recorded lookup of metrics step `step`, its groups fetched (`fetch`: by id, from the store `store`) and
        checked against their hashes; ReplayMismatch names the first group that is gone or changed."""
        line = self.line(step)
        result = LookupResult(ok=line["ok"], miss_reasons=dict(line["miss_reasons"]),
                              peer_silent_steps=math.nan if line["peer_silent_steps"] is None else line["peer_silent_steps"])
        for prompt_id, recorded in line["groups"].items():
            groups = []
            for entry in recorded:
                where = f"step {step}, prompt {prompt_id}: peer group {entry['group_id']} of the recorded run {self.run_dir}"
                group = fetch(entry["group_id"])
                if group is None:
                    raise ReplayMismatch(f"{where} is gone from the store {store}: the replay cannot give this step's "
                                         "peer groups (replay against the store that served the run, or a copy)")
                digest = group_digest(group)
                if digest != entry["sha256"]:
                    raise ReplayMismatch(f"{where} has changed in the store {store} (sha256 {digest[:12]}..., recorded "
                                         f"{entry['sha256'][:12]}...): the replay would graft other content")
                groups.append(group)
            result.groups[prompt_id] = groups
        return result

    def compare(self, step: int, learner_rewards: list[tuple[str, list[float | None]]], grafted: list[str]) -> None:
        """ReplayMismatch at the first difference from the record at metrics step `step`: the learner's own rewards of
        a prompt (its sampler drew otherwise), then the groups the gate grafted."""
        line = self.line(step)
        now = {prompt_id: rewards_digest(rewards) for prompt_id, rewards in learner_rewards}
        recorded = line["rewards"]
        if now != recorded:
            differ = [p for p in dict.fromkeys([*recorded, *now]) if now.get(p) != recorded.get(p)]
            other = set(now) != set(recorded)
            raise ReplayMismatch(
                f"step {step}: the learner's own " + ("prompts" if other else "rewards") + f" differ from the recorded "
                f"run's ({self.run_dir}) for {len(differ)} of {len(recorded)} prompts (e.g. {', '.join(differ[:3])}): "
                + ("the replay draws other prompts (another data set or seed?)" if other else
                   "its sampler drew other completions than the run's (another machine, kernels or torch build: a "
                   "replay reruns a run on what sampled it bit for bit)") + "; the replay stops here, before training it")
        if grafted != line["grafted"]:
            raise ReplayMismatch(
                f"step {step}: the gate grafted {grafted} where the recorded run ({self.run_dir}) grafted "
                f"{line['grafted']}, from the same peer groups and own rewards: another graft setting or gate; the replay "
                "stops here, before training it")

    def line(self, step: int) -> dict[str, Any]:
        line = self.lines.get(step)
        if line is None:
            raise ReplayMismatch(f"{self.run_dir / RECORD_NAME} has no line for step {step} (it records steps "
                                 f"{min(self.lines, default=0)}..{max(self.lines, default=0)}): replay at most as many "
                                 "steps as the run took")
        return line


def check_replay_config(cfg: TrainConfig, run_dir: Path) -> TrainConfig:
    """The recorded run's config (<run_dir>/config.yaml); ReplayMismatch for a replay whose config differs from it in
    anything but REPLAY_MAY_CHANGE, naming the fields."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ReplayMismatch(f"peers.run_dir: {path} does not exist: {run_dir} is not a graft-train run directory")
    if Path(cfg.run_dir).resolve() == run_dir.resolve():
        raise ReplayMismatch(f"the replay's run_dir is the recorded run's ({run_dir}): give it another (--run-dir)")
    run = TrainConfig.model_validate(yaml.safe_load(path.read_text()))
    recorded = run.model_dump(mode="json")
    replaying = cfg.model_dump(mode="json")
    replaying["steps"] = max(replaying["steps"], recorded["steps"])  # fewer steps: the run's first, a prefix of it
    changed = changed_fields(_without(recorded), _without(replaying))
    if changed:
        raise ReplayMismatch(f"the replay's config differs from the recorded run's ({path}) in {'; '.join(changed)}: a "
                             "replay reruns that run as it was (only " + ", ".join(REPLAY_MAY_CHANGE) + " may change, and steps to fewer); "
                             f"start it with: graft-train replay {run_dir} --run-dir NEW_DIR")
    return run


def _without(config: dict[str, Any]) -> dict[str, Any]:
    config = {section: dict(value) if isinstance(value, dict) else value for section, value in config.items()}
    for name in REPLAY_MAY_CHANGE:
        section, _, field = name.partition(".")
        if field:
            config.get(section, {}).pop(field, None)
        else:
            config.pop(section, None)
    return config
