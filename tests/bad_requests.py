"""Invalid OpenAI requests and the 4xx each must get: (path, changes to a valid base body, status, param)."""

from __future__ import annotations

from server_utils import MODEL

DROP = object()  # removes the field from the base body
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
BASE = {CMPL: {"model": MODEL, "prompt": "hi", "max_tokens": 4},
        CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}}
BAD_BODIES = [  # (path, changes to the base body, status, param)
    (CMPL, {"model": 7}, 400, "model"),  # none at all asks for the served model, as on vLLM (test_echo_logprobs)
    (CMPL, {"model": "gpt-4o"}, 404, "model"),
    (CMPL, {"prompt": DROP}, 400, "prompt"),
    (CMPL, {"temperature": "hot"}, 400, "temperature"),
    (CMPL, {"max_tokens": "10"}, 400, "max_tokens"),
    (CMPL, {"n": 1.5}, 400, "n"),
    (CMPL, {"stream": "yes"}, 400, "stream"),
    (CMPL, {"prompt": 5}, 400, "prompt"),
    (CMPL, {"prompt": []}, 400, "prompt"),
    (CMPL, {"prompt": [[1, "a"]]}, 400, "prompt"),
    (CMPL, {"prompt": ""}, 400, "prompt"),
    (CMPL, {"stop": 3}, 400, "stop"),
    (CMPL, {"stop": [str(i) for i in range(65)]}, 400, "stop"),
    (CMPL, {"logprobs": True}, 400, "logprobs"),
    (CMPL, {"foo": 1}, 400, "foo"),
    (CMPL, {"temperature": 3}, 400, "temperature"),
    (CMPL, {"top_p": 1.5}, 400, "top_p"),
    (CMPL, {"top_p": 0}, 400, "top_p"),
    (CMPL, {"n": 0}, 400, "n"),
    (CMPL, {"n": 129}, 400, "n"),
    (CMPL, {"max_tokens": 0}, 400, "max_tokens"),
    (CMPL, {"response_format": {"type": "xml"}}, 400, "response_format.type"),
    (CMPL, {"add_special_tokens": "yes"}, 400, "add_special_tokens"),
    (CMPL, {"spaces_between_special_tokens": 1}, 400, "spaces_between_special_tokens"),
    (CMPL, {"logprobs": 21}, 400, "logprobs"),
    (CMPL, {"presence_penalty": 5}, 400, "presence_penalty"),
    (CMPL, {"frequency_penalty": -2.5}, 400, "frequency_penalty"),
    (CMPL, {"top_k": -2}, 400, "top_k"),
    (CMPL, {"top_k": 2 ** 40}, 400, "top_k"),
    (CMPL, {"stop_token_ids": [2 ** 40]}, 400, "stop_token_ids"),
    (CMPL, {"min_p": 2}, 400, "min_p"),
    (CMPL, {"repetition_penalty": 0}, 400, "repetition_penalty"),
    (CMPL, {"seed": 2 ** 64}, 400, "seed"),
    (CMPL, {"priority": "high"}, 400, "priority"),
    (CMPL, {"prompt": [5] * 1100}, 400, "prompt"),  # longer than max_model_len
    (CMPL, {"max_tokens": 1030}, 400, "max_tokens"),  # prompt + max_tokens > max_model_len
    (CMPL, {"prompt": [10 ** 6]}, 400, "prompt"),  # outside the vocabulary
    (CMPL, {"prompt": [10 ** 6], "stream": True}, 400, "prompt"),  # admission fails before the stream starts
    (CMPL, {"temperature": -1, "stream": True}, 400, "temperature"),
    (CMPL, {"logit_bias": [50]}, 400, "logit_bias"),
    (CMPL, {"logit_bias": {"fifty": 5}}, 400, "logit_bias"),
    (CMPL, {"logit_bias": {"-5": 5}}, 400, "logit_bias"),
    (CMPL, {"logit_bias": {"50": "up"}}, 400, "logit_bias"),
    (CMPL, {"logit_bias": {"50": 101}}, 400, "logit_bias"),
    (CMPL, {"logit_bias": {"1000000": 1}}, 400, "logit_bias"),  # outside the vocabulary
    (CMPL, {"logit_bias": {str(t): 1 for t in range(301)}}, 400, "logit_bias"),
    (CHAT, {"logit_bias": {"50": -100.5}}, 400, "logit_bias"),
    (CMPL, {"allowed_token_ids": []}, 400, "allowed_token_ids"),
    (CMPL, {"allowed_token_ids": [5, "6"]}, 400, "allowed_token_ids"),
    (CMPL, {"allowed_token_ids": [5, 10 ** 6]}, 400, "allowed_token_ids"),  # outside the vocabulary
    (CMPL, {"suffix": "the end"}, 400, "suffix"),
    (CMPL, {"echo": True, "logprobs": 21}, 400, "logprobs"),
    (CMPL, {"echo": True, "max_tokens": -1}, 400, "max_tokens"),
    (CMPL, {"best_of": 3}, 400, "best_of"),
    (CMPL, {"stream_options": {"include_usage": True}}, 400, "stream_options"),
    (CMPL, {"stream": True, "stream_options": {"include_usage": "yes"}}, 400, "stream_options.include_usage"),
    (CMPL, {"stream": True, "stream_options": {"bogus": 1}}, 400, "stream_options.bogus"),
    (CMPL, {"stream": True, "stream_options": [1]}, 400, "stream_options"),
    (CHAT, {"messages": DROP}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].tool_call_id"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages[0].content[0]"),
    (CHAT, {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, 400, "messages[0].tool_calls"),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 1100}]}, 400, "messages"),
    (CHAT, {"top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    (CHAT, {"echo": "yes"}, 400, "echo"),
    (CHAT, {"tools": [{"type": "function", "function": {"description": "f"}}]}, 400, "tools[0].function.name"),
    (CHAT, {"response_format": {"type": "xml"}}, 400, "response_format.type"),
    (CHAT, {"max_completion_tokens": -1}, 400, "max_completion_tokens"),
    (CHAT, {"max_tokens": 2000}, 400, "max_tokens"),
    (CHAT, {"continue_final_message": True}, 400, "continue_final_message"),  # add_generation_prompt is true
    (CHAT, {"continue_final_message": True, "add_generation_prompt": False,
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]},
     400, "continue_final_message"),
    (CHAT, {"add_generation_prompt": "no"}, 400, "add_generation_prompt"),
    (CHAT, {"truncate_prompt_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]},
     400, "truncate_prompt_tokens"),
    (CMPL, {"truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    (CMPL, {"truncate_prompt_tokens": -2}, 400, "truncate_prompt_tokens"),
    (CMPL, {"truncate_prompt_tokens": 1100, "prompt": [5] * 1100}, 400, "prompt"),  # still longer than the model's
    (CMPL, {"return_tokens_as_token_ids": 1}, 400, "return_tokens_as_token_ids"),
    (CMPL, {"bad_words": "Berlin"}, 400, "bad_words"),
    (CHAT, {"bad_words": ["ok", " "]}, 400, "bad_words"),
    (CMPL, {"structured_outputs": {"json_object": "yes"}}, 400, "structured_outputs.json_object"),
    # OpenAI's fields with a value that would change something here (null or the default is accepted)
    (CHAT, {"service_tier": "flex"}, 400, "service_tier"),
    (CHAT, {"modalities": ["text", "audio"]}, 400, "modalities"),
    (CHAT, {"metadata": {"k": 1}}, 400, "metadata"),
    (CHAT, {"functions": [{"name": "f"}]}, 400, "functions"),
    (CHAT, {"messages": [{"role": "user", "content": "hi", "refusal": "no"}]}, 400, "messages[0].refusal"),
    (CHAT, {"messages": [{"role": "assistant", "content": "hi", "audio": {"id": "a1"}}]}, 400, "messages[0].audio"),
    # a lone UTF-16 surrogate (json.dumps escapes it): no character, and no tokenizer takes it
    (CHAT, {"bad_words": ["ok", "\ud800"]}, 400, "bad_words[1]"),
    (CMPL, {"prompt": "hi \udfff"}, 400, "prompt"),
    (CMPL, {"prompt": ["hi", "\ud800"]}, 400, "prompt[1]"),
    (CHAT, {"messages": [{"role": "user", "content": "x\ud83d"}]}, 400, "messages[0].content"),
]
