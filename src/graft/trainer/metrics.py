"""A step's metrics line (`<run_dir>/metrics.jsonl`, TensorBoard): what was sampled, what the gate did, what the
grafted rows weighed, what the update did, where the time went.

`step_metrics` is a function of the step's outcome (and, data parallel, of the other ranks'); `MetricsLog` writes
the lines and counts the store client's calls. Every fraction and mean is derived from counts and sums (groups,
rollouts, rows), which data parallelism adds over the ranks (`graft.trainer.distributed.reduce_metrics`) first.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import orjson
import torch

from graft.rollouts.files import write_text_atomic
from graft.trainer.batch import PeerRowCounts, StepRows, WeightedRows, WeightStats
from graft.trainer.config import TrainConfig
from graft.trainer.data import LoopState
from graft.trainer.distributed import DistContext, gather_lists, reduce_metrics
from graft.trainer.gate import GateDecision, GroupKind, classify_group, gate_tally
from graft.trainer.retokenize import drop_counts, projection_counts
from graft.trainer.sample import SampledStep
from graft.trainer.update import UpdateResult

if TYPE_CHECKING:
    from graft.trainer.store_link import LookupResult, StoreLink

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
    co_trains: bool = False  # the run's source waits for a co-trainer (peers.source cotrain, lockstep; or replays one)

    @property
    def grafted(self) -> list[GateDecision]:
        return [d for d in self.decisions if d.grafts]

    @property
    def rollouts_generated(self) -> int:
        return sum(len(g.rollouts) for g in self.sampled.generated)

    @property
    def peer_rollouts_consumed(self) -> int:
        return sum(1 for row in self.weighted.rows if row.grafted)

    @property
    def peer_rollouts_without_mu(self) -> int:
        """Grafted rows the update trains on whose peer row had no behaviour logprobs (b = 1, w = 1)."""
        return sum(1 for row in self.weighted.rows if row.grafted and row.without_mu)


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


def step_metrics(
    cfg: TrainConfig, state: LoopState, outcome: StepOutcome, clock: StepClock, lr: float,
    store: dict[str, float] | None = None, ranks: DistContext | None = None,
) -> dict[str, Any]:
    """The metrics line of the step `state` is at (state before it advances), in the order of METRIC_KEYS and then
    the rest; `store`: the store client's counts of this step (`MetricsLog.store.take()`).

    Data parallel (`ranks`): every count and sum below is added over the ranks first (the times are the slowest
    rank's, CPU seconds the job's), and the grafted rows' weights are gathered, so that the line is the job's as
    one process would write it; every rank calls this together and gets the line."""
    ranks = ranks or DistContext("none", torch.device("cpu"))
    sums, slowest = _rank_tally(cfg, state, outcome, clock, store or {})
    job = reduce_metrics(ranks, sums=sums, maxima=slowest)
    count = {name: int(value) for name, value in job.items() if name in sums and name.startswith(COUNTED)}
    stats = WeightStats.of(gather_lists(ranks, [outcome.weighted.grafted]))
    rollouts_generated, peer_rollouts_consumed = count["rollouts_generated"], count["peer_rollouts_consumed"]
    metrics: dict[str, Any] = {
        "step": state.step + 1,
        "loss": _ratio(job, "update_loss", default=0.0),
        "reward_mean": _ratio(job, "reward"),
        **graft_metrics(job, stats, gate_on=cfg.method == "graft"),
        "clip_frac_onpolicy": _ratio(job, "update_clip_frac_onpolicy"),
        "clip_frac_grafted": _ratio(job, "update_clip_frac_grafted"),
        # of grafted tokens without mu (docs/algorithm.md section 11; NaN when none trained)
        "clip_frac_grafted_without_mu": _ratio(job, "update_clip_frac_grafted_without_mu"),
        "peer_group_age_s": _ratio(job, "peer_group_age_s"),
        "rollouts_generated": rollouts_generated,
        "store_wait_s": job["store_wait_s"],
        "step_time_s": job["step_time_s"],
        "step_cpu_s": job["step_cpu_s"],  # the ranks' processes, all threads (not the scorers')
        "generation_s": job["generation_s"],
        "gate_s": job["gate_s"],
        "update_s": job["update_s"],
        "reward_previously_grafted": _ratio(job, "reward_previously_grafted"),
        "completion_tokens": count["completion_tokens"],  # tokens the learner sampled this step (generation_s's work)
        "rows": count["rows"],  # rows the update trained on (the learner's, grafted ones)
        "rows_with_signal": count["rows_with_signal"],  # of them, rows with a non-zero advantage: the rest add no gradient
        # which peer groups this step grafted, for which prompts (every rank's)
        "grafted_groups": gather_lists(ranks, [{"prompt_id": d.prompt_id, "group_id": d.peer_group.group_id,
                                                "model_id": d.peer_group.model_id} for d in outcome.grafted]),
        "rollouts_generated_total": state.rollouts_generated_total + rollouts_generated,
        "peer_rollouts_consumed_total": state.peer_rollouts_consumed_total + peer_rollouts_consumed,
        "lr": lr,
        **{name: _ratio(job, f"update_{name}") for name in outcome.update.totals
           if name != "loss" and not name.startswith("clip_frac")},
        "grad_norm": outcome.update.grad_norm,
        "optimizer_updates": outcome.update.optimizer_updates,
        "updates_skipped_no_signal": outcome.update.updates_skipped_no_signal,
    }
    if outcome.sampled.dapo_rounds is not None:
        metrics.update(dapo_rounds=outcome.sampled.dapo_rounds, dapo_groups_kept=count["dapo_groups_kept"])
    if outcome.peers is not None:
        metrics["peer_lookup_ok"] = job["peer_lookup_ok"] / ranks.world_size  # the share of ranks whose lookup answered
        if outcome.co_trains:  # steps in a row the co-trainer sent nothing (the most silent rank's count)
            metrics["cotrain_peer_silent_steps"] = job["cotrain_peer_silent_steps"]
    if "weight_sync_s" in clock.laps:
        metrics["weight_sync_s"] = job["weight_sync_s"]
    for name in store or {}:
        metrics[name] = job[name] / ranks.world_size if name == "store_available" else count[name]
    metrics["world_size"] = ranks.world_size
    return {**{name: metrics[name] for name in METRIC_KEYS}, **metrics}


# Tally names that are counts (written as integers); the others are sums of floats (graft_metrics casts its own).
COUNTED = ("rollouts_generated", "peer_rollouts_consumed", "dapo_groups_kept", "store_", "rows", "completion_tokens")


def _rank_tally(
    cfg: TrainConfig, state: LoopState, outcome: StepOutcome, clock: StepClock, store: dict[str, float]
) -> tuple[dict[str, float], dict[str, float]]:
    """This rank's part of the step's metrics: counts and sums (added over ranks; a mean is a `<name>` sum with a
    `<name>_n` weight) and times (the slowest rank's)."""
    sampled, decisions, update = outcome.sampled, outcome.decisions, outcome.update
    rewards = [r.reward or 0.0 for g in sampled.generated for r in g.rollouts]
    grafted = outcome.grafted
    grafted_before = set(state.grafted_prompts)
    previously = [r.reward or 0.0 for g in sampled.generated if g.prompt_id in grafted_before for r in g.rollouts]
    sums: dict[str, float] = {
        "reward": sum(rewards), "reward_n": len(rewards),
        # kinds over every group sampled this step (dapo: before dropping zero-variance ones)
        **graft_tally(decisions, outcome.rows.counts, state.step, gate=gate_tally(decisions, outcome.peers),
                      consumed=outcome.peer_rollouts_consumed, without_mu=outcome.peer_rollouts_without_mu,
                      dropped_non_finite=outcome.weighted.dropped_non_finite,
                      sampled_kinds=[classify_group([r.reward for r in g.rollouts]) for g in sampled.generated]),
        "peer_group_age_s": sum(time.time() - d.peer_group.rollouts[0].created_at.timestamp() for d in grafted),
        "peer_group_age_s_n": len(grafted),
        "rollouts_generated": outcome.rollouts_generated,
        "step_cpu_s": time.process_time() - clock.cpu_started,
        "reward_previously_grafted": sum(previously), "reward_previously_grafted_n": len(previously),
        "completion_tokens": sum(r.num_tokens for g in sampled.generated for r in g.rollouts),
        "rows": len(outcome.weighted.rows),
        "rows_with_signal": sum(1 for row in outcome.weighted.rows if row.advantage != 0),
        **{name: value for name, value in store.items()},
    }
    for name, (total, weight) in update.totals.items():
        sums[f"update_{name}"], sums[f"update_{name}_n"] = total, weight
    if sampled.dapo_rounds is not None:
        sums["dapo_groups_kept"] = len(sampled.groups)
    if outcome.peers is not None:
        sums["peer_lookup_ok"] = float(outcome.peers.ok)
    slowest = {"store_wait_s": outcome.peers.wait_s if outcome.peers is not None else 0.0,
               "step_time_s": time.perf_counter() - clock.started, **clock.laps}
    if outcome.peers is not None:  # a count, not a time, but the job's is the largest too (NaN: unknown on this rank)
        slowest["cotrain_peer_silent_steps"] = outcome.peers.peer_silent_steps
    return sums, slowest


# ---- GRAFT's part of every trainer's metrics: graft-train's line, TRL's and verl's graft/ logs ------------------

def graft_tally(
    decisions: list[GateDecision], counts: PeerRowCounts, step: int, *, gate: dict[str, int], consumed: int,
    without_mu: int, dropped_non_finite: int, sampled_kinds: list[GroupKind] | None = None,
) -> dict[str, float]:
    """GRAFT's counts of a step (graft-train) or of a generation batch (TRL, verl): every value a count or a sum, which
    data-parallel ranks add (graft.trainer.distributed.reduce_metrics) before `graft_metrics` turns them into rates.

    decisions: the gate's, one per group; counts: what became of the peer rollouts on their way to rows; step: the
    learner's policy step (a grafted group's age counts from it); gate: `gate_tally` of the decisions; consumed: the
    grafted rows the update trains on, without_mu: of them, rows whose peer row had no behaviour logprobs (b = 1,
    w = 1: docs/algorithm.md section 11); dropped_non_finite: grafted rows dropped for a non-finite pi_old or w;
    sampled_kinds: the kind of every group sampled (graft-train's dapo samples groups it does not train on; None: the
    decisions' kinds)."""
    kinds = [d.kind for d in decisions] if sampled_kinds is None else sampled_kinds
    all_fail = [d for d in decisions if d.kind == "all_fail"]
    grafted = [d for d in decisions if d.grafts]
    drops = dict(counts.drops)
    drops["non_finite"] += dropped_non_finite
    return {
        "groups_sampled": len(kinds), "groups_all_fail": kinds.count("all_fail"),
        "groups_all_success": kinds.count("all_success"), "groups_mixed": kinds.count("mixed"),
        "decisions": len(decisions), "all_fail": len(all_fail),
        "peer_hits": sum(1 for d in all_fail if d.peer_group is not None and d.peer_group.informative),
        "grafted": len(grafted), "skipped": sum(d.action.startswith("skip_") for d in decisions),
        "peer_group_age_steps": sum(step - d.peer_group.policy_step for d in grafted),
        "peer_group_age_steps_n": len(grafted),
        "peer_rollouts_consumed": consumed, "peer_rollouts_without_mu": without_mu,
        "peer_rollouts_mu_set_aside": counts.mu_set_aside,
        "peer_samples": counts.peer_samples,
        **{f"dropped_{reason}": count for reason, count in drops.items()},
        **{f"projection_{kind}": count for kind, count in counts.projections.items()},
        "peer_advantage_mismatch": counts.peer_advantage_mismatch,
        "same_tokenizer_id_mismatch": counts.same_tokenizer_id_mismatch,
        "grafted_groups_short": counts.grafted_groups_short,
        "grafted_groups_subsampled": counts.grafted_groups_subsampled,
        "grafted_groups_no_signal": counts.grafted_groups_no_signal,
        "peer_rollouts_unused": counts.peer_rollouts_unused,
        **gate,
    }


def graft_metrics(tally: dict[str, float], stats: WeightStats, *, gate_on: bool = True,
                  host: bool = False) -> dict[str, float]:
    """GRAFT's metrics of a step or a batch from its `graft_tally` (data parallel: the ranks' added) and the grafted rows'
    WeightStats, under the names graft-train's line, TRL's and verl's graft/ logs share. gate_on: False for grpo and
    dapo (graft-train's), whose peer_hit_rate is NaN; host: TRL or verl, whose G slots per group add
    peer_rollouts_unused and grafted_groups_subsampled."""
    groups_sampled, decisions = max(tally["groups_sampled"], 1), max(tally["decisions"], 1)
    counted = ["peer_rollouts_consumed", "peer_rollouts_without_mu", "peer_rollouts_mu_set_aside"]
    counted += ["peer_rollouts_unused", "grafted_groups_subsampled"] if host else []
    counted += [*gate_tally([], None), *(f"dropped_{reason}" for reason in drop_counts()),
                *(f"projection_{kind}" for kind in projection_counts()), "peer_advantage_mismatch",
                "same_tokenizer_id_mismatch",
                "grafted_groups_short",  # lost rows: advantages over the kept ones
                "grafted_groups_no_signal"]  # kept rows of one reward: advantages 0
    return {
        "frac_all_fail": tally["groups_all_fail"] / groups_sampled,
        "frac_all_success": tally["groups_all_success"] / groups_sampled,
        "frac_mixed": tally["groups_mixed"] / groups_sampled,
        "peer_hit_rate": tally["peer_hits"] / tally["all_fail"] if tally["all_fail"] and gate_on else NAN,
        "frac_grafted": tally["grafted"] / decisions,
        "frac_skipped_no_signal": tally["skipped"] / decisions,
        "frac_dropped_retokenize": sum(tally[f"dropped_{reason}"] for reason in drop_counts())
        / max(tally["peer_samples"], 1),
        **asdict(stats),
        "peer_group_age_steps": _ratio(tally, "peer_group_age_steps"),
        **{name: int(tally[name]) for name in counted},
    }


def _ratio(job: dict[str, float], name: str, default: float = NAN) -> float:
    """The mean of a tallied sum over its weight `<name>_n` (default when the weight is 0)."""
    weight = job[f"{name}_n"]
    return float(job[name] / weight) if weight else default


class MetricsLog:
    """metrics.jsonl (and TensorBoard) of a run. On resume, lines of steps after the checkpoint (metrics and
    evaluations) are forgotten: those steps run again."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, resumed_step: int, store: StoreCounts, writes: bool = True):
        self.path = run_dir / "metrics.jsonl"
        self.writes = writes  # data parallel: rank 0 writes, the others only count their store calls
        if writes:
            truncate_lines(self.path, resumed_step)
            truncate_lines(run_dir / "eval.jsonl", resumed_step)
        self.store = store  # the store client's counts per step (store_*), for step_metrics
        self.tensorboard = None
        if cfg.logging.tensorboard and writes:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise RuntimeError(
                    "logging.tensorboard is on but tensorboard is not installed: pip install tensorboard"
                ) from error
            self.tensorboard = SummaryWriter(str(run_dir / "tb"))

    def write(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """Append the line (data parallel: rank 0 only; every rank gets it back)."""
        missing = [k for k in METRIC_KEYS if k not in metrics]
        if missing:
            raise RuntimeError(f"metrics line lacks {missing}")  # a bug in this module, not bad input
        if not self.writes:
            return metrics
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


class StoreCounts:
    """The store client's counts since the last `take` under their metric names (store_*, store_available): graft-train's
    line and TRL's and verl's graft/ logs alike."""

    def __init__(self, link: StoreLink | None):
        self.link = link
        self.previous = asdict(link.counters) if link is not None else {}

    def take(self) -> dict[str, float]:
        """The counts since the last call ({} when the run talks to no store)."""
        if self.link is None:
            return {}
        counts: dict[str, float] = self.link.counters.since(self.previous)
        counts["store_available"] = float(self.link.available)
        self.previous = asdict(self.link.counters)
        return counts


def truncate_lines(path: Path, step: int) -> None:
    """Keep the lines of `path` (JSON Lines with a "step") up to `step`."""
    if not path.exists():
        return
    lines = [line for line in path.read_bytes().splitlines() if line.strip()]
    kept = [line for line in lines if orjson.loads(line).get("step", 0) <= step]
    write_text_atomic(path, "".join(line.decode() + "\n" for line in kept))
