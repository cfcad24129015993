"""`graft-train` as trainer_bench --ranks runs it: the same command (`python -m graft.trainer.cli` under torchrun or
alone), and at exit this process's peak resident memory in $GRAFT_BENCH_RSS_DIR/rank<RANK>.json (the rank's own
process; its scorer workers are processes of their own and not counted).

    GRAFT_BENCH_RSS_DIR=DIR torchrun --nproc-per-node 2 -m benchmarks.traced_train train --config CONFIG ...
"""

from __future__ import annotations

import atexit
import json
import os
import resource
from pathlib import Path


def _write_peak_rss(directory: Path) -> None:
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kilobytes
    (directory / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps({"peak_rss_mb": peak_mb}))


def main() -> None:
    directory = Path(os.environ["GRAFT_BENCH_RSS_DIR"])
    directory.mkdir(parents=True, exist_ok=True)
    atexit.register(_write_peak_rss, directory)
    from graft.trainer.cli import app

    app(prog_name="graft-train")


if __name__ == "__main__":
    main()
