"""Configs of `graft-generate`, `graft-eval`, `graft-import` and `graft-rescore`: one pydantic model each, readable from
YAML, every field settable from the command line as graft-train's are (`--config PATH`, a few named flags, `--set
field=value` over the file, `show-config`: graft.schemas.overrides). What they share is a section each, written once
with its one validator: `prompt` (rollouts.prompts.PromptConfig, graft-train's too), `sampler` (which backend samples, or
teacher-forces for graft-rescore: rollouts.backends) and `scoring` (math-verify's workers)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, model_validator

from graft.rollouts.backends import HFSettings, SamplerConfig, sampler_section
from graft.rollouts.openai_backend import OpenAIBackendConfig
from graft.rollouts.prompts import PromptConfig
from graft.rollouts.traces import FORMAT_COLUMNS, TraceColumns, TraceFormat
from graft.schemas.api import MAX_LEASE_S
from graft.schemas.rollout import SAFE_NAME_PATTERN
from graft.schemas.sections import Section, refuse_moved

if TYPE_CHECKING:
    from graft.rollouts.scoring import Scorer


# The keys of earlier releases that the shared sections took, refused naming the key that replaced each.
MOVED_TO_SECTIONS = {
    "backend": "sampler.backend", "openai": "the sampler section (sampler.backend openai, its settings beside it: "
    "sampler.base_url, ...)", "dtype": "sampler.dtype", "hf_batch_size": "sampler.batch_size",
    "vllm_max_model_len": "sampler.max_model_len", "vllm_gpu_memory_utilization": "sampler.gpu_memory_utilization",
    "template": "prompt.template", "few_shot": "prompt.few_shot", "instruction": "prompt.instruction",
    "system_prompt": "prompt.system_prompt", "score_workers": "scoring.workers", "score_timeout_s": "scoring.timeout_s",
}


class ScoringConfig(Section):
    """How math-verify scores a command's samples (the `scoring` section of graft-generate, graft-eval, graft-import):
    its worker processes and the time one answer may take."""

    workers: int = Field(default=2, ge=1, description="math-verify worker processes")
    timeout_s: float = Field(default=5.0, gt=0, description="one answer's scoring time limit (reward 0 when hit)")

    def scorer(self) -> Scorer:
        """The scorer these settings describe (its workers start now: they import sympy while a model loads)."""
        from graft.rollouts.scoring import Scorer

        return Scorer(num_workers=self.workers, timeout_s=self.timeout_s)


SAMPLER_DOC = ("which backend samples, and its settings beside it: backend hf (dtype, batch_size), vllm (dtype, "
               "max_model_len, gpu_memory_utilization) or openai (base_url, served_model, logprobs_mode, ...)")


class _GeneratorSide(Section):
    # the keys of MOVED_TO_SECTIONS this command took in earlier releases (refused naming the new one; others: typos)
    MOVED: ClassVar[tuple[str, ...]] = tuple(MOVED_TO_SECTIONS)

    @model_validator(mode="before")
    @classmethod
    def _refuse_moved_keys(cls, data: Any) -> Any:
        refuse_moved(data, {key: MOVED_TO_SECTIONS[key] for key in cls.MOVED})
        return data


class GeneratorConfig(_GeneratorSide):
    """`graft-generate`: sample groups for a dataset's prompts, score them, and store them."""

    model: str = Field(description="model path: an HF directory, a .gguf file, or a directory holding one (backend openai: "
                                   "the served model's folder, or its tokenizer's)")
    model_id: str | None = Field(default=None, description="path-safe model name stored with every row (default: the path's name)")
    model_revision: str | None = Field(default=None, description="revision stored with every row (default: a fingerprint of the weights; "
                                                                "backend openai with a tokenizer-only folder: required)")
    sampler: SamplerConfig = Field(default_factory=HFSettings, description=SAMPLER_DOC)
    dataset: str = Field(description="a JSONL/Parquet file with one problem per row (columns problem_field and answer_field), or a known name (math_train, gsm8k, ...)")
    dataset_limit: int | None = Field(default=None, ge=1, description="use only the first N problems")
    problem_field: str = Field(default="problem", min_length=1, description="the dataset's column holding the problem text (a raw GSM8K file: question)")
    answer_field: str | None = Field(default=None, min_length=1, description="the dataset's column holding the gold answer (default: answer); GSM8K's '... #### 7' is read as 7")
    prompt: PromptConfig = Field(default_factory=PromptConfig, description="the prompt the model sees (a learner grafting these groups: its own prompt section, the same)")
    group_size: int = Field(default=8, ge=1, description="samples per prompt (G)")
    temperature: float = Field(default=1.0, ge=0.0, description="sampling temperature (1.0: stored logprobs are the policy's own)")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="nucleus sampling mass")
    top_k: int | None = Field(default=None, ge=0, description="top-k cut (none by default)")
    max_tokens: int = Field(default=4096, ge=1, description="completion token budget")
    seed: int | None = Field(default=None, description="base sampling seed (each batch derives its own); none: fresh randomness")
    rounds: int = Field(default=1, ge=1, description="groups per prompt (one per round); ignored in continuous mode")
    prompts_per_batch: int = Field(default=32, ge=1, description="prompts sampled, scored and written together (one shard)")
    store: str = Field(description="store root directory (shards written directly), store URL http(s)://... (push ingest), "
                                   "or a lake 'ducklake:postgres:...' / 'ducklake:sqlite:...' (one transaction per batch)")
    store_token: str | None = Field(default=None, description="bearer token for push ingest (URL mode)")
    policy_step: int = Field(default=0, ge=0, description="training step of the model, stored with every row")
    generator_id: str | None = Field(default=None, description="name of this process in the rows (default: host-pid)")
    std_normalize: bool = Field(default=True, description="GRPO advantages divide by the group's std (false: Dr. GRPO)")
    scoring: ScoringConfig = Field(default_factory=ScoringConfig, description="math-verify's workers and time limit")
    continuous: bool = Field(default=False, description="keep sampling (rounds without end); reload when watch_dir has a newer checkpoint")
    watch_dir: str | None = Field(default=None, description="continuous mode: a folder of step_<N>/ HF checkpoints (a trainer's checkpoints/)")
    max_batches: int | None = Field(default=None, ge=1, description="stop after this many batches are stored, the wanted prompts' included (default: when done, or never in continuous mode)")
    follow_wanted: bool = Field(default=False, description="continuous mode with a store URL: before each batch of the dataset, sample a batch of the prompts learners want (all-fail prompts no peer group served yet, that this model can serve), their problems as the store has them, each leased to this generator alone (POST /v1/wanted/lease)")
    wanted_order: Literal["oldest", "most_wanted"] = Field(default="oldest", description="follow_wanted: oldest want first, or most learners (then most misses) first")
    wanted_lease_s: float = Field(default=900.0, gt=0, le=MAX_LEASE_S, description="follow_wanted: how long a wanted prompt is this generator's alone (by the store's clock) if no group of it comes back sooner: longer than one batch takes")
    idle_sleep_s: float = Field(default=5.0, gt=0, description="continuous mode: wait between checks when nothing is left to sample")
    progress: bool = Field(default=True, description="show a progress bar")

    @model_validator(mode="after")
    def _continuous_needs_nothing_else(self) -> GeneratorConfig:
        if self.watch_dir is not None and not self.continuous:
            raise ValueError("watch_dir is only read in continuous mode: set continuous: true, or drop watch_dir")
        if self.watch_dir is not None and self.sampler.backend == "openai":
            raise ValueError("watch_dir reloads a local checkpoint; backend openai samples what the server serves: drop "
                             "watch_dir (restart the server on a new checkpoint, and the run with its model_revision)")
        if self.follow_wanted and not (self.continuous and self.store.startswith(("http://", "https://"))):
            raise ValueError("follow_wanted asks a store server for wanted prompts between batches: it needs continuous: "
                             f"true and store set to the server's URL (here continuous={self.continuous}, store={self.store})")
        for name in ("wanted_order", "wanted_lease_s"):
            if getattr(self, name) != type(self).model_fields[name].default and not self.follow_wanted:
                raise ValueError(f"{name} is read only with follow_wanted: set follow_wanted, or drop it")
        return self

    def sampling_key(self) -> str:
        """12 hex chars of every setting that changes what a group holds besides the model: the prompt (template,
        worked examples, instruction, system prompt), the gold (answer column), the sampling (G, temperature, top_p,
        top_k, max_tokens) and the advantages. Part of each group id, so that a re-run with other settings never
        takes the groups of the first for its own (`graft.services.generator.generate`). Not in it: backend, dtype, seed
        and batch sizes, which change which samples are drawn but not the distribution they come from. A served
        model's raw_logprobs are in it (its rows hold other logprobs); processed_logprobs, what every backend
        stores by default, is left out, so that the keys of earlier runs stand."""
        settings = {  # the names of earlier releases' flat fields: the keys of their stored groups stand
            "template": self.prompt.template, "few_shot": self.prompt.few_shot, "instruction": self.prompt.instruction,
            "system_prompt": self.prompt.system_prompt, "answer_field": self.answer_field, "group_size": self.group_size,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k or None,
            "max_tokens": self.max_tokens, "std_normalize": self.std_normalize,
        }
        if self.sampler.backend == "openai" and self.sampler.logprobs_mode != "processed_logprobs":
            settings["logprobs_mode"] = self.sampler.logprobs_mode
        return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]

    def missing_inputs(self) -> list[str]:
        """Each input that is not there or cannot be read, as `field: what is wrong` (as graft-train's dry run checks
        its paths): the model and the dataset (read whole, with its columns)."""
        from graft.rollouts.datasets import load_problems
        from graft.rollouts.models import find_gguf

        problems = []
        model = Path(self.model).expanduser()
        if not model.exists():
            problems.append(f"model: {self.model} does not exist (an HF model directory, a .gguf file, or a folder holding one)")
        elif self.sampler.backend == "openai":
            problems += served_model_problems(model, self.sampler, needs_revision=self.model_revision is None)
        else:
            try:
                if find_gguf(model) is None and not (model / "config.json").exists():
                    problems.append(f"model: {self.model} is neither an HF model directory (no config.json) nor a GGUF "
                                    "file or a folder holding one")
            except ValueError as error:
                problems.append(f"model: {error}")
        try:
            if not load_problems(self.dataset, limit=self.dataset_limit, problem_field=self.problem_field,
                                 answer_field=self.answer_field):
                problems.append(f"dataset: {self.dataset} holds no problems")
        except (FileNotFoundError, ValueError) as error:
            problems.append(f"dataset: {error}")
        return problems  # watch_dir may not exist yet: the trainer it follows makes it


class ImportConfig(_GeneratorSide):
    """`graft-import`: text-only traces from local files into stored groups without behaviour logprobs."""

    MOVED = ("score_workers", "score_timeout_s")

    files: list[str] = Field(min_length=1, description="trace files, or folders of them (a TRL run's output_dir or its "
                                                       "completions/, a verl rollout_data_dir, a save_to_disk folder)")
    format: TraceFormat = Field(default="columns", description="columns (JSONL/Parquet/save_to_disk, the *_column "
                                "fields), trl (completions/*.parquet) or verl (rollout_data_dir/*.jsonl)")
    model_id: str = Field(pattern=SAFE_NAME_PATTERN, description="the model that wrote the traces, stored with every "
                                                                 "row (a path-safe name)")
    model_revision: str = Field(default="", description="its revision, stored with every row (unknown: empty; the "
                                "weights' fingerprint, as graft-generate stores it, lets a rescoring by those weights "
                                "show it is the traces' author)")
    tokenizer: str = Field(description="the traces' tokenizer: an HF model or tokenizer folder, or a .gguf file (the "
                                       "completions are stored as its token ids; TRL: the run's own, whose chat "
                                       "template rendered its conversational prompts)")
    store: str = Field(description="store root directory, store URL http(s)://... (push ingest), or a lake "
                                   "'ducklake:...', as graft-generate's")
    store_token: str | None = Field(default=None, description="bearer token for push ingest (URL mode)")
    problems: str | None = Field(default=None, description="the learner's dataset (JSONL/Parquet or a known name) the "
                                 "trace prompts are matched to: a prompt equal to a problem, or holding one's text (the "
                                 "longest), takes its text (the store's prompt id, which a learner's lookup asks for), "
                                 "dataset and gold; trl and verl need it (or prompts_are_problems)")
    problem_field: str = Field(default="problem", min_length=1, description="problems: the column of the problem text")
    answer_field: str | None = Field(default=None, min_length=1, description="problems: the column of the gold answer "
                                     "(default: answer)")
    prompts_are_problems: bool = Field(default=False, description="trl/verl without problems: the prompts are the "
                                       "problems' own texts (stored under their ids as they are)")
    eval_problems: str | None = Field(default=None, description="the run's evaluation set (a dataset as problems): rows "
                                      "whose prompt matches one are its eval completions (TRL 1.16 writes them into "
                                      "the same files) and are left out")
    dataset: str = Field(default="imported", pattern=SAFE_NAME_PATTERN, description="dataset name of the rows when "
                         "problems is not set (with problems: the problems' own)")
    problem_column: str | None = Field(default=None, min_length=1, description="the column of the prompt: a text or a "
                                       "conversation (default: columns: problem, trl: prompt, verl: input)")
    completion_column: str | list[str] | None = Field(
        default=None, description="the column of the completion: a text, a list of texts (a whole group) or a "
                                  "conversation (its assistant turns); several columns ([a, b, c]): one group per row "
                                  "(default: completion; verl: output)")
    gold_column: str | None = Field(default=None, min_length=1, description="the column of the gold answer, read when "
                                    "there (default: columns: answer, verl: gts, trl: none)")
    reward_column: str | None = Field(default=None, min_length=1, description="the column of the run's own reward: a "
                                      "number (success: success_threshold) or a boolean, one per completion (default: "
                                      "columns: reward, verl: score, trl: the one reward function's column)")
    finish_column: str | None = Field(default=None, min_length=1, description="the column of each completion's finish "
                                      "reason (stop, length, abort; OpenR1's finish_reasons)")
    prompt_column: str | None = Field(default=None, min_length=1, description="the column of the prompt the model "
                                      "followed, stored with the rows (default: trl: prompt, verl: input; columns: none)")
    prompt_ids_column: str | None = Field(default=None, min_length=1, description="the column of that prompt's token "
                                          "ids in the tokenizer's vocabulary, stored with the rows")
    reward: Literal["auto", "gold", "given"] = Field(
        default="auto", description="auto: the run's own reward where every row has one and its success rule is known "
                                    "(a boolean, or success_threshold), else math-verify against the gold; gold: "
                                    "math-verify only; given: the run's own reward only")
    success_threshold: float | None = Field(default=None, description="a number reward counts as success at >= this "
                                            "(the run's own rule: e.g. 1.0 for verl's gsm8k score); stored as 1 or 0")
    extract: Literal["boxed", "gsm8k", "answer_tag", "regex"] = Field(
        default="boxed", description="how math-verify takes a completion's answer: boxed (the last \\boxed{}), gsm8k "
                                     "(the last '#### N', verl's gsm8k reward), answer_tag (<answer>...</answer>), "
                                     "regex (extract_regex)")
    extract_regex: str | None = Field(default=None, description="extract regex: the pattern whose last match (its "
                                      "first group, if any) is the answer")
    max_disagreement: float = Field(default=0.05, ge=0.0, le=1.0, description="the share of rows whose run's own "
                                    "success and math-verify's differ above which the import says so")
    temperature: float = Field(default=1.0, ge=0.0, description="the sampling temperature the traces were written at "
                                                                "(stored; a rescoring refuses rows it cannot apply)")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="their nucleus mass (stored)")
    top_k: int | None = Field(default=None, ge=0, description="their top-k cut (stored)")
    max_tokens: int | None = Field(default=None, ge=1, description="the run's completion budget (TRL's "
                                   "max_completion_length, verl's response_length): a completion of this many tokens "
                                   "was cut (finish 'length'); stored (default: the group's longest completion)")
    finish_reason: Literal["auto", "stop", "length"] = Field(
        default="auto", description="auto: each row's finish_column value, else 'length' for a completion reaching "
                                    "max_tokens and 'stop' below it (one of the two is needed); stop / length: every "
                                    "row without a finish value ended / was cut (the tokenizer's EOS ends a stopped one)")
    group_size: int | None = Field(default=None, ge=1, description="the completions of every group of one-completion "
                                   "rows (TRL's num_generations, verl's rollout.n; default for trl/verl: each file's "
                                   "most common): a group of another size (a lost row) is left out")
    policy_step: int | None = Field(default=None, ge=0, description="training step of the model stored with every "
                                    "row (default: the trace's own step column, 0 without one)")
    std_normalize: bool = Field(default=True, description="GRPO advantages divide by the group's std (false: Dr. GRPO)")
    groups_per_shard: int = Field(default=256, ge=1, description="groups written together (one shard, or one push)")
    scoring: ScoringConfig = Field(default_factory=ScoringConfig, description="math-verify's workers and time limit")

    @model_validator(mode="after")
    def _rules_stated(self) -> ImportConfig:
        if self.extract == "regex":
            import re

            if not self.extract_regex:
                raise ValueError("extract regex needs the pattern: --set extract_regex='...'")
            try:
                re.compile(self.extract_regex)
            except re.error as error:
                raise ValueError(f"extract_regex {self.extract_regex!r} is not a regular expression: {error}") from None
        elif self.extract_regex is not None:
            raise ValueError(f"extract_regex is set but extract is {self.extract!r}: set extract=regex, or drop it")
        columns = [self.completion_column] if isinstance(self.completion_column, str) else self.completion_column
        if columns is not None and (not columns or len(set(columns)) != len(columns) or not all(columns)):
            raise ValueError(f"completion_column {self.completion_column!r}: a column name, or a list of distinct ones")
        return self

    def trace_columns(self) -> tuple[TraceColumns, frozenset[str]]:
        """The columns to read (the format's, with the ones set here) and which of them were set."""
        defaults = FORMAT_COLUMNS[self.format]
        completion = self.completion_column
        given = {"problem": self.problem_column,
                 "completion": None if completion is None else tuple([completion] if isinstance(completion, str)
                                                                     else completion),
                 "gold": self.gold_column, "reward": self.reward_column, "finish": self.finish_column,
                 "prompt": self.prompt_column, "prompt_ids": self.prompt_ids_column}
        named = frozenset(k for k, v in given.items() if v is not None)
        return replace(defaults, **{k: v for k, v in given.items() if v is not None}), named


# What graft-rescore teacher-forces with (vLLM in-process has no teacher forcing here: a server's does).
RESCORERS = sampler_section(("hf", "openai"), " (graft-rescore teacher-forces in this process, or through a vLLM "
                            "server's prompt_logprobs: serve the weights and set sampler.base_url)")


class RescoreConfig(_GeneratorSide):
    """`graft-rescore`: fill in mu for stored groups from the peer's weights, teacher-forced at the rows' own sampling
    (new groups: rows 'rescored', or 'rescored_unverified' when the weights are not shown to be the traces' author)."""

    MOVED = ("backend", "openai", "dtype", "template", "few_shot", "instruction", "system_prompt")
    # the settings of a sampler that only sampling reads: graft-rescore samples nothing, so they would do nothing
    SAMPLING_ONLY: ClassVar[dict[str, tuple[str, ...]]] = {"hf": ("batch_size",),
                                                           "openai": ("logprobs_mode", "check_logprobs_mode")}

    store: str = Field(description="store root directory: its groups are read, the rescored ones written beside them")
    source_model: str = Field(pattern=SAFE_NAME_PATTERN, description="the model id whose stored groups are rescored")
    source_revision: str | None = Field(default=None, description="only its groups of this revision (default: all)")
    only_without_mu: bool = Field(default=True, description="rescore only groups without behaviour logprobs "
                                                            "(logprobs_mode none); false: every group of source_model")
    model: str = Field(description="the weights that give mu: an HF directory or a .gguf file (backend openai: the "
                                   "served model's folder, or its tokenizer's)")
    model_id: str | None = Field(default=None, pattern=SAFE_NAME_PATTERN, description="model id of the rescored rows "
                                 "(default: source_model)")
    model_revision: str | None = Field(default=None, description="revision of the rescored rows (default: a fingerprint "
                                       "of the weights; backend openai with a tokenizer-only folder: required)")
    sampler: RESCORERS = Field(default_factory=HFSettings, description="what teacher-forces the completions: "
                                   "backend hf (in this process: dtype) or openai (a vLLM server's prompt_logprobs: "
                                   "base_url, served_model, concurrency, ...)")
    prompt: PromptConfig = Field(default_factory=PromptConfig, description="the prompt the completions followed, for "
                                 "rows that do not keep it (prompt_text): graft-generate's prompt section, the same")
    dataset: str | None = Field(default=None, description="problems (JSONL/Parquet or a known name) for the prompts "
                                                          "the store's prompts/ does not hold")
    problem_field: str = Field(default="problem", min_length=1, description="dataset: the column of the problem text")
    answer_field: str | None = Field(default=None, min_length=1, description="dataset: the column of the gold answer")
    groups_per_shard: int = Field(default=64, ge=1, description="rescored groups written together (one shard)")

    @model_validator(mode="after")
    def _teacher_forces(self) -> RescoreConfig:
        inert = [name for name in self.SAMPLING_ONLY[self.sampler.backend] if name in self.sampler.model_fields_set]
        if inert:
            raise ValueError(f"sampler.{', sampler.'.join(inert)}: read only when sampling, and graft-rescore samples "
                             "nothing: drop it")
        return self


def served_model_problems(model: Path, openai: OpenAIBackendConfig, needs_revision: bool) -> list[str]:
    """Backend openai's inputs, as `field: what is wrong`: a folder (or GGUF) with the served model's tokenizer, a
    revision to store (the weights' fingerprint, or model_revision when the folder holds a tokenizer only), and a
    server that answers with the model."""
    from graft.rollouts.models import find_gguf
    from graft.rollouts.openai_backend import ServerError, list_served_models

    problems = []
    try:
        gguf = find_gguf(model)
    except ValueError as error:
        return [f"model: {error}"]
    has_tokenizer = gguf is not None or any((model / name).exists() for name in ("tokenizer.json", "tokenizer_config.json"))
    if not has_tokenizer:
        problems.append(f"model: {model} holds no tokenizer (tokenizer.json or tokenizer_config.json): backend openai "
                        "encodes the prompts and decodes the answers with the served model's tokenizer")
    has_weights = gguf is not None or (model / "config.json").exists()
    if needs_revision and not has_weights:
        problems.append(f"model_revision: {model} holds no weights or config.json to fingerprint: set model_revision to "
                        "the served checkpoint's revision (it is stored with every row and in the group ids)")
    try:
        served = list_served_models(openai)
    except ServerError as error:
        problems.append(f"openai: {error}")
    else:
        if openai.served_model is not None and openai.served_model not in served:
            problems.append(f"openai.served_model: {openai.base_url} serves {', '.join(served) or 'no model'}, not "
                            f"{openai.served_model}")
    return problems


class EvalConfig(_GeneratorSide):
    """`graft-eval`: avg@k and pass@k on the benchmarks."""

    model: str = Field(description="model path: an HF directory, a .gguf file, or a directory holding one")
    model_id: str | None = Field(default=None, description="name shown in the report (default: the path's name)")
    sampler: SamplerConfig = Field(default_factory=HFSettings, description=SAMPLER_DOC)
    benchmarks: list[str] = Field(
        default_factory=lambda: ["math500", "aime24", "amc23", "minerva_math", "olympiadbench"],
        description="benchmark names (math500, aime24, amc23, minerva_math, olympiadbench, gsm8k) or JSONL/Parquet paths",
    )
    limit: int | None = Field(default=None, ge=1, description="first N problems of each benchmark (quick runs)")
    k: int = Field(default=1, ge=1, description="samples per problem; k = 1 decodes greedily")
    temperature: float | None = Field(default=None, ge=0.0, description="default: 0 (greedy) when k = 1, else 0.6")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, description="default: 1.0 when k = 1, else 0.95")
    max_tokens: int = Field(default=4096, ge=1, description="completion token budget")
    seed: int | None = Field(default=0, description="sampling seed")
    prompt: PromptConfig = Field(default_factory=PromptConfig, description="the prompt the model sees")
    prompts_per_batch: int = Field(default=64, ge=1, description="prompts per generate call")
    scoring: ScoringConfig = Field(default_factory=ScoringConfig, description="math-verify's workers and time limit")
    output_json: str | None = Field(default=None, description="write the results here as JSON")
    output_md: str | None = Field(default=None, description="write the Markdown table here")
    progress: bool = Field(default=True, description="show a progress bar")


def print_summary(summary: dict, summary_json: Path | None) -> None:
    """A command's JSON summary as stdout's last line, and into `summary_json` when given (whole or not at all: stdout
    may carry an engine's logs)."""
    import sys

    from graft.rollouts.files import write_text_atomic

    line = json.dumps(summary) + "\n"
    sys.stdout.write(line)
    if summary_json is not None:
        write_text_atomic(summary_json, line)
