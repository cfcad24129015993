"""Supervised warm start: next-token loss on the completion (and EOS) given the prompt.

Prompt and completion are tokenised separately and concatenated (a byte-level BPE merges `=\\`
across the boundary otherwise, and the model would then never see the boundary it meets at
sampling time). Two schedules over the same batches (`collate`): the demo's `train_sft` (AdamW with
linear warmup and cosine decay, clipping, checkpoints saved with save_pretrained) and the tests' short
`train_quick` (constant learning rate, AdamW's defaults). They stay two because each world is tuned on
its own: the demo's reported numbers on the first, the trainer tests' learning margins on the second.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from graft.rollouts.files import write_text_atomic


class SFTConfig(BaseModel):
    """One supervised warm-start run."""

    model_config = ConfigDict(extra="forbid")

    steps: int = Field(gt=0, description="length of the learning-rate schedule, in optimizer steps")
    stop_at: int | None = Field(default=None, gt=0, description="stop (and save) at this step of the schedule: a checkpoint whose skill is still emerging (default: steps)")
    batch_size: int = Field(default=128, gt=0, description="examples per step")
    lr: float = Field(default=2e-3, gt=0, description="peak learning rate (AdamW)")
    warmup_steps: int = Field(default=30, ge=0, description="linear warmup steps")
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1, description="cosine decays to lr * this at the last step")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay")
    family_weights: dict[str, float] = Field(description="probability of drawing each family's example, e.g. {add2: 0.97, add3: 0.03}")
    seed: int = Field(default=0, description="seed of the data order")
    save_steps: list[int] = Field(default_factory=list, description="extra steps to save a checkpoint at (the last step is always saved)")
    stop_when: dict[str, float] = Field(
        default_factory=dict,
        description="stop at the first check where each named family's greedy exact-match accuracy on its held-out "
                    "dev problems reaches the value (on its last stop_when_checks checks), e.g. {add3: 0.6}; stop_at (or steps) is then the latest step. A "
                    "skill emerges steeply, and the step where it does moves with the CPU's arithmetic (AVX2 vs AVX-512 "
                    "kernels): a fixed step gives a different model on another machine, a measured level does not",
    )
    stop_when_sampled: dict[str, float] = Field(
        default_factory=dict,
        description="as stop_when, on each family's sampled accuracy (check_samples samples per dev problem at T = 1): the "
                    "level RL starts from, measured as RL samples (a greedy check on a few hundred problems jumps by 5-16 "
                    "points from one check to the next before a skill emerges)",
    )
    check_samples: int = Field(default=0, ge=0, description="samples per dev problem at T = 1 in every check (0: greedy only); needed by stop_when_sampled")
    keep_checkpoints: bool = Field(default=False, description="save a checkpoint at every check (the caller picks its starts from them)")
    check_every: int = Field(default=10, gt=0, description="steps between two checks of stop_when")
    stop_when_checks: int = Field(
        default=1, ge=1,
        description="each family's stop_when level must have held on its last this many checks. Before a skill emerges, "
                    "one check's accuracy on a few hundred dev problems jumps by several points from the next (5.5, 13.5, "
                    "12.0, 6.5% on add3 in ten-step checks), so a single check can stop a warm start whose skill has not begun",
    )


def write_progress(path: Path, done: int, total: int) -> None:
    """`done total` for a parent process to draw a progress bar from."""
    write_text_atomic(path, f"{done} {total}", durable=False)


def lr_at(step: int, cfg: SFTConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def collate(
    tokenizer: PreTrainedTokenizerFast, prompts: list[str], completions: list[str]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, loss_mask), each (B, T); loss_mask is 1 on completion+EOS."""
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(completions, add_special_tokens=False)["input_ids"]
    rows = [p + c + [tokenizer.eos_token_id] for p, c in zip(prompt_ids, completion_ids, strict=True)]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)  # (B, T)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.float32)  # (B, T)
    for i, (row, p) in enumerate(zip(rows, prompt_ids, strict=True)):
        input_ids[i, : len(row)] = torch.tensor(row)
        attention_mask[i, : len(row)] = 1
        loss_mask[i, len(p) : len(row)] = 1.0
    return input_ids, attention_mask, loss_mask


def completion_nll(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood over the tokens where loss_mask is 1 (a scalar)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # (B, T, V)
    token_nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), input_ids[:, 1:], reduction="none")  # (B, T-1)
    mask = loss_mask[:, 1:]  # (B, T-1): the token at t+1 is predicted at t
    return (token_nll * mask).sum() / mask.sum()


def train_sft(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    pools: dict[str, list[tuple[str, str]]],
    cfg: SFTConfig,
    out_dir: Path | None,
    desc: str = "sft",
    progress_path: Path | None = None,
    dev: dict[str, list[tuple[str, str]]] | None = None,
    curve: list[dict] | None = None,
) -> dict[int, Path]:
    """Train on (prompt, completion) pairs drawn from `pools` by `cfg.family_weights`; returns {step: checkpoint dir}.
    `curve` (when given) gets one entry per check: {"step", "greedy": {family: acc}, "sampled": {family: acc}}.

    The run ends at the first check where each family of `cfg.stop_when` has held its level on the `dev` pairs (held
    out from `pools`) on its last `cfg.stop_when_checks` checks, else at `cfg.stop_at` (default: the end of the
    schedule); that step is always saved into `out_dir` (None: nothing is saved, the caller keeps the model in memory)
    and is the largest key of the result."""
    missing = set(cfg.family_weights) - set(pools)
    if missing:
        raise ValueError(f"family_weights names {sorted(missing)} but pools only has {sorted(pools)}")
    unchecked = (set(cfg.stop_when) | set(cfg.stop_when_sampled)) - set(dev or {})
    if unchecked:
        raise ValueError(f"stop_when names {sorted(unchecked)} but no dev pairs were given for them")
    if cfg.stop_when_sampled and not cfg.check_samples:
        raise ValueError("stop_when_sampled needs check_samples > 0 (samples per dev problem)")
    rng = random.Random(cfg.seed)
    families = list(cfg.family_weights)
    weights = [cfg.family_weights[f] for f in families]
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    last = cfg.stop_at or cfg.steps
    if last > cfg.steps:
        raise ValueError(f"stop_at = {cfg.stop_at} lies beyond the schedule's {cfg.steps} steps")
    save_steps = {s for s in cfg.save_steps if s <= last} | {last}
    saved: dict[int, Path] = {}
    held: dict[str, int] = {}  # per condition: its last checks in a row at or above its level (stop_check)
    model.train()
    bar = tqdm(range(1, last + 1), desc=desc, mininterval=1.0)
    for step in bar:
        picks = [rng.choices(families, weights)[0] for _ in range(cfg.batch_size)]
        examples = [rng.choice(pools[f]) for f in picks]
        input_ids, attention_mask, loss_mask = collate(tokenizer, [e[0] for e in examples], [e[1] for e in examples])
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step - 1, cfg)
        loss = completion_nll(model, input_ids, attention_mask, loss_mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
            if progress_path is not None:
                write_progress(progress_path, step, last)
        reached = checked = False
        if (cfg.stop_when or cfg.stop_when_sampled or curve is not None) and dev and (step % cfg.check_every == 0 or step == last):
            checked = True
            greedy = {f: greedy_exact_match(model, tokenizer, pairs) for f, pairs in dev.items()}
            sampled = ({f: sampled_exact_match(model, tokenizer, pairs, cfg.check_samples, seed=cfg.seed + step)
                        for f, pairs in dev.items()} if cfg.check_samples else {})
            if curve is not None:
                curve.append({"step": step, "greedy": greedy, "sampled": sampled})
            held, reached = stop_check(cfg, held, greedy, sampled)
            if (reached or step == last) and (cfg.stop_when or cfg.stop_when_sampled):
                levels = [f"{f} {100 * greedy[f]:.1f}% greedy (stop at {100 * v:.0f}%)" for f, v in cfg.stop_when.items()]
                levels += [f"{f} {100 * sampled[f]:.1f}% sampled (stop at {100 * v:.0f}%)" for f, v in cfg.stop_when_sampled.items()]
                tqdm.write(f"{desc}: step {step}, dev accuracy " + ", ".join(levels)
                           + (f", each on its last {cfg.stop_when_checks} checks" if reached and cfg.stop_when_checks > 1 else "")
                           + ("" if reached else f": not reached by the last step, {last}; the warm start ends there"))
        if out_dir is not None and (step in save_steps or reached or (checked and cfg.keep_checkpoints)):
            path = out_dir / f"step-{step}"
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
            saved[step] = path
        if reached:
            break
    model.eval()
    return saved


def stop_check(cfg: SFTConfig, held: dict[str, int], accuracy: dict[str, float],
               sampled: dict[str, float] | None = None) -> tuple[dict[str, int], bool]:
    """One check of `cfg.stop_when` (on this check's dev greedy `accuracy` per family) and `cfg.stop_when_sampled` (on
    its `sampled` accuracy): each condition's count of its last checks in a row at or above its level (`held`: the
    counts before this check, keyed by family, and `<family>:sampled`), and whether every one has held its level on
    `cfg.stop_when_checks` checks. No condition: never reached."""
    levels = {f: (level, accuracy) for f, level in cfg.stop_when.items()}
    levels |= {f"{f}:sampled": (level, sampled or {}) for f, level in cfg.stop_when_sampled.items()}
    held = {key: held.get(key, 0) + 1 if values[key.split(":")[0]] >= level else 0 for key, (level, values) in levels.items()}
    return held, bool(held) and all(n >= cfg.stop_when_checks for n in held.values())


@torch.no_grad()
def greedy_exact_match(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, pairs: list[tuple[str, str]],
                       max_new_tokens: int = 16) -> float:
    """Share of `pairs` whose greedy completion is exactly the reference completion followed by EOS."""
    prompt_ids = tokenizer([p for p, _ in pairs], add_special_tokens=False)["input_ids"]
    wanted = [ids + [tokenizer.eos_token_id] for ids in tokenizer([c for _, c in pairs], add_special_tokens=False)["input_ids"]]
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(prompt_ids):  # prompts of one length in one batch: no padding to get wrong
        by_length.setdefault(len(ids), []).append(i)
    was_training = model.training
    model.eval()
    hits = 0
    for length, rows in by_length.items():
        input_ids = torch.tensor([prompt_ids[i] for i in rows])  # (B, P)
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        for i, completion in zip(rows, out[:, length:].tolist(), strict=True):  # (B, <= max_new_tokens)
            hits += completion[: len(wanted[i])] == wanted[i]
    model.train(was_training)
    return hits / len(pairs)


@torch.no_grad()
def sampled_exact_match(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, pairs: list[tuple[str, str]],
                        samples: int, seed: int, max_new_tokens: int = 16) -> float:
    """Share of `samples` completions per pair, drawn at temperature 1 (as RL samples), that are exactly the reference
    completion followed by EOS. Seeded, and drawn without touching the global torch RNG the training uses."""
    prompt_ids = tokenizer([p for p, _ in pairs], add_special_tokens=False)["input_ids"]
    wanted = [ids + [tokenizer.eos_token_id] for ids in tokenizer([c for _, c in pairs], add_special_tokens=False)["input_ids"]]
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(prompt_ids):
        by_length.setdefault(len(ids), []).append(i)
    was_training = model.training
    model.eval()
    hits = 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for length, rows in sorted(by_length.items()):
            input_ids = torch.tensor([prompt_ids[i] for i in rows])  # (B, P)
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                                 do_sample=True, temperature=1.0, top_p=1.0, top_k=0, num_return_sequences=samples,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # (B * k, .)
            for j, completion in enumerate(out[:, length:].tolist()):
                hits += completion[: len(wanted[rows[j // samples]])] == wanted[rows[j // samples]]
    model.train(was_training)
    return hits / (len(pairs) * samples)


def train_quick(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, pairs: list[tuple[str, str]], steps: int,
    lr: float = 3e-3, batch_size: int = 32, seed: int = 0,
) -> PreTrainedModel:
    """A few steps on (prompt, completion) pairs drawn uniformly with replacement: constant learning rate,
    AdamW's defaults, no clipping, transformers' own loss on the completion and EOS. The tests' warm start."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        chosen = [pairs[rng.randrange(len(pairs))] for _ in range(batch_size)]
        input_ids, attention_mask, loss_mask = collate(tokenizer, [p for p, _ in chosen], [c for _, c in chosen])
        labels = input_ids.masked_fill(loss_mask == 0, -100)  # (B, T): -100 (ignored) outside completion + EOS
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    return model
