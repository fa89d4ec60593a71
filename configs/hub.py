"""A `model` / `draft_model` as given (a directory, or a Hugging Face id `org/name`) → the
checkpoint directory on this machine.

An existing local directory wins. Otherwise an `org/name` is resolved through huggingface_hub's
cache, as every HF tool does: online, the revision is looked up on the Hub and whatever the
cache lacks is downloaded once per machine (concurrent callers wait on the cache's file locks);
with HF_HUB_OFFLINE=1 the cache alone answers. The cache is HF_HUB_CACHE (default
$HF_HOME/hub, ~/.cache/huggingface/hub), the token HF_TOKEN or the one `hf auth login` saved.
huggingface_hub reads these variables when it is imported, so they must be set before the
process starts (a Ray node: before `ray start`)."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

# The files the loaders read: configs (config.json, generation_config.json, the safetensors
# index), the weights, the tokenizer (tokenizer.json, vocab.json, merges.txt, tokenizer.model,
# *.tiktoken) and the chat template. A checkpoint's *.bin / *.pt / *.gguf copies, images and
# READMEs are never downloaded. cluster/*.yaml pass the same list to `hf download --include`.
ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken")


def is_hub_id(value: str) -> bool:
    """`org/name` as the Hub spells repository ids (not a path: no leading /, ., ~)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if value.count("/") != 1:
        return False
    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def local_path(value: str, relative_to: Path | None = None) -> Path | None:
    """The existing file or directory `value` names: absolute, else relative to the working
    directory, else to `relative_to`; None if there is none."""
    path = Path(value).expanduser()
    candidates = [path]
    if relative_to is not None and not path.is_absolute():
        candidates.append(relative_to / path)
    return next((p.resolve() for p in candidates if p.exists()), None)


def resolve_model(value: str, field: str, revision: str | None = None, *,
                  relative_to: Path | None = None, download: bool = True) -> str | None:
    """The checkpoint directory `value` (the arg named `field`) stands for on this machine.

    download=True: a hub id is fetched into the cache if it is not there (unless offline); a
    model found nowhere raises ValueError saying what was tried. download=False: nothing is
    fetched and None means "not on this machine (yet)"."""
    found = local_path(value, relative_to)
    if found is not None:
        if revision is not None:
            log.warning("%s: %s is a local path; revision %r applies to Hugging Face ids only "
                        "and is ignored", field, found, revision)
        return str(found)
    if not is_hub_id(value):
        if not download:
            return None
        where = "the working directory" + (f" or {relative_to}" if relative_to else "")
        raise ValueError(f"{field} {value} does not exist: no such directory (relative paths "
                         f"are looked up in {where}), and it is no Hugging Face model id "
                         f"(those read org/name)")
    return _snapshot(value, field, revision, download)


def _snapshot(repo_id: str, field: str, revision: str | None, download: bool) -> str | None:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = constants.is_offline_mode()
    rev = revision or constants.DEFAULT_REVISION
    what = (f"{field} {repo_id!r} (revision {rev!r}) is no local directory; as a Hugging Face "
            f"model id")
    if download:
        log.info("%s: %s@%s through the Hugging Face cache %s%s", field, repo_id, rev,
                 constants.HF_HUB_CACHE, " (offline)" if offline else "")
    try:
        path = snapshot_download(repo_id, revision=revision, allow_patterns=list(ALLOW_PATTERNS),
                                 local_files_only=not download)
    except LocalEntryNotFoundError as e:
        if not download:
            return None
        if offline:
            raise ValueError(
                f"{what} it is not in the cache {constants.HF_HUB_CACHE} and HF_HUB_OFFLINE=1 "
                f"forbids downloading it: run `hf download {repo_id}"
                f"{f' --revision {revision}' if revision else ''}` on this machine while "
                f"online (or point HF_HUB_CACHE / HF_HOME at a cache that holds it)") from None
        raise ValueError(f"{what} it is not in the cache {constants.HF_HUB_CACHE} and the Hub "
                         f"could not be reached: {e}") from None
    except GatedRepoError:
        raise ValueError(f"{what} the repository is gated or private: set HF_TOKEN (or run "
                         f"`hf auth login`) with an account that has access") from None
    except RepositoryNotFoundError:
        raise ValueError(f"{what} no such repository on the Hub (a private one needs "
                         f"HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ValueError(f"{what} the repository has no revision {rev!r}") from None
    except HfHubHTTPError as e:
        raise ValueError(f"{what} the Hub refused it: {e}") from None
    if download:
        log.info("%s: %s@%s is %s", field, repo_id, rev, path)
    return path
