"""vLLM's tokenizer endpoints: `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`.

Clients that count tokens themselves use them to tokenize as the server does: lm-evaluation-harness's
`local-completions` finds them (its `remote` tokenizer backend) and then sends its loglikelihood
requests as token ids split exactly where it put the context / continuation boundary, with no
tokenizer of its own. Like /health, they sit outside /v1 and need no API key: they expose the
tokenizer alone.
"""

from __future__ import annotations

from aiohttp import web

from server.endpoints import STATE, ServedModel, read_json
from server.protocol import bad


def _served(request: web.Request, name: str | None) -> ServedModel:
    """The model named, or the only one served."""
    models = request.app[STATE].models
    if name is None:
        if len(models) != 1:
            raise bad(f"this server serves {len(models)} models: name one in 'model'", "model")
        return next(iter(models.values()))
    if not isinstance(name, str) or name not in models:
        raise bad(f"the model {name!r} is not served here; it serves {', '.join(models)}", "model")
    return models[name]


def _object(body, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0])
    return body


async def tokenize(request: web.Request) -> web.Response:
    """{"prompt": text, "add_special_tokens": true} -> {"tokens": [...], "count": n, "max_model_len": m}."""
    body = _object(await read_json(request), {"model", "prompt", "add_special_tokens"})
    m = _served(request, body.get("model"))
    prompt, special = body.get("prompt"), body.get("add_special_tokens", True)
    if not isinstance(prompt, str):
        raise bad("'prompt' must be a string", "prompt")
    if not isinstance(special, bool):
        raise bad("'add_special_tokens' must be a boolean", "add_special_tokens")
    ids = m.tokenizer.encode(prompt, add_special_tokens=special)
    return web.json_response({"count": len(ids), "max_model_len": m.max_model_len, "tokens": ids,
                              "token_strs": None})


async def detokenize(request: web.Request) -> web.Response:
    """{"tokens": [...]} -> {"prompt": text} (special tokens kept, as they were given)."""
    body = _object(await read_json(request), {"model", "tokens"})
    m = _served(request, body.get("model"))
    tokens, vocab = body.get("tokens"), m.tokenizer.vocab_size
    if not (isinstance(tokens, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                             for t in tokens)):
        raise bad(f"'tokens' must be an array of token ids in [0, {vocab})", "tokens")
    return web.json_response({"prompt": m.tokenizer.decode(tokens, skip_special_tokens=False)})


async def tokenizer_info(request: web.Request) -> web.Response:
    """The special tokens, the chat template and the context length (`?model=` with several models)."""
    m = _served(request, request.query.get("model"))
    t = m.tokenizer
    return web.json_response({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": t.bos_token,
                              "eos_token": t.eos_token, "pad_token": None, "chat_template": t.chat_template,
                              "model_max_length": m.max_model_len})
