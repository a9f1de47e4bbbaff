"""Reasoning parsers on literal model-like outputs: whole, and streamed over many splits (no model)."""

from __future__ import annotations

import random

import pytest

from infire_jax.structured import REASONING_PARSERS, ReasoningStream, parse_reasoning, stream_reasoning

OFF = {"enable_thinking": False}
THINKING = {"thinking": True}

# (parser, chat_template_kwargs, output, reasoning, content)
CASES = [
    ("deepseek_r1", None, "<think>\nAdd them.\n</think>\n\nThe sum is 4.", "\nAdd them.\n", "\n\nThe sum is 4."),
    ("deepseek_r1", None, "Add them: 2+2.</think>4", "Add them: 2+2.", "4"),  # <think> was in the prompt
    ("deepseek_r1", None, "  <think>x < y</think>", "x < y", ""),
    ("deepseek_r1", None, "Still going, no end", "Still going, no end", ""),  # cut off while thinking
    ("deepseek_r1", None, "</think>Just 4.", "", "Just 4."),
    ("deepseek_r1", None, "", "", ""),
    ("minimax_m2", None, "Plan: call it.\n</think>\n\nCalling.", "Plan: call it.\n", "\n\nCalling."),
    ("minimax_m2", None, "<think>x</think>y", "x", "y"),
    ("qwen3", None, "<think>\nplan\n</think>\n\nanswer <think> stays", "\nplan\n", "\n\nanswer <think> stays"),
    ("qwen3", None, "\n<think>a</think>b", "a", "b"),
    ("qwen3", None, "No thinking here</think> at all", "", "No thinking here</think> at all"),
    ("qwen3", None, "I say <think>hi</think>", "", "I say <think>hi</think>"),  # only an opening block counts
    ("qwen3", None, "<think>cut off", "cut off", ""),
    ("qwen3", OFF, "<think>a</think>b", "", "<think>a</think>b"),
    ("qwen3", {"enable_thinking": True}, "<think>a</think>b", "a", "b"),
    ("glm45", None, "<think>look up</think>Paris.", "look up", "Paris."),
    ("glm45", OFF, "<think>look up</think>Paris.", "", "<think>look up</think>Paris."),
    ("glm45", None, "<thinking>is not a marker", "", "<thinking>is not a marker"),
    ("kimi_k2", None, "◁think▷plan it◁/think▷Here you go.", "plan it", "Here you go."),
    ("kimi_k2", None, "<think>plan it</think>Here you go.", "plan it", "Here you go."),
    ("kimi_k2", None, "◁think▷a</think>b◁/think▷c", "a</think>b", "c"),  # each opener has its own closer
    ("kimi_k2", None, "Hello◁/think▷", "", "Hello◁/think▷"),
    ("deepseek_v3", None, "Hmm.</think>Answer", "", "Hmm.</think>Answer"),
    ("deepseek_v3", THINKING, "Hmm.</think>Answer", "Hmm.", "Answer"),
    ("deepseek_v3", THINKING, "<think>Hmm.</think>Answer", "Hmm.", "Answer"),
    ("deepseek_v3", {"thinking": False}, "<think>Hmm.</think>Answer", "", "<think>Hmm.</think>Answer"),
    # Gemma 4: vLLM's tests/reasoning/test_gemma4_reasoning_parser.py outputs, "" where vLLM says None
    ("gemma4", None, "<|channel>thought\nActual reasoning here<channel|>Final answer", "Actual reasoning here",
     "Final answer"),
    ("gemma4", None, "<|channel>thought\nLine1\nLine2<channel|>Answer", "Line1\nLine2", "Answer"),
    ("gemma4", None, "<|channel>thought\n<channel|>", "", ""),
    ("gemma4", None, "<|channel>thousand reasons<channel|>Done", "thousand reasons", "Done"),  # not the label
    ("gemma4", None, "<|channel>This\nThat<channel|>This is the rest\nThat", "This\nThat", "This is the rest\nThat"),
    ("gemma4", None, "<|channel>This is a reasoning section", "This is a reasoning section", ""),
    ("gemma4", None, "This is content", "", "This is content"),
    ("gemma4", None, "<|tool_call>", "", "<|tool_call>"),  # a call is never reasoning
    ("gemma4", None, "", "", ""),
    # a call ends the reasoning, its marker staying for the tool parser; the label only where it begins
    ("gemma4", None, "<|channel>thought\nLook it up.<|tool_call>call:f{a:1}<tool_call|>", "Look it up.",
     "<|tool_call>call:f{a:1}<tool_call|>"),
    ("gemma4", None, "<|channel>thought\nthought\nx<channel|>y", "thought\nx", "y"),
    ("gemma4", None, "<|channel>thou", "thou", ""),
    ("gemma4", OFF, "<|channel>thought\nhmm<channel|>Hi", "hmm", "Hi"),  # read whatever was asked, as vLLM
    ("gemma4", None, "Hi <|channel>thought\nx<channel|>", "", "Hi <|channel>thought\nx<channel|>"),
]


def random_split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("parser,kwargs,text,reasoning,content", CASES)
def test_whole(parser, kwargs, text, reasoning, content):
    assert parse_reasoning(text, parser, kwargs) == (reasoning, content)


@pytest.mark.parametrize("parser,kwargs,text,reasoning,content", CASES)
def test_every_split_gives_the_same(parser, kwargs, text, reasoning, content):
    rng = random.Random(f"{parser}:{text}")
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    splits += [random_split(text, rng) for _ in range(100)]
    for deltas in splits:
        assert stream_reasoning(deltas, parser, kwargs) == (reasoning, content), deltas


def test_reasoning_streams_out_before_the_block_closes():
    s = ReasoningStream("qwen3")
    assert s.feed("<thi") == ("", "")  # may still be the open marker
    assert s.feed("nk>Let me see</th") == ("Let me see", "")  # `</th` may be the close: held
    assert s.feed("ink>\n\nIt is") == ("", "\n\nIt is")
    assert s.feed(" 4.") == ("", " 4.")
    assert s.finish() == ("", "")


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown reasoning parser 'r2'.*deepseek_r1.*qwen3"):
        ReasoningStream("r2")
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3", "kimi_k2", "glm45", "deepseek_v3", "minimax_m2",
                                      "gemma4"}


def test_random_marker_soup_splits_the_same_however_streamed():
    """Outputs made of pieces of every marker: never an exception, and the split never matters."""
    atoms = ["<think>", "</think>", "◁think▷", "◁/think▷", "<", "</", "<th", "◁", "▷", "think", "\n", " ",
             "x", "<|channel>", "<channel|>", "<|tool_call>", "thought\n", "thou", "<|"]
    rng = random.Random(7)
    for _ in range(300):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 10)))
        for parser in REASONING_PARSERS:
            for kwargs in (None, OFF, THINKING):
                whole = parse_reasoning(text, parser, kwargs)
                assert stream_reasoning(random_split(text, rng), parser, kwargs) == whole, (parser, kwargs, text)


def test_gemma4_reasoning_streams_out_once_the_label_is_told_apart():
    """Gemma 4's `thought\\n` label is held only while the text may still be it; a call's marker ends
    the reasoning and goes on as content."""
    s = ReasoningStream("gemma4")
    assert s.feed("<|chan") == ("", "")
    assert s.feed("nel>thou") == ("", "")  # may still be the label
    assert s.feed("ght\nPlan: look") == ("Plan: look", "")
    assert s.feed(" it up<|tool") == (" it up", "")  # may be a call's marker
    assert s.feed("_call>call:f{}") == ("", "<|tool_call>call:f{}")
    assert s.finish() == ("", "")


def test_gemma4_markers_and_grammar_follow_enable_thinking():
    """Its markers (special tokens of Gemma 4's tokenizer) are always kept in the text, as vLLM keeps
    them; a constrained answer may think first only when the request turned thinking on (Gemma 4's
    template writes an empty channel in the prompt otherwise)."""
    from infire_jax.structured.reasoning_parsers import reasoning_grammar, reasoning_markers

    assert reasoning_markers("gemma4") == ("<|channel>", "<channel|>", "<|tool_call>")
    assert reasoning_grammar("gemma4") is None and reasoning_grammar("gemma4", OFF) is None
    assert '"<|channel>"' in reasoning_grammar("gemma4", {"enable_thinking": True})
