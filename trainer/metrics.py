"""A step's metrics line (`<run_dir>/metrics.jsonl`, TensorBoard): what was sampled, what the gate did, what the
grafted rows weighed, what the update did, where the time went.

`step_metrics` is a pure function of the step's outcome; `MetricsLog` writes the lines and adds the store
client's counters. Every count it derives from comes from the outcome as a count (groups, rollouts, rows), so
that data parallelism can sum them over ranks (`trainer.distributed.reduce_metrics`) before the fractions.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import orjson

from rollouts.files import write_text_atomic
from trainer.batch import StepRows, WeightedRows
from trainer.config import TrainConfig
from trainer.data import LoopState
from trainer.gate import GateDecision, classify_group
from trainer.rollout import SampledStep
from trainer.update import UpdateResult

if TYPE_CHECKING:
    from trainer.peers import LookupResult, PeerExchange

# The keys every metrics line has (the list); more keys follow them.
METRIC_KEYS = (
    "step", "loss", "reward_mean", "frac_all_fail", "frac_all_success", "peer_hit_rate", "frac_grafted",
    "frac_skipped_no_signal", "frac_dropped_retokenize", "compat_weight_mean", "compat_weight_ess", "log_rho_p10",
    "log_rho_p50", "log_rho_p90", "clip_frac_onpolicy", "clip_frac_grafted", "peer_group_age_steps",
    "rollouts_generated", "peer_rollouts_consumed", "store_wait_s", "step_time_s",
)
NAN = float("nan")


@dataclass
class StepOutcome:
    """What one step did, stage by stage (the loop's local results, handed to `step_metrics` together)."""

    sampled: SampledStep
    peers: LookupResult | None  # None: the gate was off (grpo, dapo)
    decisions: list[GateDecision]
    rows: StepRows
    weighted: WeightedRows
    update: UpdateResult

    @property
    def grafted(self) -> list[GateDecision]:
        return [d for d in self.decisions if d.grafts]

    @property
    def rollouts_generated(self) -> int:
        return sum(len(g.rollouts) for g in self.sampled.generated)

    @property
    def peer_rollouts_consumed(self) -> int:
        return sum(1 for row in self.weighted.rows if row.grafted)


@dataclass
class StepClock:
    """Wall and CPU time of a step, and the time of its stages (`with clock("generation_s"): ...`)."""

    started: float = field(default_factory=time.perf_counter)
    cpu_started: float = field(default_factory=time.process_time)
    laps: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.laps[name] = self.laps.get(name, 0.0) + time.perf_counter() - begin


def step_metrics(cfg: TrainConfig, state: LoopState, outcome: StepOutcome, clock: StepClock, lr: float) -> dict[str, Any]:
    """The metrics line of the step `state` is at (state before it advances), in the order of METRIC_KEYS and then
    the rest."""
    sampled, decisions, rows, update = outcome.sampled, outcome.decisions, outcome.rows, outcome.update
    policy_step, groups = state.step, max(len(decisions), 1)
    rewards = [r.reward or 0.0 for g in sampled.generated for r in g.rollouts]
    # Kinds over every group sampled this step (dapo: before dropping zero-variance ones).
    kinds = [classify_group([r.reward for r in g.rollouts]) for g in sampled.generated]
    all_fail = [d for d in decisions if d.kind == "all_fail"]
    hits = [d for d in all_fail if d.peer_group is not None and d.peer_group.informative]
    grafted = outcome.grafted
    grafted_before = set(state.grafted_prompts)
    previously = [r.reward or 0.0 for g in sampled.generated if g.prompt_id in grafted_before for r in g.rollouts]
    drops = dict(rows.drops)
    drops["non_finite"] += outcome.weighted.dropped_non_finite
    peer_samples_considered = sum(len(g.rollouts) for g in rows.peer_groups_used)
    actions = [d.action for d in decisions]
    metrics: dict[str, Any] = {
        "step": policy_step + 1,
        "loss": update.loss,
        "reward_mean": _mean(rewards),
        "frac_all_fail": kinds.count("all_fail") / max(len(kinds), 1),
        "frac_all_success": kinds.count("all_success") / max(len(kinds), 1),
        "frac_mixed": kinds.count("mixed") / max(len(kinds), 1),
        "peer_hit_rate": len(hits) / len(all_fail) if all_fail and cfg.method == "graft" else NAN,
        "frac_grafted": len(grafted) / groups,
        "frac_skipped_no_signal": sum(a.startswith("skip_") for a in actions) / groups,
        "frac_dropped_retokenize": sum(drops.values()) / max(peer_samples_considered, 1),
        **asdict(outcome.weighted.stats),
        "clip_frac_onpolicy": update.mean("clip_frac_onpolicy"),
        "clip_frac_grafted": update.mean("clip_frac_grafted"),
        "peer_group_age_steps": _mean([policy_step - d.peer_group.policy_step for d in grafted]),
        "peer_group_age_s": _mean([time.time() - d.peer_group.rollouts[0].created_at.timestamp() for d in grafted]),
        "rollouts_generated": outcome.rollouts_generated,
        "peer_rollouts_consumed": outcome.peer_rollouts_consumed,
        "store_wait_s": outcome.peers.wait_s if outcome.peers is not None else 0.0,
        "step_time_s": time.perf_counter() - clock.started,
        "step_cpu_s": time.process_time() - clock.cpu_started,  # this process, all threads (not the scorer's)
        "generation_s": clock.laps["generation_s"],
        "gate_s": clock.laps["gate_s"],
        "update_s": clock.laps["update_s"],
        "reward_previously_grafted": _mean(previously),
        "groups_capped": actions.count("skip_capped"),
        "groups_no_peer": actions.count("skip_no_peer"),
        "groups_peer_uninformative": actions.count("skip_uninformative"),
        "groups_no_peer_tokenizer": actions.count("skip_no_peer_tokenizer"),
        **{f"dropped_{reason}": count for reason, count in drops.items()},
        "rollouts_generated_total": state.rollouts_generated_total + outcome.rollouts_generated,
        "peer_rollouts_consumed_total": state.peer_rollouts_consumed_total + outcome.peer_rollouts_consumed,
        "lr": lr,
        **{name: mean for name, (mean, _) in update.means.items() if not name.startswith("clip_frac")},
        "grad_norm": update.grad_norm,
        "optimizer_updates": update.optimizer_updates,
        "updates_skipped_no_signal": update.updates_skipped_no_signal,
    }
    if sampled.dapo_rounds is not None:
        metrics.update(dapo_rounds=sampled.dapo_rounds, dapo_groups_kept=len(sampled.groups))
    if outcome.peers is not None:
        metrics["peer_lookup_ok"] = float(outcome.peers.ok)
    metrics.update({f"projection_{k}": v for k, v in rows.projections.items()})
    metrics["peer_advantage_mismatch"] = rows.peer_advantage_mismatch
    metrics["same_tokenizer_id_mismatch"] = rows.same_tokenizer_id_mismatch
    if "weight_sync_s" in clock.laps:
        metrics["weight_sync_s"] = clock.laps["weight_sync_s"]
    return metrics


class MetricsLog:
    """metrics.jsonl (and TensorBoard) of a run. On resume, lines of steps after the checkpoint (metrics and
    evaluations) are forgotten: those steps run again."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, resumed_step: int, peers: PeerExchange | None):
        self.path = run_dir / "metrics.jsonl"
        truncate_lines(self.path, resumed_step)
        truncate_lines(run_dir / "eval.jsonl", resumed_step)
        self.peers = peers
        self._previous_counters = asdict(peers.counters) if peers is not None else {}
        self.tensorboard = None
        if cfg.logging.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise RuntimeError(
                    "logging.tensorboard is on but tensorboard is not installed: pip install tensorboard"
                ) from error
            self.tensorboard = SummaryWriter(str(run_dir / "tb"))

    def write(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """Append the line, with the store client's counts of this step (store_*) when the run talks to a store."""
        if self.peers is not None:
            now = asdict(self.peers.counters)
            metrics.update({f"store_{k}": v - self._previous_counters.get(k, 0) for k, v in now.items()})
            metrics["store_available"] = float(self.peers.available)
            self._previous_counters = now
        missing = [k for k in METRIC_KEYS if k not in metrics]
        if missing:
            raise RuntimeError(f"metrics line lacks {missing}")  # a bug in this module, not bad input
        with open(self.path, "ab") as f:
            f.write(orjson.dumps(metrics, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
            f.flush()
        if self.tensorboard is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and key != "step" and math.isfinite(value):
                    self.tensorboard.add_scalar(key, value, metrics["step"])
        return metrics

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()


def truncate_lines(path: Path, step: int) -> None:
    """Keep the lines of `path` (JSON Lines with a "step") up to `step`."""
    if not path.exists():
        return
    lines = [line for line in path.read_bytes().splitlines() if line.strip()]
    kept = [line for line in lines if orjson.loads(line).get("step", 0) <= step]
    write_text_atomic(path, "".join(line.decode() + "\n" for line in kept))


def _mean(values: list[float]) -> float:
    return float(sum(values) / len(values)) if values else NAN
