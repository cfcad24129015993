"""The prompt every model sees for a math problem (generator, evaluation and trainer alike)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from graft.schemas.sections import Section

PromptTemplate = Literal["auto", "chat", "plain", "raw"]

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

# For base models without a chat template: the same instruction, then room to answer.
PLAIN_TEMPLATE = "Question: {problem}\n" + INSTRUCTION + "\nAnswer: Let's think step by step."

# Worked examples that a prompt may show before the problem (`few_shot`): the eight grade-school
# chain-of-thought exemplars of Wei et al. 2022 ("Chain-of-Thought Prompting Elicits Reasoning in Large
# Language Models", the standard few-shot GSM8K prompt), each answer ending in `\boxed{}` so that a small
# model sees the answer format the scorer reads. None of them is a problem of the GSM8K test set.
FEW_SHOT_EXAMPLES: tuple[tuple[str, str], ...] = (
    (
        "There are 15 trees in the grove. Grove workers will plant trees in the grove today. After they are done, "
        "there will be 21 trees. How many trees did the grove workers plant today?",
        "There are 15 trees originally. Then there were 21 trees after some more were planted. "
        "So there must have been 21 - 15 = 6. The answer is \\boxed{6}.",
    ),
    (
        "If there are 3 cars in the parking lot and 2 more cars arrive, how many cars are in the parking lot?",
        "There are originally 3 cars. 2 more cars arrive. 3 + 2 = 5. The answer is \\boxed{5}.",
    ),
    (
        "Leah had 32 chocolates and her sister had 42. If they ate 35, how many pieces do they have left in total?",
        "Originally, Leah had 32 chocolates. Her sister had 42. So in total they had 32 + 42 = 74. "
        "After eating 35, they had 74 - 35 = 39. The answer is \\boxed{39}.",
    ),
    (
        "Jason had 20 lollipops. He gave Denny some lollipops. Now Jason has 12 lollipops. "
        "How many lollipops did Jason give to Denny?",
        "Jason started with 20 lollipops. Then he had 12 after giving some to Denny. "
        "So he gave Denny 20 - 12 = 8. The answer is \\boxed{8}.",
    ),
    (
        "Shawn has five toys. For Christmas, he got two toys each from his mom and dad. How many toys does he have now?",
        "Shawn started with 5 toys. If he got 2 toys each from his mom and dad, then that is 4 more toys. "
        "5 + 4 = 9. The answer is \\boxed{9}.",
    ),
    (
        "There were nine computers in the server room. Five more computers were installed each day, from monday "
        "to thursday. How many computers are now in the server room?",
        "There were originally 9 computers. For each of 4 days, 5 more computers were added. "
        "So 5 * 4 = 20 computers were added. 9 + 20 is 29. The answer is \\boxed{29}.",
    ),
    (
        "Michael had 58 golf balls. On tuesday, he lost 23 golf balls. On wednesday, he lost 2 more. "
        "How many golf balls did he have at the end of wednesday?",
        "Michael started with 58 golf balls. After losing 23 on tuesday, he had 58 - 23 = 35. "
        "After losing 2 more, he had 35 - 2 = 33 golf balls. The answer is \\boxed{33}.",
    ),
    (
        "Olivia has $23. She bought five bagels for $3 each. How much money does she have left?",
        "Olivia had 23 dollars. 5 bagels for 3 dollars each will be 5 x 3 = 15 dollars. "
        "So she has 23 - 15 dollars left. 23 - 15 is 8. The answer is \\boxed{8}.",
    ),
)
MAX_FEW_SHOT = len(FEW_SHOT_EXAMPLES)


def check_few_shot(template: PromptTemplate, few_shot: int, instruction: str | None = None,
                   system_prompt: str | None = None) -> None:
    """A clear error for settings that `build_prompt` cannot honour, or that would do nothing (configs call it to fail
    at load time)."""
    if not 0 <= few_shot <= MAX_FEW_SHOT:
        raise ValueError(f"few_shot = {few_shot}: there are {MAX_FEW_SHOT} worked examples, pass 0 to {MAX_FEW_SHOT}")
    if template == "raw" and few_shot:
        raise ValueError("template 'raw' shows the problem verbatim and takes no worked examples: set few_shot to 0")
    if template == "raw" and instruction is not None:
        raise ValueError("template 'raw' shows the problem verbatim, without an instruction: drop instruction, or use "
                         "template auto, chat or plain")
    if template in ("raw", "plain") and system_prompt is not None:
        raise ValueError(f"template {template!r} has no system turn: system_prompt is read by the chat template only "
                         "(template auto or chat)")


def build_prompt(tokenizer, problem: str, template: PromptTemplate = "auto", few_shot: int = 0,
                 instruction: str | None = None, system_prompt: str | None = None) -> str:
    """The prompt string for `problem`.

    "auto": the tokenizer's chat template when it has one, else "plain". "chat": the chat
    template (an error when there is none). "plain": `PLAIN_TEMPLATE`. "raw": the problem text
    verbatim (the toy demo's tiny models see `a+b=`).
    few_shot: the first `few_shot` of `FEW_SHOT_EXAMPLES` come first, as earlier user/assistant turns
    of the chat, or as answered `PLAIN_TEMPLATE` blocks; not allowed with "raw".
    instruction: the line after each problem (None: `INSTRUCTION`; "": none). system_prompt: a system turn first
    (chat template only; None: whatever the chat template puts there by itself, e.g. SmolLM2's "You are a helpful AI
    assistant named SmolLM, trained by Hugging Face").
    The chat template already holds any BOS token: tokenise the result with
    add_special_tokens=False.
    """
    check_few_shot(template, few_shot, instruction, system_prompt)
    examples = FEW_SHOT_EXAMPLES[:few_shot]
    if template == "raw":
        return problem
    instruction = INSTRUCTION if instruction is None else instruction
    tail = f"\n{instruction}" if instruction else ""
    has_chat = getattr(tokenizer, "chat_template", None) is not None
    if template == "chat" or (template == "auto" and has_chat):
        if not has_chat:
            raise ValueError("template 'chat' was asked for but the tokenizer has no chat template: use 'plain' or 'auto'")
        messages = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
        for question, answer in examples:
            messages += [{"role": "user", "content": f"{question}{tail}"}, {"role": "assistant", "content": answer}]
        messages.append({"role": "user", "content": f"{problem}{tail}"})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if template in ("plain", "auto"):
        if system_prompt is not None:
            raise ValueError("system_prompt was set but the tokenizer has no chat template to put it in (template "
                             "'auto' fell back to 'plain'): drop system_prompt")
        block = "Question: {problem}" + tail + "\nAnswer: Let's think step by step."
        shots = "".join(f"{block.replace('{problem}', q)} {a}\n\n" for q, a in examples)
        return shots + block.replace("{problem}", problem)
    raise ValueError(f"unknown prompt template {template!r}: use one of auto, chat, plain, raw")


class PromptConfig(Section):
    """The prompt a model sees for a problem: the `prompt` section of graft-train (the learner's), graft-generate (a
    peer's), graft-eval and graft-rescore alike. A learner grafts a peer's groups best when both saw one prompt: give
    both runs the same section."""

    template: PromptTemplate = Field(default="auto", description="auto (the tokenizer's chat template if it has one, "
                                     "else plain), chat, plain, raw (the problem verbatim)")
    few_shot: int = Field(default=0, ge=0, le=MAX_FEW_SHOT, description=f"worked examples (GSM8K-style, answers in "
                          f"\\boxed{{}}) shown before each problem, 0-{MAX_FEW_SHOT}")
    instruction: str | None = Field(default=None, description="the line after each problem (default: 'Please reason "
                                    "step by step, and put your final answer within \\boxed{}.'; '' for none)")
    system_prompt: str | None = Field(default=None, description="a system turn before the problem (chat template only; "
                                      "default: whatever the model's chat template puts there)")

    @model_validator(mode="after")
    def _applies(self) -> PromptConfig:
        check_few_shot(self.template, self.few_shot, self.instruction, self.system_prompt)
        return self

    def render(self, tokenizer: Any, problem: str) -> str:
        """The prompt for `problem` (`build_prompt`)."""
        return build_prompt(tokenizer, problem, self.template, self.few_shot, self.instruction, self.system_prompt)

    def token_ids(self, tokenizer: Any, problem: str) -> list[int]:
        """The prompt for `problem` as token ids. The template already holds any BOS: no special tokens are added here
        (as the backends do)."""
        return list(tokenizer(self.render(tokenizer, problem), add_special_tokens=False)["input_ids"])
