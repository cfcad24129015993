"""`GraftGRPOTrainer`: TRL's GRPOTrainer, grafting peer groups from the store into its all-fail groups (GRAFT_SPEC).

It wraps two of TRL's methods and copies none (TRL's replay-buffer GRPO was a copied
`_generate_and_score_completions` that drifted from its parent; this calls the parent and splices its output):
- `_calculate_rewards`: the parent's, whose rewards (gathered over processes) are kept: TRL does not return them,
  and the all-fail groups are found from them (`graft.trainer.gate.classify_group`: no reward > 0).
- `_generate_and_score_completions`, per generation batch:
  1. the peer lookup for the batch's prompts starts in the background on the main process      trainer/peers.py
  2. the parent generates, scores, and computes its advantages
  3. the gate on the main process (the store's answer if it is back, else none: plain GRPO for the batch, counted),
     its decisions broadcast, so every process takes the same ones                             trainer/gate.py
  4. each grafted group's peer rollouts re-tokenised into the learner's tokens, taking the G slots of the failed
     group in TRL's global row order (RepeatSampler may split a group over processes: each fills its own slots) trainer/retokenize.py
  5. pi_old of the grafted rows (TRL's own logprob function, no grad), then w and b on them     trainer/batch.py
  6. the splice: completion ids and masks re-padded, per-token advantages A[:, None] * c with c = w * b on
     grafted rows and 1 elsewhere, old / reference / sampling logprobs of grafted rows, TRL's vLLM importance
     ratio 1 on them (their correction is b), num_items_in_batch recounted over all processes
A failed group's slots that no peer row fills (a shorter peer group, a dropped row) keep no token (mask 0), as
graft-train drops such rows. Metrics go into TRL's logs under `graft/`, with graft-train's names.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import broadcast_object_list, gather_object
from torch import Tensor
from trl import GRPOTrainer
from trl.data_utils import is_conversational
from trl.models.utils import disable_gradient_checkpointing

from graft.integrations.trl.config import GraftConfig
from graft.rollouts.models import default_model_id, model_fingerprint, tokenizer_fingerprint
from graft.schemas import PeerLookupRequest
from graft.trainer.batch import (
    FirstPass,
    TrainSample,
    WeightedRows,
    WeightStats,
    grafted_group_rows,
    old_logprobs_and_weights,
)
from graft.trainer.config import TrainConfig
from graft.trainer.data import load_peer_tokenizers
from graft.trainer.gate import GateDecision, gate_groups
from graft.trainer.learner import Learner
from graft.trainer.peers import LookupResult, PeerExchange, RefusedTokenizers, gate_tally
from graft.trainer.retokenize import drop_counts, learner_stop_token, projection_counts

log = logging.getLogger(__name__)
NAN = float("nan")
# outputs of the parent that carry more than text tokens: GRAFT has no peer rows for them
UNSUPPORTED_OUTPUTS = ("tool_mask", "pixel_values", "num_images", "token_type_ids", "mm_token_type_ids")


@dataclass
class _Setup:
    """What every generation batch's GRAFT works with (built once, on every process)."""

    cfg: TrainConfig  # graft-train's configuration of this run (GraftConfig.train_config)
    learner: Learner  # the learner's identities as graft-train's shared functions take them
    peer_tokenizers: dict[str, Any]
    refused: RefusedTokenizers
    peers: PeerExchange | None  # the store client, on the main process only
    counters_logged: dict[str, int] = field(default_factory=dict)  # the store counts at the last metrics
    stop_tokens: dict[str, int] = field(default_factory=dict)  # prompt template -> the learner's stop token
    warned_unused: bool = False


@dataclass
class _Lookup:
    """The batch's peer lookup, started before generation."""

    prompt_ids: list[str]  # (N,) every process's rows' store prompt ids, in TRL's global row order
    stop_token: int  # what the learner's completions of these prompts end with
    request: PeerLookupRequest | None = None  # main process only
    pending: Future | None = None
    started: float = field(default_factory=time.perf_counter)


@dataclass
class _Plan:
    """The gate's decisions and the peer rows in the failed groups' slots: the same on every process."""

    decisions: list[GateDecision]  # one per group of the generation batch, in order
    slots: dict[int, TrainSample | None]  # global row -> its peer row (None: the slot keeps no token), grafted groups
    drops: dict[str, int]
    projections: dict[str, int]
    peer_samples: int = 0  # peer rollouts of the grafted groups
    peer_advantage_mismatch: int = 0
    same_tokenizer_id_mismatch: int = 0
    grafted_groups_short: int = 0  # grafted groups that lost rows (dropped, or beyond G): advantages over the rest
    grafted_groups_subsampled: int = 0  # grafted groups larger than G, picked down to G (graft.trainer.batch.pick_rows)
    grafted_groups_no_signal: int = 0  # grafted groups whose kept rows have one reward (advantages 0)
    peer_rollouts_unused: int = 0  # rows of peer groups larger than G, beyond the G slots
    store: dict[str, float] = field(default_factory=dict)  # the gate's tally, the store client's counts and wait


class GraftGRPOTrainer(GRPOTrainer):
    """GRPOTrainer with GRAFT (args: a `GraftConfig`). Without `graft_store_url` it is TRL's GRPOTrainer."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, GraftConfig):
            raise TypeError(f"GraftGRPOTrainer takes a GraftConfig as args, not {type(self.args).__name__}")
        if self.args.grafts and self.beta != 0.0 and self.ref_model is None:
            raise ValueError("beta > 0 with a PEFT model (no separate reference model): GRAFT computes the reference "
                             "logprobs of grafted rows with ref_model; pass a full model, or beta 0")
        if self.args.grafts and self.accelerator.num_processes > 1 and self.args.graft_section().group_normalized_weight:
            raise ValueError("graft_options.group_normalized_weight centres a grafted group's advantages over its rows, "
                             "and TRL may split a group's rows over processes (each weighs its own): leave it off with "
                             f"{self.accelerator.num_processes} processes")
        self._graft_rewards: Tensor | None = None  # (N, F) the parent's gathered rewards of the current batch
        self.graft = self._graft_setup() if self.args.grafts else None

    def _graft_setup(self) -> _Setup:
        model = self.accelerator.unwrap_model(self.model)
        name = str(model.config.name_or_path)
        cfg = self.args.train_config(name)
        tokenizer_id = cfg.model.tokenizer_id or tokenizer_fingerprint(self._tokenizer)
        model_id = cfg.model.model_id or default_model_id(name)
        revision = model_fingerprint(name) if Path(name).is_dir() else name
        learner = Learner(hf_model=model, tokenizer=self._tokenizer, model_id=model_id, tokenizer_id=tokenizer_id,
                          revision=revision, eos_ids=set(self.eos_token_ids), device=self.accelerator.device)
        peer_tokenizers = load_peer_tokenizers(cfg)
        # None: any tokenizer (the uniform projection opted in); else the learner's and the configured peers'
        refused = RefusedTokenizers(None if cfg.graft.uniform_projection else {tokenizer_id, *peer_tokenizers})
        peers = PeerExchange(cfg.store, cfg.graft, model_id) if self.accelerator.is_main_process else None
        return _Setup(cfg, learner, peer_tokenizers, refused, peers)

    def train(self, *args: Any, **kwargs: Any):
        try:
            return super().train(*args, **kwargs)
        finally:
            if self.graft is not None and self.graft.peers is not None:
                self.graft.peers.close()

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._graft_rewards = rewards_per_func  # (N, F), every process's rows
        return rewards_per_func

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        if self.graft is None or not self.model.training:
            return super()._generate_and_score_completions(inputs)
        lookup = self._start_lookup(inputs)
        lookup_s = time.perf_counter() - lookup.started
        self._graft_rewards = None
        output = super()._generate_and_score_completions(inputs)
        began = time.perf_counter()
        plan = self._plan(lookup)
        output, weighted, kept = self._splice(output, plan)
        self._log_graft(plan, weighted, kept, graft_s=lookup_s + time.perf_counter() - began)
        return output

    # ---- 1. the lookup, while TRL generates -------------------------------------------------------------------
    def _start_lookup(self, inputs: list[dict[str, Any]]) -> _Lookup:
        column = self.args.graft_prompt_id_column
        if column not in inputs[0]:
            raise KeyError(f"GRAFT finds peer groups by each prompt's store id: the dataset has no column {column!r} "
                           "(add schemas.prompt_id(problem text) per row, or name the column in graft_prompt_id_column)")
        lookup = _Lookup(gather_object([str(row[column]) for row in inputs]), self._stop_token(inputs))
        if self.graft.peers is not None:
            lookup.request = self.graft.peers.request(lookup.prompt_ids, self.state.global_step)
            lookup.pending = self.graft.peers.start_lookup(lookup.request)
        return lookup

    # ---- 3, 4. the gate and the peer rows ---------------------------------------------------------------------
    def _plan(self, lookup: _Lookup) -> _Plan:
        G = self.num_generations
        learner_rewards = self._group_rewards(lookup.prompt_ids)
        payload: list[Any] = [None, None]
        if self.graft.peers is not None:  # the main process decides, every process takes its decisions
            waited = time.perf_counter()
            found = self.graft.peers.collect(lookup.pending, self.args.graft_lookup_wait_s) if lookup.request \
                else LookupResult(ok=True)
            wait_s = time.perf_counter() - waited
            decisions = gate_groups(
                learner_rewards, found.groups, lookup.request, max_grafted_fraction=self.graft.cfg.graft.max_grafted_fraction,
                rng=random.Random(self.args.seed * 7_919 + self.state.global_step),  # graft-train's seeding of the cap
                usable_tokenizers=self.graft.refused.usable,
            )
            self.graft.refused.warn(decisions, found.groups)
            payload = [decisions, {**gate_tally(decisions, found), **self._store_counts(wait_s)}]
        decisions, store = broadcast_object_list(payload, from_process=0)

        plan = _Plan(decisions, {}, drop_counts(), projection_counts(), store=store or {})
        for group, decision in enumerate(decisions):
            if not decision.grafts:
                continue
            plan.peer_rollouts_unused += max(0, len(decision.peer_group.rollouts) - G)
            rows = self._peer_rows(decision, group, plan, lookup.stop_token)
            for slot in range(G):
                plan.slots[group * G + slot] = rows[slot] if slot < len(rows) else None
        if plan.peer_rollouts_unused and not self.graft.warned_unused:
            self.graft.warned_unused = True
            log.warning("peer groups larger than num_generations = %d: a seeded pick of %d of their rows (a success and a "
                        "failure among them) fills the failed group's slots (the rest counted as "
                        "graft/peer_rollouts_unused); graft-train would train on them all", G, G)
        return plan

    def _group_rewards(self, prompt_ids: list[str]) -> list[tuple[str, list[float | None]]]:
        """(prompt id, rewards) per group: TRL's total reward (the weighted sum; None where every function gave
        None), grouped as TRL groups them (G consecutive rows of the gathered batch)."""
        rewards_per_func = self._graft_rewards  # (N, F)
        weights = self.reward_weights.to(rewards_per_func.device)  # (F,)
        total = (rewards_per_func * weights[None, :]).nansum(dim=1)  # (N,)
        unscorable = torch.isnan(rewards_per_func).all(dim=1)  # (N,)
        values = [None if bad else float(r) for r, bad in zip(total.tolist(), unscorable.tolist())]
        G = self.num_generations
        if len(values) != len(prompt_ids):
            raise RuntimeError(f"{len(values)} rewards for {len(prompt_ids)} prompts: the batch is not TRL's gathered one")
        groups = []
        for begin in range(0, len(values), G):
            ids = set(prompt_ids[begin : begin + G])
            if len(ids) != 1:
                raise RuntimeError(f"rows {begin}..{begin + G - 1} of the batch hold prompts {sorted(ids)}: GRAFT expects "
                                   "TRL's RepeatSampler order (each prompt's G completions on consecutive rows)")
            groups.append((prompt_ids[begin], values[begin : begin + G]))
        return groups

    def _stop_token(self, inputs: list[dict[str, Any]]) -> int:
        """The token the learner's own completions end with, which a finished peer row ends with too."""
        template = "chat" if is_conversational(inputs[0]) else "raw"
        if template not in self.graft.stop_tokens:
            self.graft.stop_tokens[template] = learner_stop_token(self._tokenizer, set(self.eos_token_ids), template)
        return self.graft.stop_tokens[template]

    def _peer_rows(self, decision: GateDecision, group: int, plan: _Plan, stop_token: int) -> list[TrainSample]:
        """The peer group's rollouts as learner rows, as graft-train's build_rows makes them, less the dropped ones
        and at most G (the failed group's slots: a seeded pick), with advantages recomputed over those (counted in the
        plan)."""
        return grafted_group_rows(self.graft.cfg, self.graft.learner, decision.peer_group, group, [],
                                  self.graft.peer_tokenizers, stop_token, plan, max_rows=self.num_generations,
                                  pick_seed=self.args.seed * 7_919 + self.state.global_step)

    # ---- 5, 6. pi_old, the weights and the splice -------------------------------------------------------------
    def _splice(self, output: dict[str, Any], plan: _Plan) -> tuple[dict[str, Any], WeightedRows | None, int]:
        """The parent's output with this process's slots of the grafted groups filled; the grafted rows' weights and
        how many grafted rows kept tokens (this process's)."""
        if not plan.slots:  # nothing grafted anywhere: TRL's batch as it is (plain GRPO)
            return output, None, 0
        unsupported = [key for key in UNSUPPORTED_OUTPUTS if key in output]
        if unsupported:
            raise NotImplementedError(f"GRAFT grafts text completions; this batch also has {unsupported} "
                                      "(tools or images), for which peer rows have nothing")
        B = output["completion_ids"].shape[0]  # this process's rows: global rows [offset, offset + B)
        offset = self.accelerator.process_index * B
        local = {k - offset: row for k, row in plan.slots.items() if offset <= k < offset + B}
        filled = {i: row for i, row in local.items() if row is not None}
        for i, row in filled.items():
            row.prompt_ids = output["prompt_ids"][i][output["prompt_mask"][i].bool()].tolist()

        longest = max([output["completion_ids"].shape[1]] + [len(row.completion_ids) for row in filled.values()])
        if self.pad_to_multiple_of:
            longest = math.ceil(longest / self.pad_to_multiple_of) * self.pad_to_multiple_of
        out = dict(output)
        out["completion_ids"] = _widen(output["completion_ids"], longest, self._tokenizer.pad_token_id)  # (B, T)
        out["completion_mask"] = _widen(output["completion_mask"], longest, 0)  # (B, T)
        for i, row in local.items():
            out["completion_ids"][i] = self._tokenizer.pad_token_id
            out["completion_mask"][i] = 0
            if row is not None:
                n = len(row.completion_ids)
                out["completion_ids"][i, :n] = torch.tensor(row.completion_ids)
                finished = row.num_content_tokens < n
                # TRL's rule for its own rows holds for grafted ones: a truncated completion trains on no token
                out["completion_mask"][i, :n] = 0 if self.mask_truncated_completions and not finished else 1

        # pi_old of the grafted rows, then w and b (graft-train's functions, with pi_old given as the "first pass")
        local_rows = dict(filled)  # every process runs its forward passes on these (the pass count is agreed on them)
        rows = [filled[i] for i in sorted(filled)]
        old = self._logprobs_of_rows(self.model, out, sorted(filled), plan, B)  # (b, T) float32, no grad
        weighted = old_logprobs_and_weights(self.graft.cfg, self.graft.learner, None, rows, FirstPass(rows, None, old.cpu()))
        kept = {id(row) for row in weighted.rows}
        old_of = {i: old[index] for index, i in enumerate(sorted(filled))}  # (T,) each
        for i, row in list(filled.items()):
            if id(row) not in kept:  # non-finite pi_old or w: dropped as graft-train drops it, the slot kept empty
                out["completion_mask"][i] = 0
                del filled[i]
        ref = self._logprobs_of_rows(self.ref_model, out, sorted(local_rows), plan, B) if self.beta != 0.0 else None
        ref_of = {i: ref[index] for index, i in enumerate(sorted(local_rows))} if ref is not None else {}

        device = output["advantages"].device
        advantages = output["advantages"].float()  # (B,) TRL's, from the learner's rewards
        token_weights = torch.ones((B, longest), device=device)  # (B, T) c: 1 on the learner's rows
        is_grafted = torch.zeros(B, dtype=torch.bool, device=device)  # (B,)
        for key, fill in (("old_per_token_logps", 0.0), ("ref_per_token_logps", 0.0), ("sampling_per_token_logps", 0.0)):
            if key in output:
                out[key] = _widen(output[key], longest, fill)
        if "importance_sampling_ratio" in output and output["importance_sampling_ratio"].shape[1] > 1:  # token level
            out["importance_sampling_ratio"] = _widen(output["importance_sampling_ratio"], longest, 1.0)
        for i, row in sorted(filled.items()):
            n = len(row.completion_ids)
            is_grafted[i] = True
            advantages[i] = row.advantage
            token_weights[i] = 0.0
            token_weights[i, :n] = row.token_weight.to(device)
            for key in ("old_per_token_logps", "sampling_per_token_logps"):
                if key in out:  # a peer row's pi_old is its old policy; its behaviour correction is b, not TRL's
                    out[key][i] = 0.0
                    out[key][i, :n] = old_of[i][:n]
            if ref is not None:
                out["ref_per_token_logps"][i] = 0.0
                out["ref_per_token_logps"][i, :n] = ref_of[i][:n]
            if "importance_sampling_ratio" in out:
                out["importance_sampling_ratio"][i] = 1.0
        for i in set(local) - set(filled):
            advantages[i] = 0.0
        out["advantages"] = advantages[:, None] * token_weights  # (B, T) = A[:, None] * c
        # what TRL's token-level losses divide by: every process's completion tokens after the splice
        out["num_items_in_batch"] = self.accelerator.gather(out["completion_mask"].sum()).sum()
        out["graft_sequence_advantages"] = advantages  # (B,) A per row: the trainer's LossBatch.advantages
        out["graft_token_weights"] = token_weights  # (B, T) c per token
        out["graft_is_grafted"] = is_grafted  # (B,)
        return out, weighted, sum(1 for i in filled if out["completion_mask"][i].any())

    @torch.no_grad()
    def _logprobs_of_rows(self, model: torch.nn.Module, batch: dict[str, Any], rows: list[int], plan: _Plan,
                          local_size: int) -> Tensor:
        """TRL's per-token logprobs (at its temperature) of `rows` of the spliced batch: (b, T) float32. Every process
        runs as many forward passes as the one with the most grafted rows (a sharded model's forward is a
        collective); the extra ones on one row, discarded."""
        chunk = self.args.per_device_train_batch_size
        per_process = [0] * self.accelerator.num_processes
        for k, row in plan.slots.items():
            if row is not None:
                per_process[k // local_size] += 1
        passes = max(math.ceil(n / chunk) for n in per_process)
        width = batch["completion_ids"].shape[1]
        out = []
        with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            for p in range(passes):
                index = rows[p * chunk : (p + 1) * chunk] or [0]  # [0]: a padding pass
                ids = torch.cat([batch["prompt_ids"][index], batch["completion_ids"][index]], dim=1)
                mask = torch.cat([batch["prompt_mask"][index], batch["completion_mask"][index]], dim=1)
                logps, _, _ = self._get_per_token_logps_and_entropies(model, ids, mask, width)
                if p * chunk < len(rows):
                    out.append(logps.float())
        return torch.cat(out) if out else torch.zeros((0, width))

    # ---- metrics -----------------------------------------------------------------------------------------------
    def _store_counts(self, wait_s: float) -> dict[str, float]:
        """The store client's counts since the last batch (graft-train's store_* names) and this batch's wait."""
        counts: dict[str, float] = self.graft.peers.counters.since(self.graft.counters_logged)
        self.graft.counters_logged = dataclasses.asdict(self.graft.peers.counters)
        counts["store_wait_s"] = wait_s
        counts["store_available"] = float(self.graft.peers.available)
        return counts

    def _log_graft(self, plan: _Plan, weighted: WeightedRows | None, kept: int, graft_s: float) -> None:
        """graft-train's metrics of the batch into TRL's logs, under graft/ (the same on every process)."""
        decisions = plan.decisions
        kinds = [d.kind for d in decisions]
        actions = [d.action for d in decisions]
        all_fail = [d for d in decisions if d.kind == "all_fail"]
        grafted_groups = [d for d in decisions if d.grafts]
        groups = max(len(decisions), 1)
        stats, consumed, without_mu = WeightStats(), 0, 0
        if plan.slots:  # every process has grafted groups' slots to count (or none has): the collectives match
            # grafted rows whose peer row had no behaviour logprobs (b = 1, w = 1: GRAFT_SPEC section 11)
            local_without_mu = sum(1 for row in weighted.rows if row.grafted and row.without_mu)
            local = torch.tensor([[float(kept), float(weighted.dropped_non_finite), float(local_without_mu)]],
                                 device=self.accelerator.device)
            consumed, non_finite, without_mu = (int(v) for v in self.accelerator.gather(local).sum(dim=0).tolist())
            plan.drops["non_finite"] += non_finite
            stats = WeightStats.of(gather_object([weighted.grafted]))
        hits = sum(1 for d in all_fail if d.peer_group is not None and d.peer_group.informative)
        metrics = {
            "frac_all_fail": kinds.count("all_fail") / groups,
            "frac_all_success": kinds.count("all_success") / groups,
            "frac_mixed": kinds.count("mixed") / groups,
            "peer_hit_rate": hits / len(all_fail) if all_fail else NAN,
            "frac_grafted": len(grafted_groups) / groups,
            "frac_skipped_no_signal": sum(a.startswith("skip_") for a in actions) / groups,
            "frac_dropped_retokenize": sum(plan.drops.values()) / max(plan.peer_samples, 1),
            **dataclasses.asdict(stats),
            "peer_group_age_steps": (sum(self.state.global_step - d.peer_group.policy_step for d in grafted_groups)
                                     / len(grafted_groups)) if grafted_groups else NAN,
            "peer_rollouts_consumed": consumed,
            "peer_rollouts_without_mu": without_mu,
            "peer_rollouts_unused": plan.peer_rollouts_unused,
            **{f"dropped_{reason}": count for reason, count in plan.drops.items()},
            **{f"projection_{kind}": count for kind, count in plan.projections.items()},
            "peer_advantage_mismatch": plan.peer_advantage_mismatch,
            "same_tokenizer_id_mismatch": plan.same_tokenizer_id_mismatch,
            "grafted_groups_short": plan.grafted_groups_short,
            "grafted_groups_subsampled": plan.grafted_groups_subsampled,
            "grafted_groups_no_signal": plan.grafted_groups_no_signal,
            **plan.store,
            "graft_s": graft_s,
        }
        for name, value in metrics.items():
            self._metrics["train"][f"graft/{name}"].append(float(value))


def _widen(values: Tensor, width: int, fill: float) -> Tensor:
    """(B, T) -> (B, width) right-padded with `fill` (a copy: the parent's tensors stay as they were)."""
    out = torch.full((values.shape[0], width), fill, dtype=values.dtype, device=values.device)
    out[:, : values.shape[1]] = values
    return out
