"""The chat templates of the tool-call formats render a parsed call and its result back into the next
prompt (infire_jax/structured/templates/, usable with `serve --chat-template`): Llama 4's pythonic
calls, DeepSeek V3's and Kimi K2's. A model's output in its own format is parsed into OpenAI tool calls
(parse_tool_calls), sent back as the client sends them (the assistant's `tool_calls`, then a `tool`
message), rendered through the server's path (tool_prompt.for_template, Tokenizer.apply_chat_template),
and the call the prompt shows parses back to the same call, its result in the format's place."""

from __future__ import annotations

import importlib.resources
import json
import re

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel

from infire_jax.loaders.tokenizer import Tokenizer
from infire_jax.structured import parse_tool_calls
from infire_jax.structured.tool_prompt import for_template, render_inputs

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                    "metric": {"type": "boolean"}, "hours": {"type": "array"}}}}}]
ARGS = {"city": "Paris", "days": 3, "metric": True, "hours": [9, 12], "note": None}
RESULT = "sunny, 21 C"
# (parser, a model's output in its format, the assistant turn's text in the rendered prompt, the result's)
CASES = {
    "kimi_k2": ("Let me look.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                f"<|tool_call_argument_begin|>{json.dumps(ARGS)}<|tool_call_end|><|tool_calls_section_end|>",
                r"<\|im_assistant\|>assistant<\|im_middle\|>(.*?)<\|im_end\|>",
                r"<\|im_system\|>tool<\|im_middle\|>## Return of functions\.get_weather:0\n(.*?)<\|im_end\|>"),
    "deepseek_v3": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                    f"{json.dumps(ARGS)}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
                    r"<｜Assistant｜>(.*?)<｜end▁of▁sentence｜>",
                    r"<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>(.*?)<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"),
    "llama4_pythonic": ("<|python_start|>[get_weather(city='Paris', days=3, metric=True, hours=[9, 12], note=None)]"
                        "<|python_end|>",
                        r"<\|header_start\|>assistant<\|header_end\|>\n\n(.*?)<\|eot\|>",
                        r"<\|header_start\|>ipython<\|header_end\|>\n\n(.*?)<\|eot\|>"),
}


def tokenizer(fmt: str) -> Tokenizer:
    template = importlib.resources.files("infire_jax.structured").joinpath(f"templates/{fmt}.jinja").read_text()
    return Tokenizer(HFTokenizer(WordLevel({"a": 0}, unk_token="a")), bos_token="<s>", eos_token="</s>",
                     chat_template=template)


@pytest.mark.parametrize("fmt", list(CASES))
def test_a_parsed_call_and_its_result_render_back_in_the_format(fmt):
    output, assistant_turn, result_turn = CASES[fmt]
    content, calls = parse_tool_calls(output, fmt)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", ARGS)]
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": content or None, "tool_calls": [c.to_openai() for c in calls]},
               {"role": "tool", "tool_call_id": calls[0].id, "content": RESULT}]
    tk = tokenizer(fmt)
    messages, extra = render_inputs(tk.chat_template, history, TOOLS)
    assert (messages, extra) == for_template(history, TOOLS)  # the template renders tools itself
    prompt = tk.apply_chat_template(messages, add_generation_prompt=True, **extra)

    turns = re.findall(assistant_turn, prompt, re.DOTALL)
    assert len(turns) == 1, prompt  # the earlier assistant turn; the generation prompt is left open
    again_content, again = parse_tool_calls(turns[0], fmt)
    assert [(c.name, json.loads(c.arguments)) for c in again] == [("get_weather", ARGS)], turns[0]
    assert again_content == content
    if fmt == "kimi_k2":
        assert again[0].id == calls[0].id == "functions.get_weather:0"
    assert re.findall(result_turn, prompt, re.DOTALL) == [RESULT]
    assert "Be brief." in prompt and '"get_weather"' in prompt  # the system prompt and the declared tools
    assert prompt.index("Weather in Paris?") < prompt.index(turns[0]) < prompt.index(RESULT)
