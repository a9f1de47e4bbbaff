"""OpenAI request validation: a JSON body becomes a CompletionRequest or a ChatRequest, or a 400.

Follows the OpenAI schema: unknown fields, wrong types and out-of-range values are rejected, and so
are fields OpenAI would honour but this server cannot (suffix, ...), instead of being ignored.
vLLM's sampling extensions (top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids,
allowed_token_ids, ...), its `structured_outputs` and its `priority` (lower runs first) are accepted
too. Structured-output and tool fields are checked in server/structured.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from infire_jax.errors import InvalidRequestError
from infire_jax.loaders import chat_content
from infire_jax.sample.sampling_params import MAX_LOGPROBS, SamplingParams
from infire_jax.structured import StructuredOutputs
from server import structured
from server.errors import APIError

_INT64 = 2 ** 63
_INT32 = 2 ** 31  # token ids and top_k travel to the device as int32
_MAX_N = 128
_MAX_STOP = 64  # OpenAI takes 4; vLLM any number (few-shot prompts often stop on many markers)

_COMMON = frozenset({
    "model", "n", "max_tokens", "temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "stop",
    "stream", "stream_options", "logit_bias", "user",
    # vLLM extensions
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens",
    "include_stop_str_in_output", "priority", "structured_outputs", "allowed_token_ids", "truncate_prompt_tokens",
    "return_tokens_as_token_ids", "prompt_logprobs", "bad_words", "use_beam_search", "length_penalty", "early_stopping",
    "spaces_between_special_tokens", "cache_salt",
    # vLLM's prefill/decode disaggregation (server/kv_handoff.py)
    "kv_transfer_params",
}) | frozenset(structured.GUIDED_FIELDS)
_COMPLETION = _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix", "response_format", "add_special_tokens"}
_CHAT = _COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens", "response_format", "tools",
                   "tool_choice", "parallel_tool_calls", "store", "chat_template_kwargs", "reasoning_effort",
                   "add_generation_prompt", "continue_final_message", "echo", "add_special_tokens",
                   # OpenAI's, accepted where their value changes nothing here (`_neutral_chat_fields`)
                   "metadata", "service_tier", "modalities", "audio", "prediction", "safety_identifier",
                   "prompt_cache_key", "functions", "function_call"}
REASONING_EFFORTS = ("low", "medium", "high")
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
# Arguments the server gives the chat template itself: chat_template_kwargs may not replace them.
_TEMPLATE_ARGS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


@dataclasses.dataclass
class GenerationRequest:
    """What both endpoints share once validated."""

    model: str | None  # None: the body named none (the served model: endpoints.served_model)
    params: SamplingParams
    stream: bool
    include_usage: bool
    continuous_usage: bool  # vLLM's stream_options.continuous_usage_stats: each chunk has its choice's usage
    priority: int
    kv_transfer: dict | None  # kv_transfer_params that ask for a transfer; None: none asked
    # vLLM's: keep the prompt's last k tokens (-1: the model's context length); None: the whole prompt
    truncate_prompt_tokens: int | None
    tokens_as_ids: bool  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:{id}"
    prompt_logprobs: int | None  # vLLM's prompt_logprobs field: the response's list with this many alternatives
    beam_search: bool  # vLLM's use_beam_search: `n` beams (server/beam_search.py)
    cache_salt: str | None  # vLLM's: only requests with the same salt (and tenant) share prefix-cache pages
    length_penalty: float  # a beam's score: cumulative logprob / length ** length_penalty


@dataclasses.dataclass
class CompletionRequest(GenerationRequest):
    prompts: list[str | list[int]]
    echo: bool
    add_special_tokens: bool  # vLLM's: text prompts are encoded with the tokenizer's special tokens (BOS)


@dataclasses.dataclass
class ChatRequest(GenerationRequest):
    messages: list[dict]
    top_logprobs: int | None  # None: no logprobs
    tools: structured.ToolRequest | None  # None: no tool may be called
    response_format: StructuredOutputs | None  # the constraint response_format puts on the answer
    chat_template_kwargs: dict[str, Any]  # to the chat template and the reasoning parser
    # The messages' images in order, as (URL, the field that gave it); each is an <|image|> in the text.
    images: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    add_generation_prompt: bool = True  # the template's assistant header after the messages
    continue_final_message: bool = False  # vLLM's: the last message left open, for the model to continue
    # vLLM's echo: the last message's text, where it is the assistant's, opens the answer; None: no echo
    echo_text: str | None = None
    add_special_tokens: bool = False  # vLLM's: the tokenizer's special tokens (BOS) over the template's own


class Body:
    """Typed, range-checked access to the fields of a JSON object. A null field is an absent one."""

    def __init__(self, data: Any, allowed: frozenset[str], path: str | None = None):
        """`path`: where a nested object sits in the request (`stream_options`), for its errors' names."""
        self.path = path
        if not isinstance(data, dict):
            if path is None:
                raise bad("the request body must be a JSON object")
            raise bad(f"Invalid type for '{path}': expected an object, but got {json_type(data)} instead.", path)
        unknown = sorted(k for k in data if k not in allowed)
        if unknown:
            raise bad(f"Unrecognized request argument supplied: {self._name(unknown[0])}", self._name(unknown[0]))
        self.data = data

    def _name(self, field: str) -> str:
        return field if self.path is None else f"{self.path}.{field}"

    def present(self, name: str) -> bool:
        return self.data.get(name) is not None

    def _typed(self, name: str, ok: Callable[[Any], bool], kind: str) -> Any:
        v = self.data.get(name)
        if v is not None and not ok(v):
            where = self._name(name)
            raise bad(f"Invalid type for '{where}': expected {kind}, but got {json_type(v)} instead.", where)
        return v

    def integer(self, name: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
        v = self._typed(name, _is_int, "an integer")
        if v is None:
            return default
        _check_range(self._name(name), v, lo, hi)
        return v

    def number(self, name: str, default: float, lo: float | None = None, hi: float | None = None) -> float:
        v = self._typed(name, lambda x: _is_int(x) or isinstance(x, float), "a number")
        if v is None:
            return default
        _check_range(self._name(name), v, lo, hi)
        return float(v)

    def boolean(self, name: str, default: bool) -> bool:
        v = self._typed(name, lambda x: isinstance(x, bool), "a boolean")
        return default if v is None else v

    def string(self, name: str) -> str | None:
        return self._typed(name, lambda x: isinstance(x, str), "a string")

    def string_map(self, name: str) -> dict[str, str]:
        """An object of strings (OpenAI's `metadata`); {} when absent."""
        def ok(x: Any) -> bool:
            return isinstance(x, dict) and all(isinstance(v, str) for v in x.values())

        return self._typed(name, ok, "an object of strings") or {}

    def neutral(self, name: str, ok: Callable[[Any], bool], why: str) -> None:
        """Accepts a field only with a value that changes nothing here."""
        v = self.data.get(name)
        if v is not None and not ok(v):
            raise bad(f"'{self._name(name)}' is not supported by this server: {why}", self._name(name))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def json_type(v: Any) -> str:
    for t, name in ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"),
                    (list, "an array"), (dict, "an object")):
        if isinstance(v, t):
            return name
    return "null"


def _check_range(name: str, v: float, lo: float | None, hi: float | None) -> None:
    if lo is not None and v < lo:
        raise bad(f"Invalid '{name}': expected a value >= {lo}, but got {v} instead.", name)
    if hi is not None and v > hi:
        raise bad(f"Invalid '{name}': expected a value <= {hi}, but got {v} instead.", name)


def _common(b: Body, *, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None,
            constraint: StructuredOutputs | None = None, defaults: Mapping[str, Any]) -> GenerationRequest:
    """Fields both endpoints share, and the SamplingParams they define. `defaults`: the served model's
    generation-config values (sample/generation_config.py) for sampling fields the body leaves unset;
    its max_tokens caps the body's, as vLLM's does."""
    if defaults.get("max_tokens") is not None:
        max_tokens = defaults["max_tokens"] if max_tokens is None else min(max_tokens, defaults["max_tokens"])
    model = b.string("model") or None  # as vLLM: a body without one asks for the served model
    stream = b.boolean("stream", False)
    include_usage = continuous_usage = False
    if b.present("stream_options"):
        if not stream:
            raise bad("The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options")
        options = Body(b.data["stream_options"], frozenset({"include_usage", "continuous_usage_stats"}),
                       "stream_options")
        include_usage = options.boolean("include_usage", False)
        continuous_usage = include_usage and options.boolean("continuous_usage_stats", False)  # as vLLM: both
    b.string("user")
    stop = b.data.get("stop")
    if stop is not None:
        if isinstance(stop, list):
            if len(stop) > _MAX_STOP or not all(isinstance(s, str) for s in stop):
                raise bad(f"'stop' must be a string or an array of at most {_MAX_STOP} strings", "stop")
        elif not isinstance(stop, str):
            raise bad(f"Invalid type for 'stop': expected a string or an array, but got {json_type(stop)} "
                      "instead.", "stop")
    stop_token_ids = b.data.get("stop_token_ids")
    if stop_token_ids is not None and not (isinstance(stop_token_ids, list) and all(
            _is_int(t) and 0 <= t < _INT32 for t in stop_token_ids)):
        raise bad("'stop_token_ids' must be an array of token ids (integers >= 0)", "stop_token_ids")
    top_k = b.integer("top_k", defaults.get("top_k", 0), lo=-1, hi=_INT32 - 1)
    asked = b.integer("prompt_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if asked is not None and stream:
        raise bad("'prompt_logprobs' are not available when 'stream' is true", "prompt_logprobs")
    if asked is not None:  # the engine computes the larger of it and echo's
        prompt_logprobs = asked if prompt_logprobs is None else max(asked, prompt_logprobs)
    try:
        params = SamplingParams(
            n=b.integer("n", 1, lo=1, hi=_MAX_N), max_tokens=max_tokens, min_tokens=b.integer("min_tokens", 0, lo=0),
            temperature=b.number("temperature", defaults.get("temperature", 1.0), lo=0, hi=2),
            top_p=b.number("top_p", defaults.get("top_p", 1.0), lo=0, hi=1),
            top_k=top_k, min_p=b.number("min_p", defaults.get("min_p", 0.0), lo=0, hi=1),
            repetition_penalty=b.number("repetition_penalty", defaults.get("repetition_penalty", 1.0), lo=0),
            presence_penalty=b.number("presence_penalty", 0.0, lo=-2, hi=2),
            frequency_penalty=b.number("frequency_penalty", 0.0, lo=-2, hi=2),
            seed=b.integer("seed", None, lo=-_INT64, hi=_INT64 - 1), stop=stop, stop_token_ids=stop_token_ids,
            ignore_eos=b.boolean("ignore_eos", False), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=b.boolean("skip_special_tokens", True),
            include_stop_str_in_output=b.boolean("include_stop_str_in_output", False),
            structured_outputs=_constraint(constraint, _vllm_constraint(b.data)),
            logit_bias=_logit_bias(b.data.get("logit_bias")), allowed_token_ids=b.data.get("allowed_token_ids"),
            bad_words=b.data.get("bad_words"))
    except InvalidRequestError as e:  # SamplingParams' own checks
        raise bad(str(e), e.param) from e
    # vLLM's; its fast-tokenizer detokenizer, as this server's, decodes special tokens without spaces either way
    b.boolean("spaces_between_special_tokens", True)
    cache_salt = b.string("cache_salt")
    if cache_salt is not None and not cache_salt:
        raise bad("'cache_salt' must be a non-empty string", "cache_salt")
    truncate = b.integer("truncate_prompt_tokens", None, lo=-1)
    if truncate == 0:
        raise bad("'truncate_prompt_tokens' must be -1 (the model's context length) or at least 1",
                  "truncate_prompt_tokens")
    return GenerationRequest(model=model, params=params, stream=stream, include_usage=include_usage,
                             continuous_usage=continuous_usage,
                             priority=b.integer("priority", 0, lo=-_INT64, hi=_INT64 - 1),
                             kv_transfer=_transfer_params(b.data.get("kv_transfer_params")),
                             truncate_prompt_tokens=truncate,
                             tokens_as_ids=b.boolean("return_tokens_as_token_ids", False), prompt_logprobs=asked,
                             cache_salt=cache_salt,
                             **_beam_search(b, params, asked))


def _beam_search(b: Body, params: SamplingParams, prompt_logprobs: int | None) -> dict[str, Any]:
    """vLLM's beam-search fields; what beam search cannot honour is refused naming the field. vLLM's
    `early_stopping` is taken and has no effect there either (its beam search runs to max_tokens)."""
    length_penalty = b.number("length_penalty", 1.0)
    b.boolean("early_stopping", False)
    if not b.boolean("use_beam_search", False):
        return {"beam_search": False, "length_penalty": length_penalty}
    constraint = "response_format" if b.present("response_format") else "structured_outputs"
    conflicts = {"stop": params.stop, "stop_token_ids": params.stop_token_ids, "logit_bias": params.logit_bias,
                 constraint: params.structured_outputs, "prompt_logprobs": prompt_logprobs,
                 "allowed_token_ids": params.allowed_token_ids, "bad_words": params.bad_words,
                 "min_tokens": params.min_tokens}
    for name, value in conflicts.items():
        if value:
            raise bad(f"'{name}' cannot be used with 'use_beam_search'", name)
    return {"beam_search": True, "length_penalty": length_penalty}


def _logit_bias(raw: Any) -> dict[int, float] | None:
    """OpenAI's map of token ids (JSON keys, so strings) to biases; the values' ranges are SamplingParams'."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise bad(f"Invalid type for 'logit_bias': expected an object, but got {json_type(raw)} instead.", "logit_bias")
    out = {}
    for key, value in raw.items():
        if not (key.isascii() and key.isdigit()):
            raise bad(f"Invalid key in 'logit_bias': {key!r} is not a token id", "logit_bias")
        if not (_is_int(value) or isinstance(value, float)):
            raise bad(f"Invalid value in 'logit_bias' for token {key}: expected a number, but got {json_type(value)} "
                      "instead.", "logit_bias")
        out[int(key)] = float(value)
    return out


def _vllm_constraint(data: dict[str, Any]) -> StructuredOutputs | None:
    """vLLM's `structured_outputs`, or its older `guided_*` fields: not both."""
    new, old = structured.structured_outputs(data.get("structured_outputs")), structured.guided(data)
    if new is not None and old is not None:
        raise bad("give 'structured_outputs' or a 'guided_*' field, not both", "structured_outputs")
    return new or old


def _constraint(response_format: StructuredOutputs | None,
                structured_outputs: StructuredOutputs | None) -> StructuredOutputs | None:
    if response_format is not None and structured_outputs is not None:
        raise bad("give 'response_format' or 'structured_outputs', not both", "structured_outputs")
    return response_format or structured_outputs


def _transfer_params(raw: Any) -> dict | None:
    """The field's shape only; whether this worker's role can serve it is the handler's check.

    vLLM's proxies send `{"do_remote_decode": true, "remote_engine_id": null, ...}`: extra keys are
    accepted. Neither flag set means no transfer.
    """
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise bad(f"Invalid type for 'kv_transfer_params': expected an object, but got {json_type(raw)} instead.",
                  "kv_transfer_params")
    for flag in ("do_remote_decode", "do_remote_prefill"):
        if raw.get(flag) is not None and not isinstance(raw[flag], bool):
            raise bad(f"'kv_transfer_params.{flag}' must be a boolean", "kv_transfer_params")
    if raw.get("do_remote_decode") and raw.get("do_remote_prefill"):
        raise bad("'kv_transfer_params' cannot ask for both do_remote_decode and do_remote_prefill",
                  "kv_transfer_params")
    return raw if raw.get("do_remote_decode") or raw.get("do_remote_prefill") else None


def parse_completion(data: Any, defaults: Mapping[str, Any] | None = None) -> CompletionRequest:
    """`defaults`: as `_common` takes them (none: OpenAI's)."""
    b = Body(data, _COMPLETION)
    if not b.present("prompt"):
        raise bad("you must provide a prompt parameter", "prompt")
    prompts = _prompts(b.data["prompt"])
    logprobs = b.integer("logprobs", None, lo=0, hi=MAX_LOGPROBS)
    echo = b.boolean("echo", False)
    # absent: OpenAI's 16; null: the rest of the context, as vLLM reads it
    max_tokens = b.integer("max_tokens", None if "max_tokens" in b.data else 16, lo=0)
    if max_tokens == 0 and not echo:
        raise bad("'max_tokens' may be 0 only with 'echo' (scoring the prompt); otherwise it must be at least 1",
                  "max_tokens")
    b.neutral("suffix", lambda v: v == "", "insertion (suffix) is not implemented")
    # echo with logprobs: the prompt's tokens come back with their logprobs too (prompt logprobs)
    common = _common(b, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=logprobs if echo else None,
                     constraint=structured.response_format(b.data.get("response_format")), defaults=defaults or {})
    b.neutral("best_of", lambda v: v == common.params.n, "best_of must be null or equal to n")
    if common.beam_search and echo:
        raise bad("'echo' cannot be used with 'use_beam_search'", "echo")
    return CompletionRequest(**vars(common), prompts=prompts, echo=echo,
                             add_special_tokens=b.boolean("add_special_tokens", True))


def _prompts(raw: Any) -> list[str | list[int]]:
    """A string, an array of strings, an array of token ids, or an array of token-id arrays."""
    if isinstance(raw, str):
        return [raw]
    if isinstance(raw, list) and raw:
        if all(isinstance(p, str) for p in raw):
            return list(raw)
        if all(_is_int(t) for t in raw):
            return [list(raw)]
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in raw):
            return [list(p) for p in raw]
    raise bad("'prompt' must be a string, an array of strings, an array of token ids, or an array of "
              "non-empty token-id arrays", "prompt")


def parse_chat(data: Any, defaults: Mapping[str, Any] | None = None) -> ChatRequest:
    """`defaults`: as `_common` takes them (none: OpenAI's)."""
    b = Body(data, _CHAT)
    if not b.present("messages"):
        raise bad("you must provide a messages parameter", "messages")
    images: list[tuple[str, str]] = []
    messages = parse_messages(b.data["messages"], images)
    want_logprobs = b.boolean("logprobs", False)
    top_logprobs = b.integer("top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if top_logprobs is not None and not want_logprobs:
        raise bad("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    max_tokens = b.integer("max_completion_tokens", None, lo=1)
    if max_tokens is None:
        max_tokens = b.integer("max_tokens", None, lo=1)
    fmt = structured.response_format(b.data.get("response_format"))
    tools = structured.tools(b.data.get("tools"), b.data.get("tool_choice"), b.boolean("parallel_tool_calls", True))
    _neutral_chat_fields(b)
    top = (top_logprobs or 0) if want_logprobs else None
    common = _common(b, max_tokens=max_tokens, logprobs=top, constraint=fmt, defaults=defaults or {})
    if tools is not None and tools.forced and common.params.structured_outputs is not None:
        raise bad("a forced 'tool_choice' cannot be combined with 'response_format' or 'structured_outputs'",
                  "tool_choice")
    kwargs = template_kwargs(b.data.get("chat_template_kwargs"), b.string("reasoning_effort"))
    generation_prompt = b.boolean("add_generation_prompt", True)
    continue_final = b.boolean("continue_final_message", False)
    if continue_final and generation_prompt:
        raise bad("'continue_final_message' leaves the last message open: set 'add_generation_prompt' to false "
                  "with it", "continue_final_message")
    if continue_final and not (messages[-1]["content"] or "").strip():
        raise bad("'continue_final_message' needs a last message with text to continue", "continue_final_message")
    if common.truncate_prompt_tokens is not None and images:
        raise bad("'truncate_prompt_tokens' cannot cut a prompt with images", "truncate_prompt_tokens")
    last = messages[-1]
    echo = b.boolean("echo", False) and last["role"] == "assistant"
    return ChatRequest(**vars(common), messages=messages, top_logprobs=top, tools=tools, response_format=fmt,
                       chat_template_kwargs=kwargs, images=images, add_generation_prompt=generation_prompt,
                       continue_final_message=continue_final, echo_text=(last["content"] or "") if echo else None,
                       add_special_tokens=b.boolean("add_special_tokens", False))


def template_kwargs(raw: Any, effort: str | None = None) -> dict[str, Any]:
    """vLLM's `chat_template_kwargs`: extra variables of the template (Qwen3's `enable_thinking`,
    DeepSeek V3.1's `thinking`), which the reasoning parser reads too. `reasoning_effort` joins them
    (gpt-oss's template writes it into its system message)."""
    if effort is not None and effort not in REASONING_EFFORTS:
        raise bad(f"Invalid value for 'reasoning_effort': expected one of {', '.join(REASONING_EFFORTS)}, got "
                  f"{effort!r}", "reasoning_effort")
    if raw is None:
        return {} if effort is None else {"reasoning_effort": effort}
    if not isinstance(raw, dict):
        raise bad(f"Invalid type for 'chat_template_kwargs': expected an object, but got {json_type(raw)} instead.",
                  "chat_template_kwargs")
    taken = sorted(_TEMPLATE_ARGS.intersection(raw))
    if taken:
        raise bad(f"'chat_template_kwargs.{taken[0]}' is set by the server; give it in its own field",
                  f"chat_template_kwargs.{taken[0]}")
    if effort is not None and raw.get("reasoning_effort", effort) != effort:
        raise bad("'reasoning_effort' and 'chat_template_kwargs.reasoning_effort' differ; give one",
                  "reasoning_effort")
    return raw if effort is None else raw | {"reasoning_effort": effort}


def _neutral_chat_fields(b: Body) -> None:
    """OpenAI's chat fields that clients send as they are (often null or the default): accepted where
    they change nothing here, refused by name where they would."""
    b.neutral("store", lambda v: v is False, "completions are not stored")
    b.string_map("metadata")  # kept with a stored completion, and none is stored
    b.neutral("service_tier", lambda v: v in ("auto", "default"), "there is one service tier")
    b.neutral("modalities", lambda v: v == ["text"], "the output is text")
    b.neutral("audio", lambda v: False, "the output is text")
    b.neutral("prediction", lambda v: False, "predicted outputs are not supported")
    b.string("safety_identifier")
    b.string("prompt_cache_key")  # the prefix cache finds shared prompts without a key
    b.neutral("functions", lambda v: v == [], "the deprecated function calling is not supported; give 'tools'")
    b.neutral("function_call", lambda v: v == "none", "the deprecated function calling is not supported; give "
              "'tool_choice'")


def parse_messages(raw: Any, images: list[tuple[str, str]] | None = None) -> list[dict]:
    """Validated messages with text content (an image part: its `<|image|>` marker, its URL appended
    to `images`; None: images are refused); `developer` is rendered as `system`. Tool results and an
    assistant's tool calls are checked in server/structured.py."""
    if not isinstance(raw, list) or not raw:
        raise bad("'messages' must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(raw):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"Invalid type for '{p}': expected an object, but got {json_type(m)} instead.", p)
        extra = sorted(set(m) - {"role", "content", "name", "tool_calls", "tool_call_id", "refusal",
                                 *_REASONING_FIELDS, *_NULL_MESSAGE_FIELDS})
        extra += sorted(k for k in _NULL_MESSAGE_FIELDS if m.get(k) not in (None, []))
        if extra:
            raise bad(f"Unrecognized or unsupported message field: {p}.{extra[0]}", f"{p}.{extra[0]}")
        role = m.get("role")
        if role not in _ROLES:
            raise bad(f"Invalid value for '{p}.role': expected one of {sorted(_ROLES)}, got {role!r}", f"{p}.role")
        refusal = m.get("refusal")
        if refusal is not None:  # an earlier answer that refused: its text is what the assistant said
            if role != "assistant" or not isinstance(refusal, str) or m.get("content") is not None:
                raise bad(f"'{p}.refusal' must be a string on an assistant message without content", f"{p}.refusal")
            m = {k: v for k, v in m.items() if k != "refusal"} | {"content": refusal}
        calls = structured.tool_message(m, p)
        parts = None if calls.get("tool_calls") and m.get("content") is None else \
            _parts(m.get("content"), f"{p}.content", images)
        content = parts if parts is None or isinstance(parts, str) else chat_content.joined(parts)
        msg = {"role": _ROLES[role], "content": content} | calls | _reasoning(m, p)
        if isinstance(parts, list):  # the template may take them as they are (loaders/chat_content.py)
            msg[chat_content.PARTS] = parts
        name = m.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise bad(f"Invalid type for '{p}.name': expected a string", f"{p}.name")
            msg["name"] = name
        out.append(msg)
    return out


# Fields of OpenAI's assistant messages that a client replaying a response sends back as null (or []):
# accepted so, refused with a value (audio, the deprecated function call, web search annotations).
_NULL_MESSAGE_FIELDS = ("audio", "function_call", "annotations")
# An earlier turn's reasoning: vLLM's names, old and new.
_REASONING_FIELDS = ("reasoning_content", "reasoning")


def _reasoning(m: dict, p: str) -> dict[str, str]:
    """An assistant message's reasoning, as `reasoning_content` (the name templates such as Qwen3's
    read; those that do not ignore it)."""
    for name in _REASONING_FIELDS:
        v = m.get(name)
        if v is not None:
            if not isinstance(v, str):
                raise bad(f"Invalid type for '{p}.{name}': expected a string, but got {json_type(v)} instead.",
                          f"{p}.{name}")
            return {"reasoning_content": v}
    return {}


# Content parts that carry an image (OpenAI's chat `image_url`, the Responses API's `input_image`).
_IMAGE_PARTS = ("image_url", "input_image", "image")


def images_of(part: dict, p: str, images: list[tuple[str, str]] | None) -> None:
    """Appends an `image_url` part's URL to `images` (OpenAI's {"url": ..., "detail": ...} or the URL
    itself); a 400 for other image parts, a malformed one, or where images are not taken (None)."""
    if images is None or part["type"] != "image_url":
        raise bad(f"'{p}': a {part['type']!r} part is not taken here; chat messages take "
                  "{\"type\": \"image_url\", \"image_url\": {\"url\": ...}}", p)
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    extra = sorted(set(part) - {"type", "image_url"}) + (sorted(set(ref) - {"url", "detail"})
                                                         if isinstance(ref, dict) else [])
    if not isinstance(url, str) or not url or extra:
        raise bad(f"'{p}': an image part is {{\"type\": \"image_url\", \"image_url\": {{\"url\": \"...\"}}}}"
                  + (f"; unknown field {extra[0]!r}" if extra else ""), p)
    images.append((url, p))


def _parts(content: Any, p: str, images: list[tuple[str, str]] | None = None) -> str | list[dict[str, str]]:
    """A message's content: its text, or its parts ({"type": "text", "text": ...} and {"type": "image"},
    each image's URL appended to `images`)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in _IMAGE_PARTS:  # never dropped: said so
                parts.append({"type": "image"})
                images_of(part, f"{p}[{j}]", images)
                continue
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                    and set(part) == {"type", "text"}):
                raise bad(f"'{p}[{j}]': only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported",
                          f"{p}[{j}]")
            parts.append({"type": "text", "text": part["text"]})
        return parts
    raise bad(f"Invalid type for '{p}': expected a string or an array of text parts, but got "
              f"{json_type(content)} instead.", p)
