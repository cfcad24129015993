"""The prompt every model sees for a math problem (generator, evaluation and trainer alike)."""

from __future__ import annotations

from typing import Literal

PromptTemplate = Literal["auto", "chat", "plain", "raw"]

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

# For base models without a chat template: the same instruction, then room to answer.
PLAIN_TEMPLATE = "Question: {problem}\n" + INSTRUCTION + "\nAnswer: Let's think step by step."


def build_prompt(tokenizer, problem: str, template: PromptTemplate = "auto") -> str:
    """The prompt string for `problem`.

    "auto": the tokenizer's chat template when it has one, else "plain". "chat": the chat
    template (an error when there is none). "plain": `PLAIN_TEMPLATE`. "raw": the problem text
    verbatim (the toy demo's tiny models see `a+b=`).
    The chat template already holds any BOS token: tokenise the result with
    add_special_tokens=False.
    """
    if template == "raw":
        return problem
    has_chat = getattr(tokenizer, "chat_template", None) is not None
    if template == "chat" or (template == "auto" and has_chat):
        if not has_chat:
            raise ValueError("template 'chat' was asked for but the tokenizer has no chat template: use 'plain' or 'auto'")
        messages = [{"role": "user", "content": f"{problem}\n{INSTRUCTION}"}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if template in ("plain", "auto"):
        return PLAIN_TEMPLATE.replace("{problem}", problem)
    raise ValueError(f"unknown prompt template {template!r}: use one of auto, chat, plain, raw")
