"""One rank of graft-train under torchrun, with a fault of its own: what a network fault on one node looks like, or
grafted rows that come out non-finite.

    torchrun --nproc-per-node 2 tests/trainer/helpers/dist_train_worker.py CONFIG STRATEGY [RANK=STORE_URL ...]
        [--non-finite-grafts PROMPT_ID,...]

Loads CONFIG, sets parallel.strategy, gives the listed ranks another store.url (test_distributed_train.py: a
dead one), makes the rows grafted for the listed prompts non-finite (`non_finite_grafts`), and runs the real training
loop (graft.trainer.loop.train), as `python -m graft.trainer.cli train` does.
"""

from __future__ import annotations

import argparse
import os
from typing import Callable

import graft.trainer.batch
from graft.schemas.overrides import load_config
from graft.trainer.batch import GraftedWeights, TrainSample, weigh_grafted_rows
from graft.trainer.config import TrainConfig
from graft.trainer.loop import train


def non_finite_grafts(prompt_ids: set[str]) -> Callable[..., GraftedWeights]:
    """graft.trainer.batch's weighing of grafted rows, but the rows grafted for `prompt_ids` come out non-finite (their
    w or pi_old, as when the learner's forward overflows on a peer's text), so the batch drops them after pi_old
    (graft.trainer.batch.old_logprobs_and_weights). The store and the re-tokenisation refuse a peer's non-finite
    logprobs, and a tiny fp32 model does not overflow on chosen rows: the fault is set where the batch decides.
    The ranks install it here, the one-process reference in its own process."""

    def weigh(cfg, grafted: list[TrainSample]) -> GraftedWeights:
        values = weigh_grafted_rows(cfg, grafted)
        for row in grafted:
            row.finite = row.finite and row.prompt_id not in prompt_ids
        return values

    return weigh


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("strategy")
    parser.add_argument("store_urls", nargs="*", help="RANK=STORE_URL: that rank's store.url")
    parser.add_argument("--non-finite-grafts", default="", help="comma-separated prompt ids (non_finite_grafts)")
    args = parser.parse_args()
    rank = os.environ["RANK"]
    overrides = [f"parallel.strategy={args.strategy}"]
    overrides += [f"store.url={url}" for rank_url in args.store_urls
                  for who, url in [rank_url.split("=", 1)] if who == rank]
    if args.non_finite_grafts:
        graft.trainer.batch.weigh_grafted_rows = non_finite_grafts(set(args.non_finite_grafts.split(",")))
    train(load_config(TrainConfig, args.config, overrides))


if __name__ == "__main__":
    main()
