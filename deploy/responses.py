"""A completion's or chat completion's choices as the response the client reads: one JSON
body once every choice has finished, or server-sent events as the choices go (each choice's
deltas as they come, tagged with its index; the usage last when asked for)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from deploy.engine_client import EngineClient
from deploy.generation import Generation, merged, prompts_of, usage
from deploy.logprobs import chat_logprobs, completion_logprobs, echo_logprobs, prompt_logprobs
from deploy.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    ToolCall,
)
from deploy.token_text import TokenTexts
from workers.logprobs import TokenLogprob


def _parsed_message(gen: Generation, text: str) -> tuple[AssistantMessage, str | None]:
    """A chat choice's message and finish reason: its text, or what its parser makes of it
    (reasoning, tool calls: finish reason "tool_calls" where it called one)."""
    parser = gen.parser
    if parser is None:
        return AssistantMessage(content=text), gen.finish_reason
    parser.feed(text)
    parser.finish()
    m = parser.message()
    finish = gen.finish_reason
    if parser.tool_called and finish == "stop":
        finish = "tool_calls"
    return AssistantMessage(content=m.get("content"),
                            reasoning_content=m.get("reasoning_content"),
                            reasoning=m.get("reasoning"),
                            tool_calls=[ToolCall.model_validate(c) for c in m["tool_calls"]]
                            or None), finish


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class Responses:
    def __init__(self, client: EngineClient, tokenizer, tokens: TokenTexts):
        self.client, self.tokenizer, self.tokens = client, tokenizer, tokens

    def _echo(self, gen: Generation, text: str | None) -> str:
        return text if text is not None else self.tokenizer.decode(gen.prompt_ids)

    async def complete(self, req, request_id: str, gens: list[Generation],
                       echoes: list[str | None]
                       ) -> CompletionResponse | ChatCompletionResponse:
        texts: list[list[str]] = [[] for _ in gens]
        async with aclosing(merged(gens)) as deltas:
            async for i, (delta, _, _, _) in deltas:
                texts[i].append(delta)
        tokens = req.return_token_ids
        common = dict(id=request_id, model=self.client.model_name, usage=usage(gens))
        single_prompt = len(prompts_of(gens)) == 1
        if tokens and single_prompt:
            common["prompt_token_ids"] = gens[0].prompt_ids
        wants_logprobs = req.logprob_counts()[0] is not None
        prompt_k = req.prompt_logprobs
        if isinstance(req, ChatCompletionRequest):
            if prompt_k is not None:
                common["prompt_logprobs"] = self._prompt_logprobs(gens[0], prompt_k)
            if req.service_tier is not None:  # the tier that served it, as OpenAI says
                common["service_tier"] = "default"
            choices = []
            for i, (g, text) in enumerate(zip(gens, texts, strict=True)):
                message, finish = _parsed_message(g, "".join(text))
                choices.append(ChatChoice(
                    index=i, message=message, finish_reason=finish,
                    token_ids=g.token_ids if tokens else None,
                    logprobs=chat_logprobs(self.tokens, g.token_ids, g.logprobs)
                    if wants_logprobs else None))
            return ChatCompletionResponse(**common, choices=choices)
        choices = []
        for i, (g, text, echo) in enumerate(zip(gens, texts, echoes, strict=True)):
            body, lp_ids, lps = "".join(text), g.token_ids, g.logprobs
            if req.echo:
                prompt_text = self._echo(g, echo)
                body = prompt_text + body
                lp_ids = g.prompt_ids + g.token_ids
                lps = echo_logprobs(g.prompt_ids, g.prompt_logprobs) + g.logprobs
            choices.append(CompletionChoice(
                index=i, text=body, finish_reason=g.finish_reason,
                token_ids=g.token_ids if tokens else None,
                prompt_token_ids=g.prompt_ids if tokens and not single_prompt else None,
                logprobs=completion_logprobs(self.tokens, lp_ids, lps, 0, req.logprobs)
                if wants_logprobs else None,
                # once per prompt: on its first choice (the others would repeat it n times)
                prompt_logprobs=None if prompt_k is None or i % req.num_choices
                else self._prompt_logprobs(g, prompt_k)))
        return CompletionResponse(**common, choices=choices)

    def _prompt_logprobs(self, gen: Generation, num: int) -> list[dict | None]:
        return prompt_logprobs(self.tokens, gen.prompt_ids, gen.prompt_logprobs, num)

    async def events(self, req, request_id: str, gens: list[Generation],
                     echoes: list[str | None]) -> AsyncIterator[str]:
        """The stream's events up to its [DONE]; an error raises (the caller reports it
        in-band)."""
        chat = isinstance(req, ChatCompletionRequest)
        created, model = int(time.time()), self.client.model_name
        exclude = None if req.include_usage else {"usage"}
        first_ids = {"prompt_token_ids": gens[0].prompt_ids} \
            if req.return_token_ids and len(prompts_of(gens)) == 1 else {}
        wants_logprobs = req.logprob_counts()[0] is not None
        offsets = [0] * len(gens)  # each choice's text_offset so far

        def chunk(i: int, text: str | dict | None, ids: list[int] | None,
                  lps: list[TokenLogprob | None] | None, finish: str | None,
                  role: str | None = None) -> str:
            """text: a completion's text, or a chat's content or delta (a parser's)."""
            token_ids = ids if req.return_token_ids else None
            if chat:
                logprobs = chat_logprobs(self.tokens, ids, lps) if wants_logprobs and ids \
                    else None
                tier = None if req.service_tier is None else "default"
                delta = DeltaMessage(role=role, **(text if isinstance(text, dict)
                                                   else {"content": text}))
                body = ChatCompletionChunk(id=request_id, created=created, model=model,
                                           service_tier=tier, **first_ids, choices=[ChatChunkChoice(
                                               index=i, delta=delta,
                                               finish_reason=finish, token_ids=token_ids,
                                               logprobs=logprobs)])
            else:
                logprobs = None
                if wants_logprobs and ids:
                    logprobs = completion_logprobs(self.tokens, ids, lps, offsets[i],
                                                   req.logprobs)
                    offsets[i] += sum(len(self.tokens.text(t)) for t in ids)
                body = CompletionResponse(id=request_id, created=created, model=model,
                                          **first_ids, choices=[CompletionChoice(
                                              index=i, text=text, finish_reason=finish,
                                              token_ids=token_ids, logprobs=logprobs)])
            first_ids.clear()
            return sse(body.model_dump(mode="json", exclude=exclude))

        for i, g in enumerate(gens):
            if chat:
                yield chunk(i, "", None, None, None, role="assistant")
            elif req.echo:  # the prompt first, with its log-probabilities
                yield chunk(i, self._echo(g, echoes[i]), g.prompt_ids,
                            echo_logprobs(g.prompt_ids, g.prompt_logprobs), None)
        async with aclosing(merged(gens)) as deltas:
            async for i, (delta, ids, lps, finish) in deltas:
                parser = gens[i].parser
                if parser is None:
                    yield chunk(i, delta, ids, lps, finish)
                    continue
                # the parser's deltas; the engine's ids and log-probabilities with the first
                # (an empty delta carries them while the parser holds text back), the finish
                # reason with the last
                parsed = parser.feed(delta) + (parser.finish() if finish else [])
                if finish and parser.tool_called and finish == "stop":
                    finish = "tool_calls"
                if not parsed and (finish or ids):
                    parsed = [{}]
                for k, d in enumerate(parsed):
                    last = k == len(parsed) - 1
                    yield chunk(i, d, ids if k == 0 else None, lps if k == 0 else None,
                                finish if last else None)
        if req.include_usage:
            cls = ChatCompletionChunk if chat else CompletionResponse
            yield sse(cls(id=request_id, created=created, model=model, choices=[],
                          usage=usage(gens)).model_dump(mode="json"))
        yield sse("[DONE]")
