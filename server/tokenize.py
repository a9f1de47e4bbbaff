"""vLLM's tokenizer endpoints: `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`.

Clients that count tokens themselves use them to tokenize as the server does: lm-evaluation-harness's
`local-completions` finds them (its `remote` tokenizer backend) and then sends its loglikelihood
requests as token ids split exactly where it put the context / continuation boundary, with no
tokenizer of its own. Like /health, they sit outside /v1 and need no API key: they expose the
tokenizer alone.
"""

from __future__ import annotations

from aiohttp import web

from server.endpoints import STATE, ServedModel, chat_text, read_json, served_model
from server.protocol import bad, parse_chat


def _served(request: web.Request, name: str | None) -> ServedModel:
    """The model named (a LoRA adapter's name: the model it runs on, whose tokenizer it shares), or the
    only one served; 404 as on /v1 for a name not served."""
    return served_model(request.app[STATE], name)[0]


def _object(body, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0])
    return body


# vLLM's chat form of /tokenize: the messages as the chat endpoint renders them.
_CHAT_FIELDS = {"messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools"}


async def tokenize(request: web.Request) -> web.Response:
    """{"prompt": text, "add_special_tokens": true, "return_token_strs": false} -> {"tokens": [...], "count": n,
    "max_model_len": m, "token_strs": each token's string, or null}. Or vLLM's chat form: "messages" (with
    "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools") instead of "prompt",
    rendered by the chat template as /v1/chat/completions renders them; "add_special_tokens" then defaults
    to false (the template writes its own)."""
    body = _object(await read_json(request), {"model", "prompt", "add_special_tokens", "return_token_strs",
                                              *_CHAT_FIELDS})
    m = _served(request, body.get("model"))
    chat = "messages" in body
    special, strs = body.get("add_special_tokens"), body.get("return_token_strs")
    for name, value in (("add_special_tokens", special), ("return_token_strs", strs)):
        if value is not None and not isinstance(value, bool):
            raise bad(f"'{name}' must be a boolean", name)
    if chat:
        if "prompt" in body:
            raise bad("give 'prompt' or 'messages', not both", "prompt")
        req = parse_chat({"model": m.name, **{k: body[k] for k in _CHAT_FIELDS if k in body}})
        if req.images:
            raise bad("/tokenize does not take images: their tokens depend on the image", "messages")
        prompt = chat_text(m, req, "messages")
    else:
        unknown = sorted(_CHAT_FIELDS & set(body))
        if unknown:
            raise bad(f"'{unknown[0]}' goes with 'messages'", unknown[0])
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad("'prompt' must be a string", "prompt")
    ids = m.tokenizer.encode(prompt, add_special_tokens=not chat if special is None else special)
    return web.json_response({"count": len(ids), "max_model_len": m.max_model_len, "tokens": ids,
                              "token_strs": [m.tokenizer.tk.id_to_token(i) for i in ids] if strs else None})


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
