from __future__ import annotations

from pathlib import Path


def load_tokenizer(model_dir: str):
    """The target's tokenizer, or None when the checkpoint ships none (then use token ids)."""
    d = Path(model_dir)
    if not ((d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file()):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(d))
    except (OSError, ValueError, TypeError) as e:  # corrupt or inconsistent tokenizer files
        raise ValueError(f"{d}: the tokenizer cannot be loaded ({e})") from None


def chat_template_text(value: str | None) -> str | None:
    """--chat-template: a file's text if `value` names an existing file, else `value` itself
    (a Jinja template); checked to parse. None stays None. Raises ValueError naming it."""
    if value is None:
        return None
    path = Path(value).expanduser()
    text = path.read_text() if len(value) < 4096 and path.is_file() else value
    if text is value and "{" not in value:  # neither a file nor a template
        raise ValueError(f"chat_template: {value!r} is no file and no Jinja template")
    from jinja2 import Environment, TemplateSyntaxError

    try:
        Environment().parse(text)
    except TemplateSyntaxError as e:
        raise ValueError(f"chat_template is not a valid Jinja template: {e}") from None
    return text


def with_chat_template(tokenizer, value: str | None):
    """The tokenizer with its chat template replaced by --chat-template's (if given)."""
    text = chat_template_text(value)
    if text is not None:
        if tokenizer is None:
            raise ValueError("chat_template: the model has no tokenizer to apply it with")
        tokenizer.chat_template = text
    return tokenizer
