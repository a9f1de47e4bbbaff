"""vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions: `n` beams per prompt, each step
one engine request that runs every live beam for one token (infire_jax/sample/beam_search.py), the
`n` best sequences returned as the choices, best first. A stream sends each choice whole once the
search ends, as vLLM does. A client leaving mid-search aborts the step it waits on.
"""

from __future__ import annotations

import uuid
from typing import Callable

from aiohttp import web

from infire_jax.errors import InvalidRequestError
from infire_jax.outputs import Delta
from infire_jax.sample.beam_search import BeamSearch, BeamSearchParams
from server.auth import TENANT, salted_tenant
from server.errors import APIError
from server.protocol import GenerationRequest, bad
from server.responses import Choice, Formatter, Usage
from server.streaming import SSEWriter


def _params(req: GenerationRequest, prompts: list[list[int]], max_model_len: int) -> BeamSearchParams:
    longest = max(len(p) for p in prompts)
    max_tokens = req.params.max_tokens if req.params.max_tokens is not None else max_model_len - longest
    if longest + max_tokens > max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens; a prompt of {longest} "
                            f"tokens and max_tokens={max_tokens} exceed it.", param="max_tokens",
                       code="context_length_exceeded")
    p = req.params
    try:
        return BeamSearchParams(beam_width=p.n, max_tokens=max_tokens, ignore_eos=p.ignore_eos,
                                temperature=p.temperature, length_penalty=req.length_penalty,
                                include_stop_str_in_output=p.include_stop_str_in_output)
    except InvalidRequestError as e:
        raise bad(str(e), e.param) from e


async def respond(request: web.Request, m, lora: str | None, req: GenerationRequest, prompts: list[list[int]],
                  make_formatter: Callable[[], Formatter]) -> web.StreamResponse:
    """Runs the search to its end, then answers with its choices (whole, or as a stream). `m`: the served
    model (server/endpoints.py's ServedModel, which imports this module)."""
    if req.kv_transfer is not None:
        raise bad("'kv_transfer_params' cannot be used with 'use_beam_search'", "kv_transfer_params")
    if req.params.structured_outputs is not None:  # a forced tool_choice's grammar, or response_format
        raise bad("a constrained output (response_format, a forced tool_choice) cannot be used with "
                  "'use_beam_search'", "use_beam_search")
    beams = len(prompts) * req.params.n  # the live beams of a step, each a sequence of the engine's
    if beams > m.engine.capacity:
        raise bad(f"the request asks for {beams} beams (prompts x n); this server runs at most "
                  f"{m.engine.capacity} sequences at once", "n")
    tok = m.tokenizer
    search = BeamSearch(prompts, _params(req, prompts, m.max_model_len),
                        tok.token_to_id(tok.eos_token) if tok.eos_token else None)
    # the adapter is held for the whole search: unloading it meanwhile lets the search finish on it
    adapter = None if lora is None else await m.engine.call(lambda e: e.lora.hold(lora))
    try:
        while not search.done:
            tops: list[dict[int, float]] = [{} for _ in search.step_prompts()]
            step = m.engine.generate(search.step_prompts(), search.step_params(), request_id=uuid.uuid4().hex,
                                     priority=req.priority, tenant=salted_tenant(request.get(TENANT), req.cache_salt),
                                     lora_request=adapter)
            async with step:
                async for batch in step:
                    for pi, d in batch:
                        tops[pi] = d.logprobs[0] if d.logprobs else tops[pi]
            search.advance(tops)
    finally:
        if adapter is not None:
            await m.engine.call(lambda e: e.lora.let_go(adapter))
    deltas = [Delta("", j, seq.tokens[len(p):], tok.decode(seq.tokens[len(p):], req.params.skip_special_tokens),
                    seq.logprobs, seq.finish_reason, seq.stop_reason)
              for p, out in zip(prompts, search.results()) for j, seq in enumerate(out.sequences)]
    usage = Usage([len(p) for p in prompts])
    for i, d in enumerate(deltas):
        usage.add(i // req.params.n, d)
    fmt = make_formatter()
    if not req.stream:
        choices = [Choice() for _ in deltas]
        for c, d in zip(choices, deltas):
            c.add(d)
        return web.json_response(fmt.response(choices, usage))
    sse = SSEWriter(request)
    try:
        await sse.start()
        head, body = fmt.head_chunks(len(deltas)), [fmt.chunks(i, d) for i, d in enumerate(deltas)]
        if req.continuous_usage:  # the opening chunks count no tokens yet; each choice's, all of its own
            opened = Usage([len(p) for p in prompts])
            for i, chunk in enumerate(head):
                chunk["usage"] = opened.choice_dict(i // req.params.n, i % req.params.n)
            for i, chunks in enumerate(body):
                for chunk in chunks:
                    chunk["usage"] = usage.choice_dict(i // req.params.n, i % req.params.n)
        await sse.send(head)
        await sse.send([chunk for chunks in body for chunk in chunks])
        if req.include_usage:
            await sse.send([fmt.usage_chunk(usage)])
        await sse.done()
    except ConnectionResetError:
        pass  # the client went away after the search
    return sse.response
