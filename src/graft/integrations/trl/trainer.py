"""`GraftGRPOTrainer`: TRL's GRPOTrainer, grafting peer groups from the store into its all-fail groups (docs/algorithm.md),
and a peer of other runs: it can publish its own groups (graft_publish; co-training sources always do).

It wraps three of TRL's methods and copies none (TRL's replay-buffer GRPO was a copied
`_generate_and_score_completions` that drifted from its parent; this calls the parent and splices its output):
- `_calculate_rewards`: the parent's, whose rewards (gathered over processes) are kept: TRL does not return them,
  and the all-fail groups are found from them (`graft.trainer.gate.classify_group`: no reward > 0).
- `_generate`: the parent's, whose sampled ids and sampling logprobs are kept for publishing.
- `_generate_and_score_completions`, per generation batch:
  1. the peer lookup for the batch's prompts starts in the background on the main process      trainer/peers.py
  2. the parent generates, scores, and computes its advantages
  3. publishing: the batch's groups, with their behaviour logprobs (publish.py says which), go to the store in the
     background, before the wait for a co-trainer's                                             trainer/host.py
  4. the gate on the main process, on what the run's source brings (prefetch: the lookup's answer if it is back within
     the wait, else none: plain GRPO for the batch, counted; cotrain, lockstep: the co-trainer's groups, waited for),
     its decisions broadcast, so every process takes the same ones; the broker's wants and served ledger posted
                                                                                                trainer/gate.py
  5. each grafted group's peer rollouts re-tokenised into the learner's tokens, taking the G slots of the failed
     group in TRL's global row order (RepeatSampler may split a group over processes: each fills its own slots) trainer/retokenize.py
  6. pi_old of the grafted rows (TRL's own logprob function, no grad), then w and b on them     trainer/batch.py
  7. the splice: completion ids and masks re-padded, per-token advantages A[:, None] * c with c = w * b on
     grafted rows and 1 elsewhere, old / reference / sampling logprobs of grafted rows, TRL's vLLM importance
     ratio 1 on them (their correction is b), num_items_in_batch recounted over all processes
A failed group's slots that no peer row fills (a shorter peer group, a dropped row) keep no token (mask 0), as
graft-train drops such rows. Metrics go into TRL's logs under `graft/`, with graft-train's names.
"""

from __future__ import annotations

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

from graft.integrations.trl.config import TRL_SOURCES, GraftConfig
from graft.integrations.trl.publish import sampler_logprobs
from graft.rollouts.sampling import SamplingParams
from graft.schemas import NO_LOGPROBS, PeerLookupRequest, Problem, prompt_id, trainer_generator_id
from graft.trainer import (
    FirstPass,
    GateDecision,
    GraftHost,
    OwnRow,
    PeerRowCounts,
    TrainSample,
    WeightedRows,
    WeightStats,
    gate_groups,
    gate_tally,
    graft_metrics,
    graft_tally,
    grafted_group_rows,
    host_setup,
    learner_stop_token,
    old_logprobs_and_weights,
)

log = logging.getLogger(__name__)
# outputs of the parent that carry more than text tokens: GRAFT has no peer rows for them
UNSUPPORTED_OUTPUTS = ("tool_mask", "pixel_values", "num_images", "token_type_ids", "mm_token_type_ids")


@dataclass
class _Lookup:
    """The batch's peer lookup, started before generation."""

    prompt_ids: list[str]  # (N,) every process's rows' store prompt ids, in TRL's global row order
    stop_token: int  # what the learner's completions of these prompts end with
    problems: dict[str, Problem] = field(default_factory=dict)  # prompt id -> its problem, where the dataset has it
    request: PeerLookupRequest | None = None  # main process only
    pending: Future | None = None
    started: float = field(default_factory=time.perf_counter)


@dataclass
class _Plan:
    """The gate's decisions and the peer rows in the failed groups' slots: the same on every process."""

    decisions: list[GateDecision]  # one per group of the generation batch, in order
    slots: dict[int, TrainSample | None]  # global row -> its peer row (None: the slot keeps no token), grafted groups
    gate: dict[str, int]  # the gate's tally (gate_tally, on the main process's lookup)
    store: dict[str, float]  # the store client's counts since the last batch, and this batch's wait
    counts: PeerRowCounts = field(default_factory=PeerRowCounts)  # what became of the peer rollouts


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
        self._graft_stop_tokens: dict[str, int] = {}  # prompt template -> the learner's stop token
        self._graft_warned_unused = False
        self._graft_generated: tuple[list, list | None] | None = None  # the last _generate's ids and sampling logprobs
        self._graft_publishing: tuple[SamplingParams, str] | None = None  # what the sampler ran, what its logprobs are
        self.graft: GraftHost | None = None
        if self.args.grafts:
            model = self.accelerator.unwrap_model(self.model)
            name = str(model.config.name_or_path)
            self.graft = host_setup(self.args.train_config(name), self._tokenizer, eos_ids=set(self.eos_token_ids),
                                    device=self.accelerator.device, hf_model=model,
                                    talks_to_store=self.accelerator.is_main_process,  # the main process decides for all
                                    runs=TRL_SOURCES,
                                    generator_id=trainer_generator_id("trl", Path(self.args.output_dir).name))
            self._graft_check_problems()
            if self.graft.cfg.publishes:
                self._graft_publishing = self._graft_publishing_setup()

    def _graft_check_problems(self) -> None:
        """A want carries its prompt's problem and gold answer, so that a generator can sample and score it: the
        dataset must have them (refused here, in one line, rather than at the first miss)."""
        if not self.graft.cfg.store.want_misses:
            return
        columns = getattr(self.train_dataset, "column_names", None) or []
        missing = [c for c in (self.args.graft_problem_column, self.args.graft_answer_column) if c not in columns]
        if missing:
            raise ValueError(f"graft_store_options want_misses: a want carries its prompt's problem text and gold answer "
                             f"(a generator samples and scores it), and the dataset has no column {missing} (name them in "
                             "graft_problem_column, graft_answer_column)")

    def _graft_publishing_setup(self) -> tuple[SamplingParams, str]:
        """Refuse what is no sampled group; decide (on the main process: a vLLM server is asked there) and say what the
        published rows' logprobs are."""
        others = [name for name, value in (("tools", self.tools), ("environment_factory", self.environment_factories),
                                           ("rollout_func", self.rollout_func)) if value]
        if others:
            raise ValueError(f"graft_publish (or a co-training graft_peer_source) with {', '.join(others)}: a completion "
                             "then holds what the tools or environment returned, or the function's own rollouts, which "
                             "no sampler drew with the logprobs TRL has: it is not a group to store")
        decided = [sampler_logprobs(self) if self.accelerator.is_main_process else None]
        params, mode, why = broadcast_object_list(decided, from_process=0)[0]
        if self.accelerator.is_main_process:
            (log.warning if mode == NO_LOGPROBS else log.info)(
                "GRAFT publishing: this run's groups go to the store %s as model %s, with behaviour logprobs of %s",
                self.graft.cfg.store.url, self.graft.learner.model_id, why)
        return params, mode

    def train(self, *args: Any, **kwargs: Any):
        try:
            return super().train(*args, **kwargs)
        finally:
            if self.graft is not None and self.graft.peers is not None:
                self.graft.peers.finish(timeout_s=self.graft.cfg.store.timeout_s)  # deliver what waits, or say it
                self.graft.peers.close()

    def _generate(self, prompts: list):
        generated = super()._generate(prompts)
        _, completion_ids, _, _, sampling_logprobs, *_ = generated
        self._graft_generated = (completion_ids, sampling_logprobs)
        return generated

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
        learner_rewards = self._group_rewards(lookup.prompt_ids)
        if self._graft_publishing is not None:  # before the gate: a co-trainer may be waiting for these groups
            self._publish(lookup, output, learner_rewards)
        plan = self._plan(lookup, learner_rewards)
        output, weighted, kept = self._splice(output, plan)
        self._log_graft(plan, weighted, kept, graft_s=lookup_s + time.perf_counter() - began)
        return output

    # ---- 1. the lookup, while TRL generates -------------------------------------------------------------------
    def _start_lookup(self, inputs: list[dict[str, Any]]) -> _Lookup:
        column = self.args.graft_prompt_id_column
        if column not in inputs[0]:
            raise KeyError(f"GRAFT finds peer groups by each prompt's store id: the dataset has no column {column!r} "
                           "(add schemas.prompt_id(problem text) per row, or name the column in graft_prompt_id_column)")
        problem, answer = self.args.graft_problem_column, self.args.graft_answer_column
        rows = gather_object([(str(row[column]), row.get(problem), row.get(answer)) for row in inputs])
        lookup = _Lookup([prompt for prompt, _, _ in rows], self._stop_token(inputs), self._problems(rows))
        if self.graft.peers is not None:
            lookup.request = self.graft.peers.request(lookup.prompt_ids, self.state.global_step)
            lookup.pending = self.graft.peers.start_lookup(lookup.request)
        return lookup

    def _problems(self, rows: list[tuple[str, Any, Any]]) -> dict[str, Problem]:
        """The problems of (prompt id, problem text, answer) rows whose text is the one the id names (sent with wants
        and pushed with groups); a text that is not is refused where wants need it (store_options want_misses)."""
        problems: dict[str, Problem] = {}
        for prompt, text, answer in rows:
            if prompt in problems or not isinstance(text, str) or not text.strip() or answer is None:
                continue
            if prompt_id(text) != prompt:
                if self.graft.cfg.store.want_misses:
                    raise ValueError(f"a row's {self.args.graft_prompt_id_column} is {prompt}, but its "
                                     f"{self.args.graft_problem_column} hashes to {prompt_id(text)}: its wants would name "
                                     "another problem (the store's id of a problem is schemas.prompt_id(problem text))")
                continue
            problems[prompt] = Problem(prompt_id=prompt, dataset=self.graft.cfg.data.dataset, problem=text,
                                       answer=str(answer))
        return problems

    # ---- 3. publishing ----------------------------------------------------------------------------------------
    def _publish(self, lookup: _Lookup, output: dict[str, Any], learner_rewards: list[tuple[str, list[float | None]]]):
        """The batch's groups to the store, from the main process, in the background (GraftHost.publish_own): every
        process's sampled ids, their behaviour logprobs and texts, gathered in TRL's global row order."""
        params, mode = self._graft_publishing
        completion_ids, sampling_logprobs = self._graft_generated
        if mode == NO_LOGPROBS:
            logprobs = [None] * len(completion_ids)
        elif self.use_vllm:  # vLLM's, a missing one (None) as NaN: such a row's group is stored without mu
            logprobs = [[math.nan if lp is None else float(lp) for lp in row] for row in sampling_logprobs]
        else:
            logprobs = self._sampler_logprobs(output, completion_ids)
        eos = set(self.eos_token_ids)
        rows = gather_object([(list(ids), lps, self._tokenizer.decode(ids, skip_special_tokens=True),
                               bool(ids) and ids[-1] in eos) for ids, lps in zip(completion_ids, logprobs, strict=True)])
        if self.graft.peers is None:
            return
        G = self.num_generations
        groups = [(prompt, [OwnRow(ids, lps, text, finished, reward)
                            for (ids, lps, text, finished), reward in zip(rows[g * G : (g + 1) * G], rewards, strict=True)])
                  for g, (prompt, rewards) in enumerate(learner_rewards)]
        self.graft.publish_own(groups, self.state.global_step, params, mode, lookup.problems)

    @torch.no_grad()
    def _sampler_logprobs(self, output: dict[str, Any], completion_ids: list[list[int]]) -> list[list[float]]:
        """The policy's logprobs of this process's sampled tokens at TRL's temperature, right after generation: the
        policy that sampled them (publish.py says when they are mu), through the forward it sampled with (accelerate's
        mixed precision wraps it: bfloat16 autocast on a CPU by default, for generation as for TRL's logprobs). TRL's
        old logprobs where it computed them on the whole completions, else one forward pass of TRL's own."""
        if "old_per_token_logps" in output and not self.mask_truncated_completions:
            logps = output["old_per_token_logps"]
        else:
            mask = torch.zeros_like(output["completion_mask"])  # (B, T): every sampled token, truncated rows' too
            for i, ids in enumerate(completion_ids):
                mask[i, : len(ids)] = 1
            ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
            attention = torch.cat([output["prompt_mask"], mask], dim=1)
            with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
                logps, _, _ = self._get_per_token_logps_and_entropies(
                    self.model, ids, attention, output["completion_ids"].shape[1],
                    batch_size=self.args.per_device_train_batch_size)
        return [logps[i, : len(row)].float().tolist() for i, row in enumerate(completion_ids)]

    # ---- 4, 5. the gate and the peer rows ---------------------------------------------------------------------
    def _plan(self, lookup: _Lookup, learner_rewards: list[tuple[str, list[float | None]]]) -> _Plan:
        G = self.num_generations
        if self.graft.peers is not None:  # the main process decides, every process takes its decisions
            peers, step = self.graft.peers, self.state.global_step
            found = peers.candidates(lookup.pending, lookup.request, learner_rewards, self.graft.refused.usable, step)
            decisions = gate_groups(
                learner_rewards, found.groups, lookup.request, max_grafted_fraction=self.graft.cfg.graft.max_grafted_fraction,
                rng=random.Random(self.args.seed * 7_919 + step),  # graft-train's seeding of the cap
                usable_tokenizers=self.graft.refused.usable, trust_unverified_mu=self.graft.cfg.graft.trust_unverified_mu,
            )
            self.graft.refused.warn(decisions, found.groups)
            # the broker's wants and served ledger, in the background
            peers.after_gate(step, decisions, found, lookup.problems, learner_rewards)
            store = {**self.graft.store.take(), "store_wait_s": found.wait_s}
            payload = [decisions, gate_tally(decisions, found), store]
        else:
            payload = [None, None, None]
        decisions, gate, store = broadcast_object_list(payload, from_process=0)

        plan = _Plan(decisions, {}, gate, store)
        for group, decision in enumerate(decisions):
            if not decision.grafts:
                continue
            plan.counts.peer_rollouts_unused += max(0, len(decision.peer_group.rollouts) - G)
            rows = self._peer_rows(decision, group, plan, lookup.stop_token)
            for slot in range(G):
                plan.slots[group * G + slot] = rows[slot] if slot < len(rows) else None
        if plan.counts.peer_rollouts_unused and not self._graft_warned_unused:
            self._graft_warned_unused = True
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
        if template not in self._graft_stop_tokens:
            self._graft_stop_tokens[template] = learner_stop_token(self._tokenizer, set(self.eos_token_ids), template)
        return self._graft_stop_tokens[template]

    def _peer_rows(self, decision: GateDecision, group: int, plan: _Plan, stop_token: int) -> list[TrainSample]:
        """The peer group's rollouts as learner rows, as graft-train's build_rows makes them, less the dropped ones
        and at most G (the failed group's slots: a seeded pick), with advantages recomputed over those (counted in the
        plan)."""
        return grafted_group_rows(self.graft.cfg, self.graft.learner, decision.peer_group, group, [],
                                  self.graft.peer_tokenizers, stop_token, plan.counts, max_rows=self.num_generations,
                                  pick_seed=self.args.seed * 7_919 + self.state.global_step)

    # ---- 6, 7. pi_old, the weights and the splice -------------------------------------------------------------
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
    def _log_graft(self, plan: _Plan, weighted: WeightedRows | None, kept: int, graft_s: float) -> None:
        """graft-train's metrics of the batch into TRL's logs, under graft/ (the same on every process)."""
        stats, consumed, without_mu, non_finite = WeightStats(), 0, 0, 0
        if plan.slots:  # every process has grafted groups' slots to count (or none has): the collectives match
            # grafted rows whose peer row had no behaviour logprobs (b = 1, w = 1: docs/algorithm.md section 11)
            local_without_mu = sum(1 for row in weighted.rows if row.grafted and row.without_mu)
            local = torch.tensor([[float(kept), float(weighted.dropped_non_finite), float(local_without_mu)]],
                                 device=self.accelerator.device)
            consumed, non_finite, without_mu = (int(v) for v in self.accelerator.gather(local).sum(dim=0).tolist())
            stats = WeightStats.of(gather_object([weighted.grafted]))
        tally = graft_tally(plan.decisions, plan.counts, self.state.global_step, gate=plan.gate, consumed=consumed,
                            without_mu=without_mu, dropped_non_finite=non_finite)
        metrics = {**graft_metrics(tally, stats, host=True), **plan.store, "graft_s": graft_s}
        for name, value in metrics.items():
            self._metrics["train"][f"graft/{name}"].append(float(value))


def _widen(values: Tensor, width: int, fill: float) -> Tensor:
    """(B, T) -> (B, width) right-padded with `fill` (a copy: the parent's tensors stay as they were)."""
    out = torch.full((values.shape[0], width), fill, dtype=values.dtype, device=values.device)
    out[:, : values.shape[1]] = values
    return out
