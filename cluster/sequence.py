from __future__ import annotations

import enum
from dataclasses import dataclass, field

from configs.engine import SamplingParams
from workers.logprobs import TokenLogprob


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # why it failed ("error"): its own step failure
    # Tokens whose KV / GDN state are committed in the target; below len(prompt_ids) while the
    # prompt is still being prefilled chunk by chunk.
    num_cached: int = 0
    block_table: list[int] = field(default_factory=list)
    state_slot: int = -1
    # The prefix cache's (cluster/prefix_cache.py): prompt tokens its hit spared it, the
    # snapshot slot its first chunk restores, the chain keys of its full prompt pages (made
    # once), the pages known to the cache from the first (its hit's, then those it entered),
    # the key of its newest snapshot, and while it decodes, its boundary slot (holding its
    # state at the last page boundary its rounds reached past position boundary_from).
    num_cached_tokens: int = 0
    restore_slot: int | None = None
    prompt_keys: list[bytes] | None = None
    page_keys: list[bytes] = field(default_factory=list)
    last_snapshot: bytes | None = None
    boundary_slot: int | None = None
    boundary_from: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens committed per round
    num_streamed: int = 0  # output tokens already handed to the caller
    # params.logprobs: one per output token; params.prompt_logprobs: one per prompt token
    # after the first, filled chunk by chunk
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def anchor(self) -> int:
        # The newest token: produced but not yet fed to the target.
        return self.output_ids[-1]

    @property
    def prefilled(self) -> bool:
        # Every prompt token is cached (and the first token sampled): the sequence can decode.
        return self.num_cached >= len(self.prompt_ids)

    @property
    def num_prompt_left(self) -> int:
        return max(len(self.prompt_ids) - self.num_cached, 0)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
