"""One rank of graft-train under torchrun, with a setting of its own: what a network fault on one node looks like.

    torchrun --nproc-per-node 2 tests/trainer/dist_train_worker.py CONFIG STRATEGY [RANK=STORE_URL ...]

Loads CONFIG, sets parallel.strategy, gives the listed ranks another store.url (test_distributed_train.py: a
dead one), and runs the real training loop (trainer.loop.train), as `python -m trainer.cli train` does.
"""

from __future__ import annotations

import os
import sys

from trainer.config import load_config
from trainer.loop import train


def main() -> None:
    config, strategy, *store_urls = sys.argv[1:]
    rank = os.environ["RANK"]
    overrides = [f"parallel.strategy={strategy}"]
    overrides += [f"store.url={url}" for rank_url in store_urls for who, url in [rank_url.split("=", 1)] if who == rank]
    train(load_config(config, overrides))


if __name__ == "__main__":
    main()
