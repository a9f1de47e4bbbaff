"""The grammar backend (llguidance) on the default model's tokenizer, and the bitmask in the sampler (no model)."""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infire_jax.errors import InvalidRequestError
from infire_jax.sample.sampler import BRANCH_FREE_VARIANTS, BRANCHING, choose_variant, sample
from infire_jax.structured import StructuredOutputs
from infire_jax.structured.backend import GrammarBackend, GrammarCompileError
from test_sampling import V, make_inputs

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["a"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    from infire_jax.loaders.gguf import PlainGGUFReader, read_metadata
    from infire_jax.loaders.paths import default_model_path
    from infire_jax.loaders.tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(read_metadata(PlainGGUFReader(default_model_path())))


@pytest.fixture(scope="module")
def backend(tokenizer):
    b = GrammarBackend(tokenizer.tk.to_str(), 49152, (2,), timeout=10.0)
    yield b
    b.close()


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("spec,param", [
    (dict(json={"type": "bogus"}), "structured_outputs.json"),
    (dict(json={"type": "array", "uniqueItems": True}), "structured_outputs.json"),  # unsupported keyword
    (dict(regex="(abc"), "structured_outputs.regex"),
    (dict(grammar="start: missing_rule"), "structured_outputs.grammar"),
    (dict(json={"type": "string", "format": "no-such-format"}, param="response_format.json_schema.schema"),
     "response_format.json_schema.schema"),
])
def test_compile_errors_name_the_field(backend, spec, param):
    with pytest.raises(GrammarCompileError) as e:
        backend.compile(StructuredOutputs(**spec))
    assert e.value.param == param


@pytest.mark.parametrize("kwargs,param", [
    ({}, "structured_outputs"), (dict(regex="a", choice=["b"]), "structured_outputs"),
    (dict(json="{not json"), "structured_outputs.json"), (dict(choice=[]), "structured_outputs.choice"),
    (dict(regex=""), "structured_outputs.regex"), (dict(json=[1]), "structured_outputs.json"),
])
def test_spec_checks_shapes(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        StructuredOutputs(**kwargs)
    assert e.value.param == param


def test_cache_is_keyed_by_the_constraint(backend):
    a = backend.compile(StructuredOutputs(json=SCHEMA))
    b = backend.compile(StructuredOutputs(json=json.dumps(SCHEMA), param="response_format.json_schema.schema"))
    assert a is b
    assert backend.compile(StructuredOutputs(regex="x+")) is not a


def test_a_slow_compile_is_bounded_and_the_backend_keeps_working(tokenizer):
    slow = GrammarBackend(tokenizer.tk.to_str(), 49152, (2,), timeout=0.2)
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{3,9}x[0-9]{2,7}"}
                                            for i in range(6000)}}  # about 2 s to compile here
    start = time.monotonic()
    with pytest.raises(GrammarCompileError, match="did not compile within 0.2 s") as e:
        slow.compile(StructuredOutputs(json=big, param="response_format.json_schema.schema"))
    # bounded: well before the compile would end (1.14 s was seen on a loaded machine, two test workers)
    assert time.monotonic() - start < 1.5 and e.value.param == "response_format.json_schema.schema"
    assert slow.compile(StructuredOutputs(choice=["yes", "no"])) is not None  # the second thread serves it
    slow.close()


def test_matcher_accepts_rolls_back_and_terminates(backend, tokenizer):
    m = backend.compile(StructuredOutputs(json=SCHEMA)).matcher()
    toks = ids(tokenizer, '{"a": 7}')
    assert m.accept_tokens(toks[:2]) == 2
    m.rollback(2)
    assert m.accept_tokens(toks + ids(tokenizer, "x")) == len(toks)  # the prefix that fits
    assert m.is_terminated()
    # a fresh matcher of the same compiled grammar starts over; a wrong token is refused
    m2 = backend.compile(StructuredOutputs(json=SCHEMA)).matcher()
    assert not m2.is_terminated() and not m2.accept_token(ids(tokenizer, "x")[0])


def test_bitmask_marks_exactly_the_allowed_tokens(backend, tokenizer):
    m = backend.compile(StructuredOutputs(choice=["yes", "no"])).matcher()
    mask = np.full((2, backend.mask_words), -1, np.int32)
    m.fill_bitmask(mask, 1)
    bits = np.unpackbits(mask[1].view(np.uint8), bitorder="little")[:49152].astype(bool)
    allowed = set(np.flatnonzero(bits))
    assert ids(tokenizer, "yes")[0] in allowed and ids(tokenizer, "no")[0] in allowed
    assert ids(tokenizer, "maybe")[0] not in allowed and 0 < len(allowed) < 50
    assert (mask[0] == -1).all()  # other rows untouched


@pytest.mark.parametrize("mode", ["branching", "branch_free"])
def test_sampler_applies_the_mask_first_in_every_variant(mode):
    """Rows 0 and 2 are constrained (greedy; sampled with top-k and a penalty), rows 1 and 3 are not."""
    rows = [dict(), dict(temperature=0.9, seed=3), dict(temperature=0.9, top_k=5, rep=1.3, seed=4, logprobs=True),
            dict(temperature=1.0, top_p=0.5, logprobs=True)]
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(4, V)) * 3, jnp.float32)
    allowed = [5, 17, 40, 63]  # 63: the sign bit of its word
    words = np.zeros(-(-V // 32), np.uint32)
    for t in allowed:
        words[t // 32] |= np.uint32(1 << (t % 32))
    mask = np.full((4, len(words)), -1, np.int32)
    mask[[0, 2]] = words.view(np.int32)
    inputs = make_inputs(rows)
    tables = (jnp.zeros((5, V), jnp.int32), jnp.zeros((5, V), bool), jnp.arange(4, dtype=jnp.int32))
    variant = BRANCHING if mode == "branching" else choose_variant(jax.device_get(inputs), BRANCH_FREE_VARIANTS)
    run = jax.jit(sample, static_argnums=5)
    raw = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    for step in range(6):
        inputs = inputs._replace(step=jnp.full(4, step, jnp.int32))
        plain = run(logits, inputs, *tables, variant, jnp.full_like(mask, -1))
        masked = run(logits, inputs, *tables, variant, jnp.asarray(mask))
        assert int(masked.tokens[0]) in allowed and int(masked.tokens[2]) in allowed
        np.testing.assert_array_equal(np.asarray(masked.tokens)[[1, 3]], np.asarray(plain.tokens)[[1, 3]])
        # logprobs are of the model's raw distribution, as vLLM reports them
        np.testing.assert_allclose(masked.logprob[2], raw[2, int(masked.tokens[2])], rtol=1e-5)
    assert int(masked.tokens[0]) == allowed[int(np.argmax(np.asarray(logits)[0, allowed]))]  # greedy among allowed


def _accepts(backend, tokenizer, spec: StructuredOutputs, text: str) -> tuple[bool, bool]:
    """(whether the grammar takes every token of `text`, whether it is then complete)."""
    m = backend.compile(spec).matcher()
    toks = ids(tokenizer, text)
    return m.accept_tokens(toks) == len(toks), m.is_terminated()


@pytest.mark.parametrize("answer", [dict(json=SCHEMA), dict(grammar='start: "{\\"a\\": " /[0-9]/ "}"'),
                                    dict(regex=r'\{"a": [0-9]\}'), dict(choice=['{"a": 1}', '{"a": 3}', '{"a": 7}'])])
def test_an_answer_constraint_starts_where_the_reasoning_ends(backend, tokenizer, answer):
    """`after` (a reasoning parser's grammar) lets free reasoning through, JSON-looking text included,
    up to the close marker; the answer's constraint holds from the next token on."""
    from infire_jax.structured.reasoning_parsers import reasoning_grammar

    r1 = StructuredOutputs(**answer, after=reasoning_grammar("deepseek_r1"))
    assert _accepts(backend, tokenizer, r1, 'Hmm. {"a": 12} is wrong</think>{"a": 7}') == (True, True)
    assert _accepts(backend, tokenizer, r1, "<think>\nfirst {\n</think>") == (True, False)
    assert _accepts(backend, tokenizer, r1, '{"a": 7}') == (True, False)  # still reasoning
    assert not _accepts(backend, tokenizer, r1, "ok</think>sure")[0]  # the answer is constrained
    assert not _accepts(backend, tokenizer, r1, 'ok</think>{"a": 7}</think>')[0]  # one block only
    m = backend.compile(r1).matcher()  # while reasoning, (nearly) the whole vocabulary is open
    mask = np.zeros((1, backend.mask_words), np.int32)
    m.fill_bitmask(mask, 0)
    assert np.unpackbits(mask[0].view(np.uint8)).sum() > 45_000

    qwen3 = StructuredOutputs(**answer, after=reasoning_grammar("qwen3"))  # the block is optional
    assert _accepts(backend, tokenizer, qwen3, '{"a": 7}') == (True, True)
    assert _accepts(backend, tokenizer, qwen3, '\n<think>\nso {</think>{"a": 3}') == (True, True)
    assert not _accepts(backend, tokenizer, qwen3, "Sure")[0]
    kimi = StructuredOutputs(**answer, after=reasoning_grammar("kimi_k2"))
    assert _accepts(backend, tokenizer, kimi, '◁think▷ok◁/think▷{"a": 1}') == (True, True)
    assert _accepts(backend, tokenizer, kimi, '<think>ok</think>{"a": 1}') == (True, True)
    assert _accepts(backend, tokenizer, kimi, '◁think▷ok</think>{"a": 1}') == (True, False)  # its own closer

    assert reasoning_grammar("qwen3", {"enable_thinking": False}) is None  # no reasoning: constrained at once
    assert reasoning_grammar("deepseek_v3") is None and reasoning_grammar("deepseek_v3", {"thinking": True})
    assert backend.compile(r1) is not backend.compile(StructuredOutputs(**answer))  # keyed apart


def test_forced_qwen3_coder_calls_are_typed_by_the_schema(backend, tokenizer):
    """A forced qwen3_coder call: the parameters in the schema's order (the optional ones may be left
    out), a string as raw text within its bounds that ends at the first </parameter>, an enum as one
    of its values, anything else as JSON of its schema; the format's parser reads it back typed."""
    from infire_jax.structured import parse_tool_calls
    from infire_jax.structured.tool_grammar import tool_call_constraint

    fn = {"name": "get_weather", "parameters": {"type": "object", "required": ["city", "unit"], "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1}, "code": {"type": "string", "pattern": "^[A-Z]{2}$"},
        "opts": {"type": "object", "properties": {"hourly": {"type": "boolean"}}, "required": ["hourly"]}}}}
    spec = tool_call_constraint("qwen3_coder", [fn], parallel=False)

    def call(**params) -> str:
        body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
        return f"<tool_call>\n<function=get_weather>\n{body}</function>\n</tool_call>"

    whole = call(city="Paris, <b>FR</b>", unit="celsius", days=3, code="FR", opts='{"hourly": true}')
    assert _accepts(backend, tokenizer, spec, whole) == (True, True)
    _, (got,) = parse_tool_calls(whole, "qwen3_coder", tools=[{"type": "function", "function": fn}])
    assert json.loads(got.arguments) == {"city": "Paris, <b>FR</b>", "unit": "celsius", "days": 3, "code": "FR",
                                         "opts": {"hourly": True}}
    assert _accepts(backend, tokenizer, spec, call(city="Oslo", unit="fahrenheit")) == (True, True)
    for wrong in (call(city="Paris", unit="kelvin"), call(city="x" * 21, unit="celsius"),
                  call(city="Paris", unit="celsius", days="three"), call(city="Paris", unit="celsius", days=0),
                  call(city="Paris", unit="celsius", code="France"), call(unit="celsius", city="Paris"),
                  call(city="Paris"), call(city="Paris", unit="celsius", opts="{}")):
        assert not _accepts(backend, tokenizer, spec, wrong)[0], wrong
    two = tool_call_constraint("qwen3_coder", [fn], parallel=True)
    assert _accepts(backend, tokenizer, two, whole + "\n" + call(city="Rome", unit="celsius"))[0]


@pytest.mark.parametrize("special", [False, True], ids=["text-markers", "special-token-markers"])
def test_forced_glm45_calls_are_typed_by_the_schema(backend, tokenizer, special):
    """A forced glm45 call, its markers as text or (where the tokenizer has them so, as GLM's does) as
    special tokens: SmolLM2 has none of GLM's, so six of its special tokens stand in for them. The
    parameters in the schema's order (the optional ones may be left out), a string as raw text within
    its bounds ending at the first </arg_value>, an enum as one of its values, anything else as JSON
    of its schema; the format's parser reads it back typed."""
    import re

    from infire_jax.structured import parse_tool_calls
    from infire_jax.structured.tool_formats.glm45_grammar import MARKERS
    from infire_jax.structured.tool_grammar import tool_call_constraint

    fn = {"name": "get_weather", "parameters": {"type": "object", "required": ["city", "unit"], "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1}, "code": {"type": "string", "pattern": "^[A-Z]{2}$"},
        "opts": {"type": "object", "properties": {"hourly": {"type": "boolean"}}, "required": ["hourly"]}}}}
    marks = dict(zip(MARKERS, range(3, 9))) if special else {}
    assert all(tokenizer.special_token_id(tokenizer.tk.id_to_token(i)) == i for i in marks.values())
    spec = tool_call_constraint("glm45", [fn], parallel=False, special_token_ids=marks)

    def call(**params) -> str:
        body = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in params.items())
        return f"<tool_call>get_weather\n{body}</tool_call>"

    def accepts(s: StructuredOutputs, text: str) -> tuple[bool, bool]:
        pieces = re.split("(" + "|".join(map(re.escape, marks)) + ")", text) if marks else [text]
        toks = [t for p in pieces if p for t in ([marks[p]] if p in marks else ids(tokenizer, p))]
        m = backend.compile(s).matcher()
        return m.accept_tokens(toks) == len(toks), m.is_terminated()

    whole = call(city="Paris, <b>FR</b>", unit="celsius", days=3, code="FR", opts='{"hourly": true}')
    assert accepts(spec, whole) == (True, True)
    _, (got,) = parse_tool_calls(whole, "glm45", tools=[{"type": "function", "function": fn}])
    assert json.loads(got.arguments) == {"city": "Paris, <b>FR</b>", "unit": "celsius", "days": 3, "code": "FR",
                                         "opts": {"hourly": True}}
    assert accepts(spec, call(city="Oslo", unit="fahrenheit")) == (True, True)
    for wrong in (call(city="Paris", unit="kelvin"), call(city="x" * 21, unit="celsius"),
                  call(city="Paris", unit="celsius", days="three"), call(city="Paris", unit="celsius", days=0),
                  call(city="Paris", unit="celsius", code="France"), call(unit="celsius", city="Paris"),
                  call(city="Paris"), call(city="Paris", unit="celsius", opts="{}")):
        assert not accepts(spec, wrong)[0], wrong
    two = tool_call_constraint("glm45", [fn], parallel=True, special_token_ids=marks)
    assert accepts(two, whole + "\n" + call(city="Rome", unit="celsius"))[0]


def gemma_value(v) -> str:
    """A value as Gemma 4's chat template writes an argument (format_argument: keys bare, in dictsort
    order; strings between <|"|>)."""
    if isinstance(v, str):
        return f'<|"|>{v}<|"|>'
    if isinstance(v, bool) or v is None:
        return json.dumps(v)
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{gemma_value(v[k])}" for k in sorted(v, key=str.lower)) + "}"
    if isinstance(v, list):
        return "[" + ",".join(gemma_value(x) for x in v) + "]"
    return json.dumps(v)


def gemma_call(name: str, args: dict) -> str:
    return f"<|tool_call>call:{name}{gemma_value(args)}<tool_call|>"


@pytest.mark.parametrize("special", [False, True], ids=["text-markers", "special-token-markers"])
def test_forced_gemma4_calls_are_typed_by_the_schema(backend, tokenizer, special):
    """A forced gemma4 call, its markers and string delimiter as text or (as in Gemma 4's tokenizer)
    as special tokens: SmolLM2 has none of Gemma's, so three of its special tokens stand in. The
    arguments as the template writes them (sorted by name, the optional ones may be left out), strings
    between delimiters within their bounds, numbers, booleans and null bare, objects and arrays of their
    schemas, an enum as one of its values; the format's parser reads it back typed."""
    import re

    from infire_jax.structured import parse_tool_calls
    from infire_jax.structured.tool_formats.gemma4_grammar import MARKERS
    from infire_jax.structured.tool_grammar import tool_call_constraint

    fn = {"name": "get_weather", "parameters": {"type": "object", "required": ["city", "unit"], "properties": {
        "unit": {"enum": ["celsius", "fahrenheit"]}, "city": {"type": "string", "maxLength": 20},
        "days": {"type": "integer", "minimum": 1}, "code": {"type": "string", "pattern": "^[A-Z]{2}$"},
        "opts": {"type": "object", "properties": {"hourly": {"type": "boolean"}, "tags": {
            "type": "array", "items": {"type": "string"}, "minItems": 1}}, "required": ["hourly"]},
        "limit": {"type": ["number", "null"]}, "Zone": {"type": "string"}}}}
    marks = dict(zip(MARKERS, (3, 4, 5))) if special else {}
    assert all(tokenizer.special_token_id(tokenizer.tk.id_to_token(i)) == i for i in marks.values())
    spec = tool_call_constraint("gemma4", [fn], parallel=False, special_token_ids=marks)

    def accepts(s: StructuredOutputs, text: str) -> tuple[bool, bool]:
        pieces = re.split("(" + "|".join(map(re.escape, marks)) + ")", text) if marks else [text]
        toks = [t for p in pieces if p for t in ([marks[p]] if p in marks else ids(tokenizer, p))]
        m = backend.compile(s).matcher()
        return m.accept_tokens(toks) == len(toks), m.is_terminated()

    args = {"city": "Paris, {FR}: [x]", "unit": "celsius", "days": 3, "code": "FR", "limit": 2.5, "Zone": "CET",
            "opts": {"hourly": True, "tags": ["a", "b,c"]}}
    whole = gemma_call("get_weather", args)
    assert whole.index("city:") < whole.index("code:") < whole.index("Zone:")  # the template's order
    assert accepts(spec, whole) == (True, True)
    _, (got,) = parse_tool_calls(whole, "gemma4")
    assert json.loads(got.arguments) == args
    for ok in ({"city": "Oslo", "unit": "fahrenheit"}, {"city": "", "unit": "celsius", "limit": None},
               {"city": "x", "unit": "celsius", "opts": {"hourly": False}}):
        assert accepts(spec, gemma_call("get_weather", ok)) == (True, True), ok
    unsorted = whole.replace("city:", "@").replace("code:", "city:").replace("@", "code:")
    for wrong in (gemma_call("get_weather", {"city": "Paris", "unit": "kelvin"}),
                  gemma_call("get_weather", {"city": "x" * 21, "unit": "celsius"}),
                  gemma_call("get_weather", {"city": "Paris", "unit": "celsius", "days": "three"}),
                  gemma_call("get_weather", {"city": "Paris", "unit": "celsius", "days": 0}),
                  gemma_call("get_weather", {"city": "Paris", "unit": "celsius", "code": "France"}),
                  gemma_call("get_weather", {"city": 7, "unit": "celsius"}),
                  gemma_call("get_weather", {"city": "Paris"}),
                  gemma_call("get_weather", {"city": "Paris", "unit": "celsius", "opts": {}}),
                  gemma_call("get_weather", {"city": "Paris", "unit": "celsius", "opts": {"hourly": 1}}),
                  gemma_call("get_weather", {"city": "Paris", "unit": "celsius", "opts": {"hourly": True, "tags": []}}),
                  gemma_call("get_weather", {"city": "Paris", "unit": "celsius", "extra": 1}),
                  gemma_call("get_time", {}), unsorted,
                  whole.replace('<|"|>Paris', '"Paris').replace('[x]<|"|>', '[x]"'),  # JSON's quotes
                  "Sure. " + whole):
        assert not accepts(spec, wrong)[0], wrong
    two = tool_call_constraint("gemma4", [fn, {"name": "get_time"}], parallel=True, special_token_ids=marks)
    both = whole + gemma_call("get_time", {})
    assert accepts(two, both)[0]  # (more calls may follow)
    assert [c.name for c in parse_tool_calls(both, "gemma4")[1]] == ["get_weather", "get_time"]
    assert not accepts(spec, both)[0]  # one call unless parallel


@pytest.mark.parametrize("special", [False, True], ids=["text-markers", "special-token-markers"])
def test_forced_minimax_m2_calls_are_one_block_of_typed_invokes(backend, tokenizer, special):
    """A forced minimax_m2 block, its markers as text or as special tokens (two of SmolLM2's stand in):
    one `<invoke>` (or, parallel, several) of the given functions, the parameters in the schema's order,
    each typed as the format's parser reads it back."""
    import re

    from infire_jax.structured import parse_tool_calls
    from infire_jax.structured.tool_formats.minimax_m2_grammar import MARKERS
    from infire_jax.structured.tool_grammar import tool_call_constraint

    fn = {"name": "get_weather", "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "maxLength": 20}, "days": {"type": "integer", "minimum": 1},
        "unit": {"enum": ["celsius", "fahrenheit"]}}}}
    marks = dict(zip(MARKERS, (3, 4))) if special else {}
    tools = [fn, {"name": "get_time"}]

    def block(*invokes: str) -> str:
        return "<minimax:tool_call>\n" + "\n".join(invokes) + "\n</minimax:tool_call>"

    def weather(**params) -> str:
        body = "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in params.items())
        return f'<invoke name="get_weather">\n{body}</invoke>'

    def accepts(parallel: bool, text: str) -> tuple[bool, bool]:
        spec = tool_call_constraint("minimax_m2", tools, parallel=parallel, special_token_ids=marks)
        pieces = re.split("(" + "|".join(map(re.escape, marks)) + ")", text) if marks else [text]
        toks = [t for p in pieces if p for t in ([marks[p]] if p in marks else ids(tokenizer, p))]
        m = backend.compile(spec).matcher()
        return m.accept_tokens(toks) == len(toks), m.is_terminated()

    whole = block(weather(city="Paris <FR>", days=3, unit="celsius"))
    assert accepts(False, whole) == (True, True)
    _, (got,) = parse_tool_calls(whole, "minimax_m2", tools=[{"type": "function", "function": fn}])
    assert json.loads(got.arguments) == {"city": "Paris <FR>", "days": 3, "unit": "celsius"}
    two = block(weather(city="Oslo"), '<invoke name="get_time">\n</invoke>')
    assert accepts(True, two) == (True, True) and not accepts(False, two)[0]
    for wrong in (block(weather(days=3)), block(weather(city="Paris", days=0)), block(weather(city="x" * 21)),
                  block(weather(city="Paris", unit="kelvin")), block('<invoke name="other">\n</invoke>')):
        assert not accepts(True, wrong)[0], wrong


@pytest.mark.parametrize("fmt,special", [("qwen3_coder", False), ("glm45", False), ("glm45", True)],
                         ids=["qwen3_coder", "glm45", "glm45-special-token-markers"])
def test_raw_text_formats_type_a_union_by_the_branch_its_value_satisfies(backend, tokenizer, fmt, special):
    """A parameter that may be a string or something else, in the raw-text formats: the grammar takes
    either a string within the string branch's bounds or JSON of the other branches, and the parser
    keeps a non-string reading only where it satisfies its branch. For an integer of at least 10 or a
    string of at most 2, `5` is the string "5" and `100` the integer; `abc` fits neither."""
    import re

    from infire_jax.structured import parse_tool_calls
    from infire_jax.structured.tool_formats.glm45_grammar import MARKERS
    from infire_jax.structured.tool_grammar import tool_call_constraint

    fn = {"name": "f", "parameters": {"type": "object", "required": ["x", "y"], "properties": {
        "x": {"anyOf": [{"type": "integer", "minimum": 10}, {"type": "string", "maxLength": 2}]},
        "y": {"type": ["string", "number"], "maxLength": 1, "maximum": 5}}}}
    marks = dict(zip(MARKERS, range(3, 9))) if special else {}
    spec = tool_call_constraint(fmt, [fn], parallel=False, special_token_ids=marks)

    def call(x: str, y: str) -> str:
        if fmt == "qwen3_coder":
            return f"<tool_call>\n<function=f>\n<parameter=x>\n{x}\n</parameter>\n<parameter=y>\n{y}\n" \
                   "</parameter>\n</function>\n</tool_call>"
        return f"<tool_call>f\n<arg_key>x</arg_key>\n<arg_value>{x}</arg_value>\n<arg_key>y</arg_key>\n" \
               f"<arg_value>{y}</arg_value>\n</tool_call>"

    def accepts(text: str) -> tuple[bool, bool]:
        pieces = re.split("(" + "|".join(map(re.escape, marks)) + ")", text) if marks else [text]
        toks = [t for p in pieces if p for t in ([marks[p]] if p in marks else ids(tokenizer, p))]
        m = backend.compile(spec).matcher()
        return m.accept_tokens(toks) == len(toks), m.is_terminated()

    tools = [{"type": "function", "function": fn}]
    for x, y, want in (("5", "7", {"x": "5", "y": "7"}), ("100", "4.5", {"x": 100, "y": 4.5}),
                       ("12", "3", {"x": 12, "y": 3}), ("ab", "z", {"x": "ab", "y": "z"})):
        assert accepts(call(x, y)) == (True, True), (x, y)
        _, (got,) = parse_tool_calls(call(x, y), fmt, tools=tools)
        assert json.loads(got.arguments) == want
    for x, y in (("abc", "1"), ("5", "10"), ("9.5", "1")):
        assert not accepts(call(x, y))[0], (x, y)


@pytest.mark.parametrize("fmt", ["pythonic", "llama4_pythonic"])
def test_forced_pythonic_calls_are_python_literals_of_the_schema(backend, tokenizer, fmt):
    """A forced pythonic call: keyword arguments in the schema's order (the optional ones may be left
    out), each a Python literal of its schema (quoted strings within their bounds, True/False/None,
    lists and dicts of the declared items and properties, any literal where the schema says nothing);
    the format's parser reads it back as JSON arguments that fit the schema."""
    import jsonschema

    from infire_jax.structured import parse_tool_calls
    from infire_jax.structured.tool_grammar import tool_call_constraint

    params = {"type": "object", "required": ["city", "unit"], "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1}, "code": {"type": "string", "pattern": "^[A-Z]{2}$"},
        "opts": {"type": "object", "required": ["hourly"], "properties": {
            "hourly": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string"}}}},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "extra": {}}}
    spec = tool_call_constraint(fmt, [{"name": "get_weather", "parameters": params}, {"name": "noop"}], parallel=True)
    whole = ("[get_weather(city='Paris', unit='celsius', days=3, code='FR', opts={'hourly': True, 'tags': ['a']}, "
             "note=None, extra=[1.5, {'k': 'v'}]), noop()]")
    assert _accepts(backend, tokenizer, spec, whole) == (True, True)
    _, calls = parse_tool_calls(whole, fmt)
    assert [c.name for c in calls] == ["get_weather", "noop"]
    jsonschema.validate(args := json.loads(calls[0].arguments), params)
    assert args["opts"] == {"hourly": True, "tags": ["a"]} and args["extra"] == [1.5, {"k": "v"}]
    assert _accepts(backend, tokenizer, spec, "[get_weather(city='Oslo', unit='fahrenheit')]") == (True, True)
    for wrong in ("[get_weather(city='Paris', unit='kelvin')]", "[get_weather(unit='celsius', city='Paris')]",
                  "[get_weather(city='Paris')]", f"[get_weather(city='{'x' * 21}', unit='celsius')]",
                  "[get_weather(city='Paris', unit='celsius', days=0)]",
                  "[get_weather(city='Paris', unit='celsius', days=true)]",
                  "[get_weather(city='Paris', unit='celsius', code='France')]",
                  "[get_weather(city='Paris', unit='celsius', opts={'tags': []})]", "[other()]"):
        assert not _accepts(backend, tokenizer, spec, wrong)[0], wrong
    # item counts, a Pydantic v1 allOf, and only the escapes Python reads
    bounded = {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
        "loc": {"allOf": [{"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}],
                "description": "where"}, "path": {"type": "string"}}}
    spec = tool_call_constraint(fmt, [{"name": "f", "parameters": bounded}], parallel=False)
    for text, ok in (("[f(tags=[1])]", True), ("[f(tags=[1, 2, 3])]", True), ("[f(tags=[])]", False),
                     ("[f(tags=[1, 2, 3, 4])]", False), ("[f(loc={'city': 'Rome'})]", True), ("[f(loc='Rome')]", False),
                     ("[f(loc={})]", False), ("[f(path='C:\\\\x\\t\\u00e9')]", True), ("[f(path='C:\\Users')]", False),
                     ("[f(path='\\x4')]", False), ("[f(path='\\N{DASH}')]", False)):
        assert _accepts(backend, tokenizer, spec, text) == (ok, ok), text
        if ok:
            jsonschema.validate(json.loads(parse_tool_calls(text, fmt)[1][0].arguments), bounded)


def test_reasoning_markers_that_are_special_tokens_are_those_tokens(backend, tokenizer):
    """Where a parser's markers are special tokens of the tokenizer, the grammar writes them as those
    tokens: the text spelling a marker out does not end the reasoning. (SmolLM2 has no think tokens:
    two of its special tokens stand in for them; not its end of text, which ends a grammar's run.)"""
    from infire_jax.structured.reasoning_parsers import reasoning_grammar

    start, end = tokenizer.special_token_id("<jupyter_start>"), tokenizer.special_token_id("<jupyter_output>")
    assert start is not None and end is not None and tokenizer.special_token_id("<think>") is None
    assert tokenizer.special_token_id("Hello") is None  # an ordinary token is not special

    def takes(spec: StructuredOutputs, toks: list[int]) -> tuple[bool, bool]:
        m = backend.compile(spec).matcher()
        return m.accept_tokens(toks) == len(toks), m.is_terminated()

    answer = ids(tokenizer, '{"a": 7}')
    r1 = StructuredOutputs(json=SCHEMA, after=reasoning_grammar("deepseek_r1", None, {"</think>": end}))
    assert takes(r1, ids(tokenizer, "So </think> is text here.") + [end] + answer) == (True, True)
    assert takes(r1, ids(tokenizer, 'x</think>{"a": 7}')) == (True, False)  # spelled out: still thinking
    qwen3 = StructuredOutputs(json=SCHEMA, after=reasoning_grammar("qwen3", None, {"<think>": start, "</think>": end}))
    assert takes(qwen3, [start] + ids(tokenizer, "hmm") + [end] + answer) == (True, True)
    assert takes(qwen3, ids(tokenizer, "\n") + [start, end] + answer) == (True, True)
    assert takes(qwen3, answer) == (True, True)
    assert not takes(qwen3, ids(tokenizer, "<think>hmm</think>") + answer)[0]  # the opener is the token


# A Pydantic model as a parameter: `{"$ref": "#/$defs/..."}`, the definitions at the parameters' root.
PYDANTIC = {"type": "object", "required": ["loc"], "properties": {"loc": {"$ref": "#/$defs/Loc"}},
            "$defs": {"Loc": {"type": "object", "required": ["city"], "additionalProperties": False,
                              "properties": {"city": {"type": "string"}}}}}
TREE = {"type": "object", "required": ["root"], "properties": {"root": {"$ref": "#/$defs/Node"}},
        "$defs": {"Node": {"type": "object", "required": ["v"], "additionalProperties": False, "properties": {
            "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}}}}}}
# (format, a call of f with these arguments written in it)
CALL_TEXT = {
    "hermes": lambda args: f'<tool_call>\n{{"name": "f", "arguments": {json.dumps(args)}}}\n</tool_call>',
    "llama3_json": lambda args: f'{{"name": "f", "parameters": {json.dumps(args)}}}',
    "mistral": lambda args: f'[TOOL_CALLS][{{"name": "f", "arguments": {json.dumps(args)}}}]',
    "qwen3_coder": lambda args: "<tool_call>\n<function=f>\n" + "".join(
        f"<parameter={k}>\n{json.dumps(v)}\n</parameter>\n" for k, v in args.items()) + "</function>\n</tool_call>",
    "pythonic": lambda args: "[f(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")]",
    "gemma4": lambda args: gemma_call("f", args),
}


@pytest.mark.parametrize("fmt", sorted(CALL_TEXT))
def test_forced_calls_follow_the_parameters_refs(backend, tokenizer, fmt):
    """A parameter typed by `$ref` (as Pydantic writes a model) holds wherever the forced grammar puts the
    schema: nested in the call's JSON (pointers relocated, recursion kept) or one parameter at a time
    (references inlined; a recursive schema is refused there by name)."""
    from infire_jax.structured import parse_tool_calls
    from infire_jax.structured.tool_grammar import tool_call_constraint

    other = {"name": "g", "parameters": {"type": "object", "properties": {}}}
    for functions in ([{"name": "f", "parameters": PYDANTIC}], [other, {"name": "f", "parameters": PYDANTIC}]):
        spec = tool_call_constraint(fmt, functions, parallel=False)
        good = CALL_TEXT[fmt]({"loc": {"city": "Paris"}})
        assert _accepts(backend, tokenizer, spec, good) == (True, True), good
        for wrong in ({"loc": "Paris"}, {"loc": {"town": "Paris"}}, {"loc": {"city": 3}}):
            assert not all(_accepts(backend, tokenizer, spec, CALL_TEXT[fmt](wrong))), wrong
        tools = [{"type": "function", "function": f} for f in functions]
        _, (call,) = parse_tool_calls(good, fmt, tools=tools)
        assert (call.name, json.loads(call.arguments)) == ("f", {"loc": {"city": "Paris"}})
    if fmt in ("qwen3_coder", "pythonic", "gemma4"):
        with pytest.raises(InvalidRequestError, match="'f' refer to themselves"):
            tool_call_constraint(fmt, [{"name": "f", "parameters": TREE}], parallel=False)
        return
    spec = tool_call_constraint(fmt, [other, {"name": "f", "parameters": TREE}], parallel=False)
    tree = {"root": {"v": 1, "kids": [{"v": 2, "kids": [{"v": 3}]}]}}
    assert _accepts(backend, tokenizer, spec, CALL_TEXT[fmt](tree)) == (True, True)
    assert not _accepts(backend, tokenizer, spec, CALL_TEXT[fmt]({"root": {"v": 1, "kids": [{"v": "x"}]}}))[0]


# Qwen2.5's and Qwen3's tokenizers add these whole and not special (a decode keeps their text).
QWEN_ADDED = ("<tool_call>", "</tool_call>", "<think>", "</think>")


@pytest.fixture(scope="module")
def qwen_like(tokenizer):
    """SmolLM2's tokenizer with Qwen's markers added as Qwen adds them, and a backend over it."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from infire_jax.loaders.tokenizer import Tokenizer

    tk = HFTokenizer.from_str(tokenizer.tk.to_str())
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_ADDED])
    tok = Tokenizer(tk, bos_token=None, eos_token="<|im_end|>", chat_template=None)
    b = GrammarBackend(tk.to_str(), tok.vocab_size, (2,), timeout=10.0)
    yield tok, b
    b.close()


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder"])
def test_forced_calls_name_markers_the_tokenizer_added_by_their_ids(qwen_like, fmt):
    """The model writes <tool_call> as the token its tokenizer added; llguidance never spells such a
    token out of its text, so the grammar must name it by id, special or not."""
    from infire_jax.structured import parse_tool_calls
    from infire_jax.structured.tool_grammar import MARKERS, tool_call_constraint

    tok, b = qwen_like
    marks = {m: tok.added_token_id(m) for m in MARKERS[fmt]}
    assert all(i is not None and tok.special_token_id(m) is None for m, i in marks.items())
    assert tok.added_token_id("Hello") is None  # an ordinary token was not added
    fn = {"name": "f", "parameters": {"type": "object", "required": ["city"],
                                      "properties": {"city": {"type": "string"}}}}
    text = CALL_TEXT["hermes"]({"city": "Paris"}) if fmt == "hermes" else \
        "<tool_call>\n<function=f>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    toks = tok.encode(text, add_special_tokens=False)
    assert marks["<tool_call>"] in toks  # the tokenizer writes the marker as its token
    for parallel in (False, True):
        m = b.compile(tool_call_constraint(fmt, [fn], parallel=parallel, special_token_ids=marks)).matcher()
        assert m.accept_tokens(toks) == len(toks) and (parallel or m.is_terminated()), (fmt, parallel)
    _, (call,) = parse_tool_calls(tok.decode(toks), fmt, tools=[{"type": "function", "function": fn}])
    assert json.loads(call.arguments) == {"city": "Paris"}


def test_reasoning_markers_the_tokenizer_added_are_those_tokens(qwen_like):
    """Qwen3's <think> is an added, not special, token: a constrained answer may still think first."""
    from infire_jax.structured.reasoning_parsers import reasoning_grammar

    tok, b = qwen_like
    ids = {m: tok.added_token_id(m) for m in ("<think>", "</think>")}
    spec = StructuredOutputs(json=SCHEMA, after=reasoning_grammar("qwen3", None, ids))
    toks = tok.encode('<think>\nhmm, a digit\n</think>{"a": 7}', add_special_tokens=False)
    assert ids["<think>"] in toks and ids["</think>"] in toks
    m = b.compile(spec).matcher()
    assert m.accept_tokens(toks) == len(toks) and m.is_terminated()


def test_a_forced_call_after_qwen3_reasoning_on_qwens_tokens(qwen_like):
    """The server's glue (server/endpoints.py): a required tool call on a Qwen3-style tokenizer with
    the qwen3 reasoning parser takes the model's think block and call as its tokenizer writes them."""
    import asyncio
    from types import SimpleNamespace

    from server.endpoints import _force_tool_calls, _reasoning
    from server.protocol import parse_chat

    tok, b = qwen_like
    m = SimpleNamespace(tokenizer=tok, reasoning_parser="qwen3", engine=SimpleNamespace(engine=SimpleNamespace(
        grammars=b)))
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}
    req = parse_chat({"model": "m", "messages": [{"role": "user", "content": "Hi"}], "tools": [tool],
                      "tool_choice": "required", "parallel_tool_calls": False})
    asyncio.run(_force_tool_calls(m, req, "hermes"))
    _reasoning(m, req)
    toks = tok.encode("<think>\nthe weather\n</think>" + CALL_TEXT["hermes"]({"city": "Paris"}),
                      add_special_tokens=False)
    matcher = b.compile(req.params.structured_outputs).matcher()
    assert matcher.accept_tokens(toks) == len(toks) and matcher.is_terminated()
    assert req.params.skip_special_tokens  # the markers are not special: a decode keeps them anyway


def test_vllms_structured_outputs_options(backend, tokenizer):
    """vLLM's StructuredOutputsParams options: disable_any_whitespace (',' and ':' alone),
    whitespace_pattern (the whitespace allowed between JSON tokens), disable_additional_properties
    (objects closed where their schema leaves them open, nested ones too); disable_fallback changes
    nothing here; structural_tag and ill-typed options are refused by name."""
    from server.errors import APIError
    from server.structured import guided, structured_outputs

    open_schema = {"type": "object", "properties": {"a": {"type": "integer"}, "o": {"type": "object", "properties": {
        "b": {"type": "integer"}}}}, "required": ["a"]}

    def takes(options: dict, text: str) -> bool:
        return _accepts(backend, tokenizer, structured_outputs({"json": open_schema, **options}), text) == (True, True)

    assert takes({}, '{"a": 1}') and not takes({}, '{"a":1}')  # the default layout: json.dumps's
    assert takes({"disable_any_whitespace": True}, '{"a":1}') and not takes({"disable_any_whitespace": True}, '{"a": 1}')
    spaced = {"whitespace_pattern": "[ ]{0,2}"}
    assert takes(spaced, '{"a":1}') and takes(spaced, '{ "a" :  1 }') and not takes(spaced, '{"a":\n1}')
    old_form = guided({"guided_json": open_schema, "guided_whitespace_pattern": "[ ]{0,2}"})  # vLLM's older field
    assert _accepts(backend, tokenizer, old_form, '{ "a" :  1 }') == (True, True)
    as_text = structured_outputs({"json": json.dumps(open_schema), "disable_additional_properties": True})
    assert not _accepts(backend, tokenizer, as_text, '{"a": 1, "z": 2}')[0]  # a schema's JSON text closed too
    assert takes({}, '{"a": 1, "z": 2}') and takes({}, '{"a": 1, "o": {"b": 2, "z": 3}}')
    closed = {"disable_additional_properties": True, "disable_fallback": True}
    assert takes(closed, '{"a": 1, "o": {"b": 2}}')
    assert not takes(closed, '{"a": 1, "z": 2}') and not takes(closed, '{"a": 1, "o": {"b": 2, "z": 3}}')
    for options, param in [({"structural_tag": "{}"}, "structural_tag"), ({"disable_fallback": 1}, "disable_fallback"),
                           ({"whitespace_pattern": ""}, "whitespace_pattern"),
                           ({"whitespace_pattern": " ", "disable_any_whitespace": True}, "whitespace_pattern")]:
        with pytest.raises(APIError) as e:
            structured_outputs({"json": open_schema, **options})
        assert e.value.param == f"structured_outputs.{param}", options


def test_a_forced_gemma4_call_after_gemma4_reasoning(backend, tokenizer):
    """With thinking on, a forced Gemma 4 call may follow a `<|channel>thought\\n…<channel|>` block
    (its markers special tokens: five of SmolLM2's stand in for the channel's and the call's), and the
    two parsers read the decoded text back as the reasoning and the call."""
    import dataclasses

    from infire_jax.structured import parse_reasoning, parse_tool_calls
    from infire_jax.structured.reasoning_parsers import reasoning_grammar
    from infire_jax.structured.tool_formats.gemma4_grammar import MARKERS
    from infire_jax.structured.tool_grammar import tool_call_constraint

    marks = dict(zip(MARKERS, (3, 4, 5)))
    channel = {"<|channel>": 6, "<channel|>": 7}
    fn = {"name": "f", "parameters": {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}}}
    forced = tool_call_constraint("gemma4", [fn], parallel=False, special_token_ids=marks)
    spec = dataclasses.replace(forced, after=reasoning_grammar("gemma4", {"enable_thinking": True}, channel))
    call = [3] + ids(tokenizer, "call:f{a:7}") + [4]
    thought = [6] + ids(tokenizer, "thought\nI need f, say {a:1}.") + [7]

    def takes(toks: list[int]) -> tuple[bool, bool]:
        m = backend.compile(spec).matcher()
        return m.accept_tokens(toks) == len(toks), m.is_terminated()

    assert takes(thought + call) == (True, True)
    assert takes(call) == (True, True)  # thinking is optional
    assert not takes(thought + ids(tokenizer, "It is 7."))[0]  # the answer is the call
    names = {i: t for t, i in {**marks, **channel}.items()}
    text = "".join(names.get(t) or tokenizer.decode([t]) for t in thought + call)
    reasoning, content = parse_reasoning(text, "gemma4", {"enable_thinking": True})
    _, (got,) = parse_tool_calls(content, "gemma4")
    assert (reasoning, got.name, json.loads(got.arguments)) == ("I need f, say {a:1}.", "f", {"a": 7})
