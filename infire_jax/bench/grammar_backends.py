"""Mask time per token of llguidance and xgrammar on the default model's vocabulary (how the grammar engine was chosen).

`python -m infire_jax.bench.grammar_backends [llguidance|xgrammar]`: for two JSON schemas, compiles
the schema, then walks a valid document token by token, timing each bitmask fill ([1, ceil(V/32)]
int32). xgrammar is not a dependency (it needs torch at run time): install it to compare.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

SCHEMAS = [
    ({"type": "object", "properties": {"name": {"type": "string"},
                                       "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                       "tags": {"type": "array", "items": {"type": "string"}}},
      "required": ["name", "age", "tags"]},
     {"name": "Alice Smith", "age": 42, "tags": ["engineer", "runner", "reader"]}),
    ({"type": "object", "properties": {
        "city": {"type": "string"}, "weather": {"enum": ["sunny", "rainy", "cloudy"]},
        "temp": {"type": "number", "minimum": -50, "maximum": 60},
        "forecast": {"type": "array", "items": {"type": "object", "properties": {
            "day": {"type": "string"}, "high": {"type": "number"}}, "required": ["day", "high"]}}},
      "required": ["city", "weather", "temp", "forecast"]},
     {"city": "Paris", "weather": "sunny", "temp": 21.5,
      "forecast": [{"day": "Monday", "high": 23.1}, {"day": "Tuesday", "high": 19.0}, {"day": "Wednesday", "high": 25}]}),
]


def _llguidance(tokenizer, vocab: int, eos: int):
    import llguidance
    import llguidance.numpy as lnp

    tok = llguidance.LLTokenizer(tokenizer.tk.to_str(), n_vocab=vocab, eos_token=eos)
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

    def start(schema):
        m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options))
        mask = lnp.allocate_token_bitmask(1, vocab)
        return (lambda: lnp.fill_next_token_bitmask(m, mask, 0)), m.consume_token, mask
    return start


def _xgrammar(tokenizer, vocab: int, eos: int):
    import transformers
    import xgrammar as xgr

    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.tk, eos_token=tokenizer.eos_token)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab), max_threads=1)

    def start(schema):
        m = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False))
        mask = xgr.allocate_token_bitmask(1, vocab)
        return (lambda: m.fill_next_token_bitmask(mask, 0)), m.accept_token, mask.numpy()
    return start


def main(backend: str) -> None:
    from infire_jax.loaders.gguf import PlainGGUFReader, read_metadata
    from infire_jax.loaders.paths import default_model_path
    from infire_jax.loaders.tokenizer import tokenizer_from_gguf

    meta = read_metadata(PlainGGUFReader(default_model_path()))
    tokenizer, vocab = tokenizer_from_gguf(meta), len(meta["tokenizer.ggml.tokens"])
    eos = int(meta["tokenizer.ggml.eos_token_id"])
    start = {"llguidance": _llguidance, "xgrammar": _xgrammar}[backend](tokenizer, vocab, eos)
    for schema, doc in SCHEMAS:
        t0 = time.perf_counter()
        fill, accept, mask = start(schema)
        compile_ms = (time.perf_counter() - t0) * 1e3
        times = []
        for t in tokenizer.encode(json.dumps(doc), add_special_tokens=False) + [eos]:
            t0 = time.perf_counter()
            fill()
            times.append((time.perf_counter() - t0) * 1e6)
            assert (int(mask[0, t >> 5]) >> (t & 31)) & 1, f"token {t} masked out"
            assert accept(t), f"token {t} refused"
        print(json.dumps({"backend": backend, "vocab": vocab, "compile_ms": round(compile_ms, 1), "tokens": len(times),
                          "mask_us_mean": round(statistics.mean(times), 1),
                          "mask_us_median": round(statistics.median(times), 1), "mask_us_max": round(max(times), 1)}))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "llguidance")
