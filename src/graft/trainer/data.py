"""What the trainer reads besides the policy: the training prompts (a resumable stream), the supervised
anchor's reference completions and the peers' tokenizers; and the loop's own state, which a resumed run
continues from."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from graft.rollouts.datasets import load_problems
from graft.rollouts.models import load_tokenizer_of, tokenizer_fingerprint
from graft.schemas import Problem
from graft.trainer.config import TrainConfig
from graft.trainer.distributed import DistContext, rank_block

log = logging.getLogger("graft.trainer")


@dataclass
class LoopState:
    """Everything besides weights, optimizer and RNG that a resumed run needs to continue exactly."""

    step: int = 0  # completed training steps (= policy step of the next rollouts)
    epoch: int = 0  # pass over the training problems
    cursor: int = 0  # position in this epoch's order
    grafted_prompts: list[str] = field(default_factory=list)  # prompts grafted in earlier steps (section 8)
    rollouts_generated_total: int = 0
    peer_rollouts_consumed_total: int = 0

    def advance(self, rollouts_generated: int, peer_rollouts_consumed: int, grafted_prompts: list[str]) -> None:
        """One step done: its counts go into the totals, its grafted prompts join the earlier ones."""
        self.step += 1
        self.rollouts_generated_total += rollouts_generated
        self.peer_rollouts_consumed_total += peer_rollouts_consumed
        self.grafted_prompts = sorted(set(self.grafted_prompts) | set(grafted_prompts))


@dataclass
class PromptBlock:
    """This rank's contiguous block of prompts the whole job took from the stream (one process: all of them)."""

    problems: list[Problem]
    offset: int = 0  # index of its first prompt among the job's (seeds and group ids count from it)


class PromptStream:
    """The training problems in a seeded order per epoch; resumable from (epoch, cursor) of a LoopState."""

    def __init__(self, problems: list[Problem], seed: int, shuffle: bool, state: LoopState):
        self.problems, self.seed, self.shuffle, self.state = problems, seed, shuffle, state
        self._order = self._epoch_order(state.epoch)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.problems)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, count: int) -> list[Problem]:
        taken = []
        while len(taken) < count:
            if self.state.cursor >= len(self._order):
                self.state.epoch += 1
                self.state.cursor = 0
                self._order = self._epoch_order(self.state.epoch)
            taken.append(self.problems[self._order[self.state.cursor]])
            self.state.cursor += 1
        return taken

    def take_block(self, count: int, ctx: DistContext) -> PromptBlock:
        """The next `count` prompts of the job, every rank taking them alike (the streams stay in step); this
        rank's block of them (graft.trainer.distributed.split_for_rank)."""
        taken = self.take(count)
        begin, end = rank_block(len(taken), ctx.rank, ctx.world_size)
        return PromptBlock(taken[begin:end], begin)


def training_prompts(cfg: TrainConfig, state: LoopState) -> PromptStream:
    """cfg.data's problems, streamed in the run's order from where `state` stands."""
    problems = load_problems(cfg.data.dataset, limit=cfg.data.limit, problem_field=cfg.data.problem_field,
                             answer_field=cfg.data.answer_field)
    if not problems:
        raise ValueError(f"data set {cfg.data.dataset!r} holds no problems")
    return PromptStream(problems, cfg.seed, cfg.data.shuffle, state)


def load_anchor(cfg: TrainConfig) -> list[tuple[str, str]]:
    """(problem, reference completion) pairs of the supervised anchor, or [] when it is off."""
    if cfg.anchor.dataset is None:
        return []
    path = Path(cfg.anchor.dataset)
    if not path.is_file():
        raise FileNotFoundError(
            f"anchor.dataset {path} does not exist: pass a JSONL file with 'problem' and 'completion' fields"
        )
    pairs = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row = orjson.loads(line)
        if not isinstance(row.get("problem"), str) or not isinstance(row.get("completion"), str):
            raise ValueError(f"{path}:{number}: an anchor row needs string fields 'problem' and 'completion'")
        pairs.append((row["problem"], row["completion"]))
    if not pairs:
        raise ValueError(f"anchor.dataset {path} holds no rows")
    return pairs


def load_step_rows(cfg: TrainConfig) -> dict[int, list[tuple[str, str]]]:
    """anchor.step_rows: step -> its (problem, completion) rows, or {} when there are none."""
    if cfg.anchor.step_rows is None:
        return {}
    path = Path(cfg.anchor.step_rows)
    rows: dict[int, list[tuple[str, str]]] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row = orjson.loads(line)
        if not isinstance(row.get("step"), int) or not isinstance(row.get("problem"), str) \
                or not isinstance(row.get("completion"), str):
            raise ValueError(f"{path}:{number}: a step row needs an integer 'step' and string 'problem' and 'completion'")
        rows.setdefault(row["step"], []).append((row["problem"], row["completion"]))
    return rows


def load_peer_tokenizers(cfg: TrainConfig) -> dict[str, Any]:
    """Peer tokenizers by the tokenizer_id their stored rows carry, loaded as the generator loads them.

    graft.peer_tokenizers maps ids to directories, or lists directories whose fingerprints (the id the
    generator and the trainer store unless told otherwise) are their ids."""
    entries = cfg.graft.peer_tokenizers
    pairs = list(entries.items()) if isinstance(entries, dict) else [(None, path) for path in entries]
    found = {}
    for tokenizer_id, path in pairs:
        if not Path(path).exists():
            raise FileNotFoundError(
                f"graft.peer_tokenizers: {path} does not exist; pass the peer model's (or tokenizer's) directory"
            )
        tokenizer = load_tokenizer_of(path)
        fingerprint = tokenizer_fingerprint(tokenizer)
        if tokenizer_id is not None and tokenizer_id.startswith("tok-") and tokenizer_id != fingerprint:
            log.warning("graft.peer_tokenizers maps %s to %s, whose fingerprint is %s: if the peer sampled with another "
                        "tokenizer, its rows will not decode (counted as dropped_peer_decode)", tokenizer_id, path,
                        fingerprint)
        found[tokenizer_id or fingerprint] = tokenizer
    return found
