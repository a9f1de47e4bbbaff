"""What a chat template takes as a message's content (infire_jax/loaders/chat_content.py): vLLM's
`--chat-template-content-format`. A template that loops over a message's content gets the parts, as
transformers' apply_chat_template gives them; one that writes it as text gets the texts joined by
newlines, each image our marker, as vLLM's "string" format does."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel

from infire_jax.loaders.chat_content import PARTS, joined, template_content_format
from infire_jax.loaders.tokenizer import Tokenizer

LOOPS = ("{% for m in messages %}[{{ m['role'] }}]{% if m['content'] is string %}{{ m['content'] }}{% else %}"
         "{% for p in m['content'] %}{% if p['type'] == 'image' %}<img>{% else %}{{ p['text'] | trim }}{% endif %}"
         "{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
ALIASED = ("{% for message in messages %}{% set content = message.content %}{% if content is string %}"
           "{{ content }}{% else %}{% for c in content | selectattr('type', 'equalto', 'text') %}{{ c.text }}|"
           "{% endfor %}{% endif %}{% endfor %}")
TEXT = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
PARTS_MESSAGE = [{"type": "text", "text": "Look: "}, {"type": "image"}, {"type": "text", "text": "what is it?"}]


def _tokenizer(template: str, content_format: str = "auto") -> Tokenizer:
    return Tokenizer(HFTokenizer(WordLevel({"a": 0}, unk_token="a")), bos_token="<s>", eos_token="</s>",
                     chat_template=template, content_format=content_format)


@pytest.mark.parametrize("template,want", [(LOOPS, "openai"), (ALIASED, "openai"), (TEXT, "string"),
                                           ("{% for m in messages %}{{ m.content }}{% endfor %}", "string"),
                                           ("{% for x in messages[0]['content_x'] %}{% endfor %}", "string"),
                                           ("{% for broken", "string"), (None, "string")])
def test_detects_a_loop_over_a_messages_content(template, want):
    assert template_content_format(template) == want


def test_the_default_models_template_takes_text(smol_llm):
    assert smol_llm.engine.tokenizer.content_format == "string"


@pytest.mark.parametrize("template", [LOOPS, ALIASED])
def test_a_template_that_loops_renders_the_parts_as_transformers_does(template):
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast(tokenizer_object=HFTokenizer(WordLevel({"a": 0}, unk_token="a")),
                                        chat_template=template)
    theirs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PARTS_MESSAGE}]
    ours = [theirs[0], {"role": "user", "content": joined(PARTS_MESSAGE), PARTS: PARTS_MESSAGE}]
    want = reference.apply_chat_template(theirs, add_generation_prompt=True, tokenize=False)
    assert _tokenizer(template).apply_chat_template(ours) == want
    assert "<|image|>" not in want and "\n" not in want  # the template's own marker, its parts in a row


def test_string_content_joins_the_parts_with_newlines():
    """vLLM's "string" format, for a template that writes the content as text, or when the flag says so."""
    ours = [{"role": "user", "content": joined(PARTS_MESSAGE), PARTS: PARTS_MESSAGE}]
    assert _tokenizer(TEXT).apply_chat_template(ours) == "<user>Look: \n<|image|>\nwhat is it?"
    assert _tokenizer(LOOPS, "string").apply_chat_template(ours) == "[user]Look: \n<|image|>\nwhat is it?[assistant]"


def test_continuing_a_final_message_given_as_parts():
    parts = [{"type": "text", "text": "It is "}, {"type": "text", "text": "a cat"}]
    ours = [{"role": "user", "content": "?"}, {"role": "assistant", "content": joined(parts), PARTS: parts}]
    text = _tokenizer(LOOPS).apply_chat_template(ours, add_generation_prompt=False, continue_final_message=True)
    assert text == "[user]?[assistant]It isa cat"


def test_the_server_renders_parts_for_a_template_that_loops(smol_llm):
    """Over HTTP (vLLM's /tokenize chat form): the model's own template takes text (the parts joined by
    newlines); --chat-template-content-format openai, or a template that loops, takes the parts."""
    import json
    import urllib.request

    from server_utils import AppThread

    from server.app import build_app

    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    tk = smol_llm.engine.tokenizer
    for template, content_format, want in [
            (None, "auto", tk.apply_chat_template([{"role": "user", "content": "Hello\nthere"}])),
            (LOOPS, "auto", "[user]Hellothere[assistant]"), (TEXT, "openai", None)]:
        servers = AppThread()
        try:
            servers.run(servers.serve(build_app(smol_llm.engine, chat_template=template,
                                                content_format=content_format)))
            req = urllib.request.Request(servers.urls[0] + "/tokenize", json.dumps({"messages": messages}).encode(),
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                got = json.load(r)["tokens"]
        finally:
            servers.close()
        if want is None:  # a template writing `content` as text, given a list: the list's text, as vLLM would
            want = "<user>" + str([{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}])
        assert got == tk.encode(want, add_special_tokens=False), (template, content_format)
