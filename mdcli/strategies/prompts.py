"""Turning text into the exact token ids a branch will see.

Each branch's prompt is rendered and tokenized WHOLE (chat template included); sharing happens
afterwards at the token level (mdcli.core.run.prefill_prompts). Tokenizing pieces separately would change
BPE merges at the seams and break exactness against running the prompt alone.
"""

from __future__ import annotations

from string import Template

from mdcli.errors import UsageError


def fill_template(template: str, what: str, **values: str) -> str:
    """`$name` substitution that refuses to drop a value the user gave or leave a hole."""
    parsed = Template(template)
    names = set(parsed.get_identifiers())
    missing = [name for name in values if name not in names]
    if missing:
        placeholders = ", ".join(f"${n}" for n in missing)
        raise UsageError(f"the {what} template has no {placeholders}", fix=f"add {placeholders} to the template")
    unknown = sorted(names - set(values))
    if unknown:
        placeholders = ", ".join(f"${n}" for n in unknown)
        raise UsageError(
            f"the {what} template uses {placeholders}, which nothing fills",
            fix=f"remove it or write $$ for a literal dollar sign; it can use {', '.join('$' + v for v in values)}",
        )
    return parsed.substitute(values)


def prompt_token_ids(tokenizer, user_text: str, *, system: str | None = None, chat_template: bool = True) -> list[int]:
    """The full prompt as token ids: chat-templated when the model has a template and it is wanted."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user_text}
        ]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = user_text if not system else f"{system}\n\n{user_text}"
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def continuation_token_ids(tokenizer, user_text: str, *, chat_template: bool = True) -> list[int]:
    """Tokens that continue a conversation after the assistant's answer: the template's end of
    the assistant turn, a new user turn and the assistant header (chat models), or the bare text
    (base models). The decoder skips the first token when the answer already ended with it (an
    answer that stopped on its end-of-turn token)."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        marker = "\u2063mdcli\u2063"  # an answer text no template rewrites
        assistant = [{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}]
        full = tokenizer.apply_chat_template(
            assistant + [{"role": "user", "content": user_text}], add_generation_prompt=True, tokenize=False
        )
        if full.count(marker) == 1:
            return list(tokenizer(full.split(marker, 1)[1], add_special_tokens=False)["input_ids"])
    return list(tokenizer("\n\n" + user_text, add_special_tokens=False)["input_ids"])
