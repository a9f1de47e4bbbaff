"""Tokenizer (HF `tokenizers`) and chat template (jinja2), from `tokenizer.json` or GGUF metadata."""

from __future__ import annotations

import datetime
import json
import logging
import os
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors

from infire_jax.errors import InvalidRequestError, UnsupportedModelError
from infire_jax.loaders.chat_content import for_template, template_content_format

log = logging.getLogger(__name__)

# GGUF `tokenizer.ggml.pre` -> the split regex llama.cpp and HF use for that family.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_GGUF_TOKEN_CONTROL, _GGUF_TOKEN_USER_DEFINED = 3, 4


def _byte_level_pre_tokenizer(pre: str | None):
    if pre in ("llama-bpe", "llama3", "llama-v3"):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre == "qwen2":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre == "smollm":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre not in (None, "default", "gpt2", "gpt-2"):
        log.warning("GGUF pre-tokenizer %r is not known; using the GPT-2 split", pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def tokenizer_from_gguf(meta: Mapping[str, Any]) -> "Tokenizer":
    """Rebuilds the HF tokenizer from GGUF metadata (byte-level BPE, the `gpt2` model type)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModelError(
            f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
            "use the HF directory of this model instead")
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tk = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    tk.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    tk.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type")
    if types is not None:
        special = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types)
                   if t == _GGUF_TOKEN_CONTROL]
        user = [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types)
                if t == _GGUF_TOKEN_USER_DEFINED]
        tk.add_special_tokens(special)
        tk.add_tokens(user)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    if add_bos:
        tk.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]}:0 $A:0", pair=f"{tokens[bos]}:0 $A:0 $B:1", special_tokens=[(tokens[bos], bos)])
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return Tokenizer(tk, bos_token=tokens[bos] if bos is not None else None,
                     eos_token=tokens[eos] if eos is not None else None,
                     chat_template=meta.get("tokenizer.chat_template"))


def _raise(message: str):
    raise InvalidRequestError(f"chat template error: {message}", param="messages")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class Tokenizer:
    """Encode/decode plus the model's chat template. Wraps a `tokenizers.Tokenizer`."""

    def __init__(self, tk: HFTokenizer, *, bos_token: str | None, eos_token: str | None,
                 chat_template: str | None, model_type: str | None = None, content_format: str = "auto"):
        self.tk = tk
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        # what the template takes as a message's content (chat_content.py; vLLM's --chat-template-content-format)
        self.content_format = template_content_format(chat_template) if content_format == "auto" else content_format
        self.model_type = model_type  # config.json's, where the tokenizer came with one: its chat format's family
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        self._template = env.from_string(chat_template) if chat_template else None

    # ---- (de)serialisation --------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str) -> "Tokenizer":
        """Reads `tokenizer.json` and the special tokens / chat template of `tokenizer_config.json`."""
        tk = HFTokenizer.from_file(os.path.join(path, "tokenizer.json"))
        conf: dict[str, Any] = {}
        conf_path = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(conf_path):
            with open(conf_path) as f:
                conf = json.load(f)
        template = conf.get("chat_template")
        jinja_path = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.exists(jinja_path):
            with open(jinja_path) as f:
                template = f.read()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)

        def token_str(v):
            return v.get("content") if isinstance(v, dict) else v

        model_type = conf.get("model_type")  # as `save` keeps it (a checkpoint has no config.json)
        config_path = os.path.join(path, "config.json")
        if os.path.exists(config_path):
            with open(config_path) as f:
                model_type = json.load(f).get("model_type")
        return cls(tk, bos_token=token_str(conf.get("bos_token")), eos_token=token_str(conf.get("eos_token")),
                   chat_template=template, model_type=model_type)

    def with_chat_template(self, chat_template: str | None = None, content_format: str = "auto") -> "Tokenizer":
        """The same tokenizer rendering chats with `chat_template` instead (None: its own), taking a
        message's content as `content_format` says (auto: as the template shows)."""
        return Tokenizer(self.tk, bos_token=self.bos_token, eos_token=self.eos_token,
                         chat_template=self.chat_template if chat_template is None else chat_template,
                         model_type=self.model_type, content_format=content_format)

    def save(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        self.tk.save(os.path.join(path, "tokenizer.json"))
        conf = {"bos_token": self.bos_token, "eos_token": self.eos_token, "chat_template": self.chat_template,
                "model_type": self.model_type}
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump(conf, f)

    # ---- use ----------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.tk.token_to_id(token)

    def special_token_id(self, token: str) -> int | None:
        """The id of `token` if it is one of the tokenizer's special tokens (dropped by a decode that
        skips special tokens, and never spelled out by the text's own tokens), else None."""
        tid = self.tk.token_to_id(token)
        added = self.tk.get_added_tokens_decoder().get(tid) if tid is not None else None
        return tid if added is not None and added.special else None

    def added_token_id(self, token: str) -> int | None:
        """The id of `token` if the tokenizer added it whole, special or not (Qwen's <tool_call> and
        <think> are added and not special: a decode keeps their text), else None. A grammar must name
        such a token by its id: llguidance, like the tokenizer, never spells it out of its text."""
        tid = self.tk.token_to_id(token)
        return tid if tid is not None and tid in self.tk.get_added_tokens_decoder() else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return self.tk.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:  # tokenizers' word for a str it cannot take as UTF-8 (a lone surrogate)
            if not isinstance(text, str):
                raise
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InvalidRequestError(f"the text is not valid Unicode: it holds a lone surrogate "
                                          f"(U+{ord(text[e.start]):04X}) at character {e.start}") from None
            raise

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **kwargs) -> str:
        """Renders a conversation with the model's own template. `continue_final_message`: the text ends
        with the last message's content, whatever the template writes after it (its end-of-turn), so the
        model continues that message (a prefilled answer), as transformers and vLLM do."""
        if self._template is None:
            raise InvalidRequestError("this model has no chat template; use the completions API", param="messages")
        messages, final = for_template(messages, self.content_format)
        try:
            text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"chat template error: {e}", param="messages") from e
        return open_final_message(text, final) if continue_final_message else text


def open_final_message(text: str, final: str) -> str:
    """`text` (a rendered conversation) cut after its last message's content `final`: after the content
    as given where the template kept its trailing whitespace, else after the stripped content (templates
    that trim it)."""
    core = final.strip()
    if not core or core not in text:
        raise InvalidRequestError("continue_final_message: the chat template does not write the last message's "
                                  "text as given, so it cannot be continued", param="continue_final_message")
    at = text.rindex(core)
    kept = final.lstrip()
    return text[:at + len(kept)] if text[at:at + len(kept)] == kept else text[:at + len(core)]
