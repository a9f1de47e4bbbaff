"""Compiles output constraints into grammars with llguidance, off the engine thread, cached and time-bounded.

Why llguidance (docs/PERFORMANCE.md, "Grammar engine"): on the default model's 49k vocabulary its
masks cost tens of microseconds per token, against a CPU decode step of tens of milliseconds;
grammars compile in about a millisecond, lazily; it takes JSON schemas, regexes and Lark grammars;
and it depends on nothing (xgrammar, a little faster per mask, needs torch, transformers and
triton at run time, which a JAX engine must not pull in).

A compiled grammar is a matcher in its start state; each request gets a deep copy. Compiles run on
a small thread pool (llguidance drops the GIL), are cached by constraint (an LRU of futures, so
concurrent requests with one schema compile it once), and a caller waits at most `timeout`
seconds: a grammar too big to compile in time is a 400, never a hung engine.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import json
import threading

import llguidance

from infire_jax.errors import InvalidRequestError
from infire_jax.structured.matcher import GrammarClock, GrammarMatcher
from infire_jax.structured.spec import StructuredOutputs

# JSON without free whitespace: a small model cannot wander into endless blank lines, and the
# separators are the ones json.dumps writes, so outputs look familiar.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHE_SIZE = 256
_COMPILE_THREADS = 2


class GrammarCompileError(InvalidRequestError):
    """The constraint is invalid, uses an unsupported feature, or did not compile in time."""


def inline_json(schema: dict) -> str:
    """A JSON schema inside a Lark grammar (`%json`), in the same layout as a response_format's."""
    return "%json " + json.dumps(schema | {"x-guidance": JSON_LAYOUT})


def _escape(s: str) -> str:
    return json.dumps(s)  # a Lark string literal is a JSON string


def to_grammar(spec: StructuredOutputs) -> str:
    """The llguidance grammar (its JSON form) of a constraint, after what `spec.after` lets come first:
    the constraint becomes the grammar named `answer` that `after`'s start rule ends in."""
    grammar = _constraint_grammar(spec)
    if spec.after is None:
        return grammar
    # llguidance gives Lark as its text and the other kinds as the JSON of a list of grammars
    answer = {"grammars": [{"lark_grammar": grammar}]} if spec.kind in ("choice", "grammar") else json.loads(grammar)
    answer["grammars"][0]["name"] = "answer"
    return json.dumps(answer | {"grammars": [{"lark_grammar": spec.after}, *answer["grammars"]]})


def _constraint_grammar(spec: StructuredOutputs) -> str:
    kind = spec.kind
    layout = JSON_LAYOUT | (spec.json_layout or {})
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.json, defaults=layout)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=layout)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(_escape(c) for c in spec.choice))
    return llguidance.LLMatcher.grammar_from_lark(spec.grammar)


class CompiledGrammar:
    """A constraint's matcher in its start state; `matcher()` hands out independent copies."""

    def __init__(self, template: llguidance.LLMatcher, clock: GrammarClock):
        self._template = template
        self._clock = clock

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy(), self._clock)


class GrammarBackend:
    """One per engine (one tokenizer and vocabulary)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: tuple[int, ...], *, timeout: float):
        """`vocab_size` is the model's logits width, which may exceed the tokenizer's."""
        self.vocab_size = vocab_size
        self.timeout = timeout
        self.clock = GrammarClock()
        self._pool = concurrent.futures.ThreadPoolExecutor(_COMPILE_THREADS, "infire-grammar")
        # The tokenizer's token trie takes ~0.2 s to build, holding the GIL: once, on the pool, when
        # the first constraint arrives (at start it would hold up the engine's warmup).
        self._make_tokenizer = functools.partial(llguidance.LLTokenizer, tokenizer_json, n_vocab=vocab_size,
                                                 eos_token=list(eos_ids))
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple[str, str], concurrent.futures.Future] = collections.OrderedDict()
        self._lock = threading.Lock()

    @property
    def mask_words(self) -> int:
        return -(-self.vocab_size // 32)

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """The compiled constraint, waiting at most `timeout` seconds; GrammarCompileError names the field."""
        key = spec.key()
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._cache[key] = self._pool.submit(self._build, spec)
                while len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        try:
            return future.result(timeout=self.timeout)
        except concurrent.futures.TimeoutError:
            raise GrammarCompileError(f"the {spec.kind} constraint did not compile within {self.timeout:g} s; "
                                      "simplify it", spec.field_param) from None

    def _build(self, spec: StructuredOutputs) -> CompiledGrammar:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = self._make_tokenizer()
            tokenizer = self._tokenizer
        try:
            grammar = to_grammar(spec)
        except (ValueError, TypeError) as e:
            raise GrammarCompileError(f"invalid {spec.kind} constraint: {e}", spec.field_param) from e
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarCompileError(f"invalid {spec.kind} constraint: {matcher.get_error()}", spec.field_param)
        return CompiledGrammar(matcher, self.clock)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
