"""docker-compose's one-shot `models` service: the toy learner and peer, and their problems, in a models folder.

    python -m toy.setup_models /models            # builds learner/, peer/, train.jsonl, anchor.jsonl when absent
    python -m toy.setup_models /models --require  # only checks that learner/ and peer/ are there (the GPU form)

The models are `toy.world.build_toy_models`'s: a character-level Llama learner warm-started on one half of
the toy addition problems and a byte-level BPE Qwen3 peer on the other half, so the learner's groups on the
peer's half are all-fail and GRAFT has something to graft. A folder that already holds learner/ and peer/
(one's own models, or a previous run's) is left as it is: a restarted service builds nothing.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

MODELS = ("learner", "peer")
FILES = ("train.jsonl", "anchor.jsonl")


def present(folder: Path) -> bool:
    return all((folder / name).exists() for name in MODELS)


def build(folder: Path, problems_per_family: int, sft_steps: int, seed: int) -> None:
    """Build in a staging folder beside the targets, then move each into place, peer last: `present` never sees
    half a build, and a build cut off midway is redone from the start."""
    from toy.models import count_parameters
    from toy.world import build_toy_models
    from transformers import AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".setup-models-", dir=folder) as staging:
        world = build_toy_models(Path(staging), problems_per_family, sft_steps, sft_steps, seed)
        for name in (*FILES, *MODELS):
            target = folder / name
            if target.is_dir():
                shutil.rmtree(target)  # a previous build's part (the check above found the set incomplete)
            (Path(staging) / name).replace(target)
    for name in MODELS:
        parameters = count_parameters(AutoModelForCausalLM.from_pretrained(folder / name))
        print(f"models: {name} in {folder / name} ({parameters:,} parameters)", flush=True)
    print(f"models: {len(world.learner_problems) + len(world.peer_problems)} problems in {folder / 'train.jsonl'}",
          flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toy.setup_models", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="the models folder (compose mounts it at /models)")
    parser.add_argument("--require", action="store_true", help="build nothing: exit 2 unless learner/ and peer/ are there")
    parser.add_argument("--problems-per-family", type=int, default=16)
    parser.add_argument("--sft-steps", type=int, default=70, help="warm-start steps of each model")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if present(args.folder):
        print(f"models: {args.folder} holds {' and '.join(f'{m}/' for m in MODELS)}: nothing to build", flush=True)
        return 0
    if args.require:
        missing = [f"{args.folder / m}/" for m in MODELS if not (args.folder / m).exists()]
        print(f"models: {', '.join(missing)} missing: put your models (HF directories or .gguf files) there "
              f"(GRAFT_MODELS_DIR is mounted at {args.folder}), or run the CPU form with its toy models "
              "(docker-compose -f docker-compose.yml -f docker-compose.cpu.yml up)", file=sys.stderr, flush=True)
        return 2
    print(f"models: building the toy learner and peer into {args.folder} (about a minute on 2 cores)", flush=True)
    started = time.perf_counter()
    build(args.folder, args.problems_per_family, args.sft_steps, args.seed)
    print(f"models: ready in {time.perf_counter() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
