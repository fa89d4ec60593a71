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
