"""The responses kept for GET /v1/responses/{id} and `previous_response_id`, each with the
conversation it ends: in this replica's memory, the STORE_MAX_RESPONSES most recently used,
STORE_MAX_CHARS of JSON at most. They are lost on restart and not shared: behind several
replicas, `previous_response_id` and GET find a response only on the replica that served it
(404 elsewhere).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

STORE_MAX_RESPONSES = 256
STORE_MAX_CHARS = 64 << 20


@dataclass
class StoredResponse:
    response: dict[str, Any]  # as GET returns it
    inputs: list[dict[str, Any]]  # the input items of the conversation up to it (no instructions)
    chars: int


class ResponseStore:
    """The responses kept for GET and previous_response_id: in this replica's memory, the
    most recently used first to stay; past `max_responses` or `max_chars` (of JSON) the least
    recently used go. A response larger than `max_chars` alone is not kept."""

    def __init__(self, max_responses: int = STORE_MAX_RESPONSES,
                 max_chars: int = STORE_MAX_CHARS):
        self.max_responses, self.max_chars = max_responses, max_chars
        self._kept: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars = 0

    def put(self, response: dict[str, Any], inputs: list[dict[str, Any]]) -> None:
        chars = len(json.dumps(response)) + len(json.dumps(inputs))
        self.delete(response["id"])
        if chars > self.max_chars:  # kept, it would push every other response out
            return
        self._kept[response["id"]] = StoredResponse(response, inputs, chars)
        self._chars += chars
        while self._kept and (len(self._kept) > self.max_responses
                              or self._chars > self.max_chars):
            self._chars -= self._kept.popitem(last=False)[1].chars

    def get(self, response_id: str) -> StoredResponse | None:
        kept = self._kept.get(response_id)
        if kept is not None:
            self._kept.move_to_end(response_id)
        return kept

    def delete(self, response_id: str) -> bool:
        kept = self._kept.pop(response_id, None)
        if kept is not None:
            self._chars -= kept.chars
        return kept is not None
