"""OpenAI response objects: whole responses, stream chunks, logprobs and usage, built from Deltas.

A request's choices are numbered `prompt_index * n + sample_index`, as OpenAI numbers them when
one completions request carries several prompts.
"""

from __future__ import annotations

import abc
import dataclasses
import time
from typing import Any

from infire_jax.engine.detokenizer import TokenText
from infire_jax.outputs import Delta
from infire_jax.sample.prompt_logprobs import PromptLogprobs
from server import tool_calls


class Usage:
    """Token counts of one request; prompts count once each, whatever `n` is."""

    def __init__(self, prompt_lens: list[int]):
        self.prompt_tokens = sum(prompt_lens)
        self.completion_tokens = 0
        self._prompt_lens = prompt_lens
        self._cached = [0] * len(prompt_lens)
        self._choice_tokens: dict[tuple[int, int], int] = {}  # (prompt, choice of it): tokens so far

    def add(self, prompt_index: int, d: Delta) -> None:
        self.completion_tokens += len(d.token_ids)
        key = (prompt_index, d.index)
        self._choice_tokens[key] = self._choice_tokens.get(key, 0) + len(d.token_ids)
        if d.index == 0:
            self._cached[prompt_index] = d.num_cached_tokens

    def choice_dict(self, prompt_index: int, index: int) -> dict[str, int]:
        """vLLM's continuous usage stats: a chunk's usage is its prompt's and its choice's tokens so far."""
        prompt, completion = self._prompt_lens[prompt_index], self._choice_tokens.get((prompt_index, index), 0)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(self._cached)}}


@dataclasses.dataclass
class Choice:
    """One choice accumulated for a non-streaming response."""

    text: list[str] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # echo with logprobs

    def add(self, d: Delta) -> None:
        self.text.append(d.text)
        self.token_ids.extend(d.token_ids)
        if d.logprobs:
            self.logprobs.extend(d.logprobs)
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        if d.finished:
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason


class Formatter(abc.ABC):
    """The envelope both APIs share."""

    full_object: str
    chunk_object: str

    def __init__(self, request_id: str, model: str, token_text: TokenText, *, want_logprobs: bool,
                 include_usage: bool, tokens_as_ids: bool = False, prompt_logprobs: int | None = None):
        """`tokens_as_ids`: vLLM's return_tokens_as_token_ids, logprobs name each token "token_id:{id}"
        (exact where a token's text is part of a character or ambiguous). `prompt_logprobs`: vLLM's
        field, the response's `prompt_logprobs` list with that many alternatives (never streamed)."""
        self.prompt_logprobs = prompt_logprobs
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.token_text = token_text
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage
        self.tokens_as_ids = tokens_as_ids

    def token_name(self, token_id: int) -> str:
        """How logprobs name a token: its text, or "token_id:{id}"."""
        return f"token_id:{token_id}" if self.tokens_as_ids else self.token_text(token_id)

    def prompt_logprobs_list(self, entries: PromptLogprobs) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's `prompt_logprobs`: null for the first token, then each token's entry and the top
        alternatives, keyed by token id, each with its logprob, rank and text."""
        out: list[dict[str, dict[str, Any]] | None] = [None]
        for e in entries[1:]:
            out.append({str(i): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": self.token_text(i)}
                        for i, lp in top_ranked(e, self.prompt_logprobs)})
        return out

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out = self._envelope(self.chunk_object, choices)
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return self._envelope(self.chunk_object, []) | {"usage": usage.to_dict()}

    def response(self, choices: list[Choice], usage: Usage) -> dict[str, Any]:
        return self._envelope(self.full_object, [self._full_choice(i, c) for i, c in enumerate(choices)]) | {
            "usage": usage.to_dict()}


def top_ranked(entry: dict[int, Any], k: int) -> list[tuple[int, Any]]:
    """A prompt position's entry (its prompt token first) as a response lists it: the k most likely
    tokens and the prompt token, by rank; the engine computed the most any field asked for."""
    token = next(iter(entry))
    kept = dict(sorted(entry.items(), key=lambda item: item[1].rank)[:k]) | {token: entry[token]}
    return sorted(kept.items(), key=lambda item: item[1].rank)

    @abc.abstractmethod
    def head_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        """Chunks a stream opens with, before any token."""

    @abc.abstractmethod
    def chunks(self, index: int, d: Delta) -> list[dict[str, Any]]:
        """The chunks of one delta of choice `index`; none when it carries nothing to show."""

    @abc.abstractmethod
    def _full_choice(self, index: int, c: Choice) -> dict[str, Any]:
        """One choice of a non-streaming response."""


class CompletionFormatter(Formatter):
    """The legacy completions layout. With echo and logprobs (`echo_ids`: each prompt's tokens), a
    choice's logprobs cover the prompt, its first token's null, then the generated tokens; its text
    offsets count the tokens' texts from 0. Streamed, the echoed prompt and its logprobs ride in the
    choice's first chunk (they come with its first delta), as vLLM streams them."""

    full_object = chunk_object = "text_completion"

    def __init__(self, *args, echo_texts: list[str] | None, n: int, echo_ids: list[list[int]] | None = None,
                 top: int = 0, **kwargs):
        """`top`: the alternatives each token lists (`logprobs`), echoed prompt tokens (`echo_ids`) too."""
        super().__init__(*args, **kwargs)
        self._echo = echo_texts
        self._echo_ids = echo_ids
        self._top = top
        self._n = n
        self._offsets: dict[int, int] = {}  # per choice: text offset of its next token

    def _echo_text(self, index: int) -> str:
        return self._echo[index // self._n] if self._echo is not None else ""

    def head_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        if self._echo is None or self._echo_ids is not None:
            return []
        return [self._chunk([{"index": i, "text": self._echo_text(i), "logprobs": None, "finish_reason": None}])
                for i in range(num_choices)]

    def _prompt_logprobs(self, index: int, entries: PromptLogprobs) -> dict[str, Any]:
        """The echoed prompt's part: its tokens, null then each token's logprob, null then the top
        alternatives by rank (the prompt token's own among them), from text offset 0."""
        ids = self._echo_ids[index // self._n]
        texts = [self.token_text(t) for t in ids]
        offsets = [0]
        for s in texts[:-1]:
            offsets.append(offsets[-1] + len(s))
        self._offsets[index] = offsets[-1] + len(texts[-1])
        top: list[dict[str, float] | None] = [None]
        for e in entries[1:]:
            alternatives: dict[str, float] = {}
            for i, lp in top_ranked(e, self._top):
                alternatives.setdefault(self.token_name(i), lp.logprob)  # two ids of one text: the likelier
            top.append(alternatives)
        return {"tokens": [self.token_name(t) for t in ids],
                "token_logprobs": [None] + [e[t].logprob for t, e in zip(ids[1:], entries[1:])],
                "top_logprobs": top, "text_offset": offsets}

    def _echoed(self, index: int, prompt: PromptLogprobs, token_ids: list[int],
                entries: list[dict[int, float]]) -> dict[str, Any]:
        """Echo with logprobs: the prompt's part, then the generated tokens'."""
        head, tail = self._prompt_logprobs(index, prompt), self._logprobs(index, token_ids, entries)
        return {k: head[k] + tail[k] for k in head}

    def _logprobs(self, index: int, token_ids: list[int], entries: list[dict[int, float]]) -> dict[str, Any]:
        offset = self._offsets.get(index, len(self._echo_text(index)))
        offsets = []
        for t in token_ids:  # offsets into the text, whatever names the tokens
            offsets.append(offset)
            offset += len(self.token_text(t))
        self._offsets[index] = offset
        name = self.token_name
        # an entry: the top alternatives by rank, then its token if not among them; a beam search's holds
        # more (and one past a beam that ended at EOS, whose token is left out): the top k and the token
        return {"tokens": [name(t) for t in token_ids], "token_logprobs": [e[t] for t, e in zip(token_ids, entries)],
                "top_logprobs": [{name(i): lp for i, lp in [*list(e.items())[:self._top], (t, e[t])]}
                                 for t, e in zip(token_ids, entries)], "text_offset": offsets}

    def chunks(self, index: int, d: Delta) -> list[dict[str, Any]]:
        text = d.text
        if self._echo_ids is not None and d.prompt_logprobs is not None:  # the choice's first delta
            text = self._echo_text(index) + text
            lp = self._echoed(index, d.prompt_logprobs, d.token_ids, d.logprobs or [])
        else:
            lp = self._logprobs(index, d.token_ids, d.logprobs) if self.want_logprobs and d.logprobs else None
        if not text and lp is None and not d.finished:
            return []
        return [self._chunk([{"index": index, "text": text, "logprobs": lp, "finish_reason": d.finish_reason,
                              "stop_reason": d.stop_reason}])]

    def _full_choice(self, index: int, c: Choice) -> dict[str, Any]:
        if self._echo_ids is not None:
            lp = self._echoed(index, c.prompt_logprobs, c.token_ids, c.logprobs)
        else:
            lp = self._logprobs(index, c.token_ids, c.logprobs) if self.want_logprobs else None
        out = {"index": index, "text": self._echo_text(index) + "".join(c.text), "logprobs": lp,
               "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.prompt_logprobs_list(c.prompt_logprobs)
        return out


class ChatFormatter(Formatter):
    full_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, *args, top_logprobs: int, tool_format: str | None = None,
                 tools: list[dict[str, Any]] | None = None, reasoning_parser: str | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None, echo_text: str | None = None,
                 role: str = "assistant", **kwargs):
        """`tool_format`: the model's tool-call format when the request offers `tools`;
        `reasoning_parser`: the server's, if any (tool_calls.py); `echo_text`: what opens each answer's
        content (vLLM's echo of the last, assistant's, message; streamed in the opening chunk); `role`:
        the answers' (vLLM's --response-role)."""
        super().__init__(*args, **kwargs)
        self._echo = echo_text
        self._role = role
        self._top = top_logprobs
        self._parser_args = (tool_format, tools, reasoning_parser, chat_template_kwargs)
        self._parses = tool_format is not None or reasoning_parser is not None
        self._parsers: dict[int, tool_calls.ChoiceParser] = {}  # per streamed choice

    def response(self, choices: list[Choice], usage: Usage) -> dict[str, Any]:
        out = super().response(choices, usage)
        if self.prompt_logprobs is not None:  # vLLM's place for them in chat: the response's, its one prompt's
            out["prompt_logprobs"] = self.prompt_logprobs_list(choices[0].prompt_logprobs)
        return out

    def head_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        opening = {"role": self._role, "content": self._echo or ""}
        return [self._chunk([{"index": i, "delta": opening, "logprobs": None, "finish_reason": None}])
                for i in range(num_choices)]

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        s = self.token_name(token_id)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, float]]) -> dict[str, Any]:
        # An entry holds the top alternatives in rank order, then the sampled token if it is not among them.
        return {"content": [
            self._token(t, e[t]) | {"top_logprobs": [self._token(i, lp) for i, lp in list(e.items())[:self._top]]}
            for t, e in zip(token_ids, entries)]}

    def chunks(self, index: int, d: Delta) -> list[dict[str, Any]]:
        """One chunk per kind of part the delta completes (tool_calls.deltas); the first carries the
        delta's logprobs, the last its finish reason."""
        lp = self._logprobs(d.token_ids, d.logprobs) if self.want_logprobs and d.logprobs else None
        deltas, reason = [{"content": d.text}] if d.text else [], d.finish_reason
        if self._parses:
            parser = self._parsers.setdefault(index, tool_calls.ChoiceParser(*self._parser_args))
            deltas, reason = tool_calls.deltas(parser, d.text, d.finished, d.finish_reason)
        if not deltas and lp is None and not d.finished:
            return []
        deltas = deltas or [{}]
        last = len(deltas) - 1
        return [self._chunk([{"index": index, "delta": delta, "logprobs": lp if i == 0 else None,
                              "finish_reason": reason if i == last else None,
                              "stop_reason": d.stop_reason if i == last else None}]) for i, delta in enumerate(deltas)]

    def _full_choice(self, index: int, c: Choice) -> dict[str, Any]:
        lp = self._logprobs(c.token_ids, c.logprobs) if self.want_logprobs else None
        msg, reason = {"role": self._role, "content": "".join(c.text)}, c.finish_reason
        if self._parses:
            msg, reason = tool_calls.message(tool_calls.ChoiceParser(*self._parser_args), "".join(c.text),
                                             c.finish_reason, with_reasoning=self._parser_args[2] is not None)
            msg["role"] = self._role
        if self._echo is not None:
            msg["content"] = self._echo + (msg["content"] or "")
        return {"index": index, "message": msg, "logprobs": lp, "finish_reason": reason,
                "stop_reason": c.stop_reason}
