"""A run's peer groups, recorded step by step, and a rerun of the run from that record.

- `PeerGroupRecord` appends one line per step to <run_dir>/peer_groups.jsonl (data parallel: rank r > 0 to
  peer_groups.rank<r>.jsonl): every peer group the step's gate chose from, by prompt, as its group id and the sha256
  of its content (`group_digest`), which of them were grafted, and what the lookup said besides (ok, miss reasons,
  the co-trainer's silence): everything the gate reads, so that a rerun's gate decides alike.
- `ReplaySource` (store.replay_from = RUN_DIR) hands a rerun of that run, step by step, exactly those groups, fetched
  from the store by id (GET /v1/groups/{id}): no lookup, no wait, no partner. A group the store no longer has, or
  whose content hashes otherwise, stops the rerun with its id (ReplayMismatch): never a silent substitute.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import orjson
import yaml

from graft.schemas import RolloutGroup, groups_to_table
from graft.services.store_api.http.client import StoreClient
from graft.trainer.checkpoint import changed_fields
from graft.trainer.config import TrainConfig
from graft.trainer.gate import GateDecision
from graft.trainer.metrics import truncate_lines
from graft.trainer.peers import LookupResult

RECORD_NAME = "peer_groups.jsonl"
# What a replay may change from the recorded run's config: where it writes and logs, and where the store answers (and
# `steps`, to fewer: the run's first steps).
REPLAY_MAY_CHANGE = ("run_dir", "store.replay_from", "store.url", "store.token", "logging")


class ReplayMismatch(RuntimeError):
    """A replay cannot give the recorded run's step: a group gone or changed, a record missing, another config."""


def group_digest(group: RolloutGroup) -> str:
    """sha256 of the group's stored rows (its Arrow table's rows as sorted-key JSON): the same for the group as a
    lookup returns it and as GET /v1/groups/{id} returns it, different if any stored field changed."""
    rows = groups_to_table([group]).to_pylist()
    return hashlib.sha256(orjson.dumps(rows, option=orjson.OPT_SORT_KEYS | orjson.OPT_NAIVE_UTC)).hexdigest()


def record_path(run_dir: Path, rank: int = 0) -> Path:
    return Path(run_dir) / (RECORD_NAME if rank == 0 else f"peer_groups.rank{rank}.jsonl")


class PeerGroupRecord:
    """<run_dir>/peer_groups.jsonl, one line per step, appended and flushed as metrics.jsonl is; on resume, the lines
    of steps after the checkpoint are forgotten (those steps run again)."""

    def __init__(self, run_dir: Path, resumed_step: int, rank: int = 0):
        self.path = record_path(run_dir, rank)
        truncate_lines(self.path, resumed_step)

    def write(self, step: int, found: LookupResult | None, decisions: list[GateDecision]) -> None:
        """The line of metrics step `step` (policy step + 1): the groups the gate chose from and what it grafted."""
        found = found or LookupResult()
        line = {
            "step": step,
            "ok": found.ok,
            "miss_reasons": found.miss_reasons,
            "peer_silent_steps": None if math.isnan(found.peer_silent_steps) else found.peer_silent_steps,
            "groups": {prompt_id: [{"group_id": g.group_id, "sha256": group_digest(g)} for g in groups]
                       for prompt_id, groups in found.groups.items()},
            "grafted": [d.peer_group.group_id for d in decisions if d.grafts],
        }
        with open(self.path, "ab") as f:
            f.write(orjson.dumps(line) + b"\n")
            f.flush()


class ReplaySource:
    """The recorded run's peer groups, step by step, from the store by id (store.replay_from)."""

    def __init__(self, cfg: TrainConfig, rank: int = 0):
        self.run_dir = Path(cfg.store.replay_from)
        check_replay_config(cfg, self.run_dir)
        path = record_path(self.run_dir, rank)
        if not path.is_file():
            raise ReplayMismatch(f"store.replay_from: {path} does not exist: only a GRAFT run made by this version of "
                                 "graft-train records its peer groups; run it again, then replay it")
        self.lines = {line["step"]: line for line in map(orjson.loads, path.read_bytes().splitlines()) if line}
        self.client = StoreClient(cfg.store.url, token=cfg.store.token, timeout_s=cfg.store.timeout_s,
                                  retries=cfg.store.retries)

    def lookup(self, step: int) -> LookupResult:
        """The recorded lookup of metrics step `step`, its groups fetched from the store and checked against their
        hashes; ReplayMismatch names the first group that is gone or changed."""
        line = self.lines.get(step)
        if line is None:
            raise ReplayMismatch(f"{self.run_dir / RECORD_NAME} has no line for step {step} (it records steps "
                                 f"{min(self.lines, default=0)}..{max(self.lines, default=0)}): replay at most as many "
                                 "steps as the run took")
        result = LookupResult(ok=line["ok"], miss_reasons=dict(line["miss_reasons"]),
                              peer_silent_steps=math.nan if line["peer_silent_steps"] is None else line["peer_silent_steps"])
        for prompt_id, recorded in line["groups"].items():
            result.groups[prompt_id] = [self._fetch(step, prompt_id, entry) for entry in recorded]
        return result

    def _fetch(self, step: int, prompt_id: str, entry: dict[str, str]) -> RolloutGroup:
        group = self.client.get_group(entry["group_id"])
        where = f"step {step}, prompt {prompt_id}: peer group {entry['group_id']} of the recorded run {self.run_dir}"
        if group is None:
            raise ReplayMismatch(f"{where} is gone from the store {self.client.base_url}: the replay cannot give "
                                 "this step's peer groups (replay against the store that served the run, or a copy)")
        digest = group_digest(group)
        if digest != entry["sha256"]:
            raise ReplayMismatch(f"{where} has changed in the store {self.client.base_url} (sha256 {digest[:12]}..., "
                                 f"recorded {entry['sha256'][:12]}...): the replay would graft other content")
        return group

    def close(self) -> None:
        self.client.close()


def check_replay_config(cfg: TrainConfig, run_dir: Path) -> None:
    """Refuse a replay whose config differs from the recorded run's (<run_dir>/config.yaml) in anything but
    REPLAY_MAY_CHANGE, naming the fields."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ReplayMismatch(f"store.replay_from: {path} does not exist: {run_dir} is not a graft-train run directory")
    if Path(cfg.run_dir).resolve() == run_dir.resolve():
        raise ReplayMismatch(f"the replay's run_dir is the recorded run's ({run_dir}): give it another (--run-dir)")
    recorded = TrainConfig.model_validate(yaml.safe_load(path.read_text())).model_dump(mode="json")
    replaying = cfg.model_dump(mode="json")
    replaying["steps"] = max(replaying["steps"], recorded["steps"])  # fewer steps: the run's first, a prefix of it
    changed = changed_fields(_without(recorded), _without(replaying))
    if changed:
        raise ReplayMismatch(f"the replay's config differs from the recorded run's ({path}) in {'; '.join(changed)}: a "
                             "replay reruns that run as it was (only " + ", ".join(REPLAY_MAY_CHANGE) + " may change, and steps to fewer); "
                             f"start it with: graft-train replay {run_dir} --run-dir NEW_DIR")


def _without(config: dict[str, Any]) -> dict[str, Any]:
    config = {section: dict(value) if isinstance(value, dict) else value for section, value in config.items()}
    for name in REPLAY_MAY_CHANGE:
        section, _, field = name.partition(".")
        if field:
            config.get(section, {}).pop(field, None)
        else:
            config.pop(section, None)
    return config

