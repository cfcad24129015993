"""`extract_last_boxed` on the texts that made it slow: many unclosed boxes (a completion cut off while repeating
itself), which the first implementation rescanned to the end once per box.

    python -m benchmarks.boxed_bench            # best of 5, seconds per call, for 3 000 and 12 000 unclosed boxes

It runs in the scorer's parent process, outside the per-item timeout: its time is the trainer's.
"""

from __future__ import annotations

import json
import time

from graft.rollouts.scoring import extract_last_boxed


def best_of(text: str, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        extract_last_boxed(text)
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    cases = {
        "unclosed_3000 (21k chars)": "\\boxed{" * 3000,
        "unclosed_12000 (84k chars)": "\\boxed{" * 12000,
        "answer_then_unclosed_3000": "so \\boxed{7} " + "\\boxed{" * 3000,
        "ordinary (2k chars, one box)": "x" * 2000 + " \\boxed{\\frac{1}{2}}",
    }
    print(json.dumps({name: round(best_of(text), 6) for name, text in cases.items()}, indent=1))


if __name__ == "__main__":
    main()
