"""The offline Python API: `LLM(...).generate(prompts, params)`, `.chat(messages, params)`,
`.beam_search(prompts, params)` and `.embed(prompts)` (runner="pooling")."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from PIL import Image

from infire_jax.engine.engine import Engine, EngineConfig
from infire_jax.errors import InvalidRequestError
from infire_jax.loaders import chat_content
from infire_jax.lora.request import LoRARequest
from infire_jax.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput, ScoringOutput,
                                ScoringRequestOutput)
from infire_jax.pooling.config import PoolingParams
from infire_jax.pooling.scoring import cosine_scores, pairs
from infire_jax.runner.image_pool import ImagePoolFull
from infire_jax.sample.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from infire_jax.sample.prompt_logprobs import Logprob
from infire_jax.sample.sampling_params import SamplingParams
from infire_jax.vision import preprocess
from infire_jax.vision import prompt as placeholders

# Text or token ids, or vLLM's dict form: {"prompt": text} or {"prompt_token_ids": ids}, with
# "multi_modal_data": {"image": a PIL image, encoded bytes, or a list of them} (one per <|image|>).
Prompt = str | list[int] | dict[str, Any]
Messages = list[dict[str, Any]]


def _number(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def _split(prompt: Prompt) -> tuple[str | list[int], list | None]:
    """(text or token ids, the images or None) of a prompt in any of its forms."""
    if isinstance(prompt, (list, tuple)):  # numpy's integers are token ids too
        return [int(t) if isinstance(t, np.integer) else t for t in prompt], None
    if not isinstance(prompt, dict):
        if not isinstance(prompt, str):
            raise InvalidRequestError(f"a prompt is a text, token ids or a prompt dict, got {prompt!r:.80}",
                                      param="prompt")
        return prompt, None
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"})
    if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise InvalidRequestError(f"a prompt dict has 'prompt' or 'prompt_token_ids', and may have "
                                  f"'multi_modal_data'; got {sorted(prompt)}", param="prompt")
    data = prompt.get("multi_modal_data")
    if data is not None and (not isinstance(data, dict) or set(data) - {"image"}):
        raise InvalidRequestError("multi_modal_data takes {'image': image or [images]}", param="multi_modal_data")
    images = None if data is None else data.get("image")
    if images is not None and not isinstance(images, (list, tuple)):
        images = [images]
    return prompt.get("prompt", prompt.get("prompt_token_ids")), images


class LLM:
    """Runs batches of prompts to completion on one engine.

    `model` is a .gguf file, an HF directory, `dummy:<name>`, or None for the embedded default.
    Other keyword arguments are `EngineConfig` fields (dtype, max_model_len, max_num_seqs, ...);
    `engine` wraps an engine that already exists instead.
    """

    def __init__(self, model: str | None = None, *, engine: Engine | None = None, **engine_args):
        self.engine = engine or Engine(EngineConfig(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generates for every prompt (text or token ids); returns outputs in prompt order.

        `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the base model);
        the engine needs `enable_lora=True`. `use_tqdm` is vLLM's: accepted, and no progress bar is drawn.
        No `sampling_params`: `get_default_sampling_params()`."""
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        return self._run(prompts, sampling_params, SamplingParams, lora_request)[0]

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams() with the model's generation config laid over it (temperature, top_p,
        top_k, min_p, repetition_penalty, max_new_tokens as max_tokens; sample/generation_config.py)."""
        return SamplingParams(**self.engine.sampling_defaults)

    def beam_search(self, prompts: Sequence[Prompt], params: BeamSearchParams, *,
                    lora_request: LoRARequest | None = None) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search` (infire_jax/sample/beam_search.py): each prompt's best
        `params.beam_width` sequences, best first, each with the prompt's tokens and the whole text."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise InvalidRequestError("no prompts given", param="prompt")
        ids = []
        for prompt in prompts:
            text, images = _split(prompt)
            if images:
                raise InvalidRequestError("beam search takes no images", param="multi_modal_data")
            ids.append(self.engine.tokenize_prompt(text))
            if len(ids[-1]) + params.max_tokens > self.engine.max_model_len:
                raise InvalidRequestError(f"a prompt of {len(ids[-1])} tokens and max_tokens={params.max_tokens} "
                                          f"exceed max_model_len={self.engine.max_model_len}",
                                          param="max_tokens")
        eos = self.tokenizer.token_to_id(self.tokenizer.eos_token) if self.tokenizer.eos_token else None
        search = BeamSearch(ids, params, eos)
        while not search.done:
            outs = self._run(search.step_prompts(), search.step_params(), SamplingParams, lora_request)[0]
            search.advance([{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs])
        results = search.results()
        for seq in (s for r in results for s in r.sequences):
            seq.text = self.tokenizer.decode(seq.tokens)
            text = self.engine.token_text  # each step's top 2 x beam_width, in rank order
            seq.logprobs = [{t: Logprob(lp, rank, text(t)) for rank, (t, lp) in enumerate(e.items(), 1)}
                            for e in seq.logprobs]
        return results

    def embed(self, prompts: Prompt | Sequence[Prompt],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *, use_tqdm: bool = True,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (vLLM's `LLM.embed`; `use_tqdm` accepted, no bar drawn), in prompt order;
        the engine needs runner="pooling"."""
        outputs, embeddings = self._run(prompts, pooling_params, PoolingParams, lora_request)
        return [EmbeddingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(embeddings[o.request_id]))
                for o in outputs]

    def score(self, data_1: str | list[str], data_2: str | list[str], *,
              lora_request: LoRARequest | None = None) -> list[ScoringRequestOutput]:
        """vLLM's `LLM.score` for an embedding model: each pair's cosine similarity (one `data_1` text
        against every `data_2` text, else one to one; infire_jax/pooling/scoring.py)."""
        first, second = ([d] if isinstance(d, str) else list(d) for d in (data_1, data_2))
        pairs(len(first), len(second))
        embedded = self.embed(first + second, lora_request=lora_request)
        vectors = [e.outputs.embedding for e in embedded]
        scores = cosine_scores(vectors[:len(first)], vectors[len(first):])
        return [ScoringRequestOutput(f"{embedded[i].request_id}_{embedded[len(first) + j].request_id}",
                                     embedded[i].prompt_token_ids + embedded[len(first) + j].prompt_token_ids,
                                     ScoringOutput(s))
                for (i, j), s in zip(pairs(len(first), len(second)), scores)]

    def _run(self, prompts, params, kind: type, lora_request) -> tuple[list[RequestOutput], dict[str, list[float]]]:
        """Runs every prompt to its end: the outputs in prompt order, and the embeddings by request id."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and _number(prompts[0])):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise InvalidRequestError(f"prompts must be a text, token ids, a prompt dict or a non-empty list of them, "
                                      f"got {prompts!r:.80}", param="prompt")
        prompts = list(prompts)
        if params is None or isinstance(params, kind):
            params_list = [params or kind()] * len(prompts)
        else:
            params_list = list(params) if isinstance(params, (list, tuple)) else [params]
            if not all(isinstance(p, kind) for p in params_list):
                raise InvalidRequestError(f"the parameters must be a {kind.__name__} or a list of them, got "
                                          f"{params!r:.80}", param="sampling_params")
            if len(params_list) != len(prompts):
                raise InvalidRequestError(f"{len(params_list)} {kind.__name__} for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise InvalidRequestError(f"{len(loras)} LoRA requests for {len(prompts)} prompts", param="lora_request")
        # Validate every prompt before queueing any, so a bad one leaves the engine untouched.
        split = [_split(p) for p in prompts]
        for prompt, images in split:
            if images is None:
                self.engine.tokenize_prompt(prompt)
        results: dict[str, RequestOutput] = {}
        tops: dict[str, int] = {}  # each request's logprobs alternatives
        embeddings: dict[str, list[float]] = {}
        order = []
        pending = list(zip(split, params_list, loras))
        try:
            while pending or self.engine.has_unfinished():
                while pending:  # in order; images wait for the image pool's rows that running ones free
                    (prompt, images), params, lora = pending[0]
                    try:
                        rid, ids = self.engine.add_request(prompt, params, lora_request=lora, images=images)
                    except ImagePoolFull:
                        if not self.engine.has_unfinished():
                            raise
                        break
                    pending.pop(0)
                    order.append(rid)
                    tops[rid] = (params.logprobs or 0) if isinstance(params, SamplingParams) else 0
                    results[rid] = RequestOutput(rid, prompt if isinstance(prompt, str) else None, ids,
                                                 [CompletionOutput(i) for i in range(params.n)])
                for d in self.engine.step():
                    out = results[d.request_id]
                    out.outputs[d.index].add(d, tops[d.request_id], self.engine.token_text)
                    out.num_cached_tokens = d.num_cached_tokens
                    if d.prompt_logprobs is not None and d.index == 0:
                        out.prompt_logprobs = d.prompt_logprobs
                    if d.embedding is not None:
                        embeddings[d.request_id] = d.embedding.tolist()
        except BaseException:
            for rid in order:
                self.engine.abort(rid)
            while self.engine.has_unfinished():
                self.engine.step()
            raise
        return [results[rid] for rid in order], embeddings

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Renders each conversation with the model's chat template, then generates (vLLM's `LLM.chat`;
        `use_tqdm` is accepted, and no progress bar is drawn). A message's content may be a list of
        parts: text ({"type": "text", "text": ...}) and images ({"type": "image", "image": a PIL image} or
        {"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}}), each image where it
        stands (vision/prompt.py). `continue_final_message`: the last message (the assistant's) is
        continued rather than a new one begun; `tools` and `chat_template_kwargs` go to the template."""
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError("continue_final_message continues the last message: it cannot be combined "
                                      "with add_generation_prompt", param="continue_final_message")
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise InvalidRequestError("messages must be a conversation (a list of {'role', 'content'} dicts) or a "
                                      "list of them", param="messages")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        template = {**(chat_template_kwargs or {}), **({"tools": tools} if tools is not None else {}),
                    "add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message}
        for conv in conversations:
            if not (isinstance(conv, Sequence) and conv and all(isinstance(m, dict) for m in conv)):
                raise InvalidRequestError("each conversation must be a non-empty list of {'role', 'content'} dicts",
                                          param="messages")
        return self.generate([self._chat_prompt(conv, template) for conv in conversations], sampling_params,
                             lora_request=lora_request)

    def reset_prefix_cache(self) -> bool:
        """Forgets the prefix cache, as vLLM's `LLM.reset_prefix_cache` (False while requests run)."""
        return self.engine.reset_prefix_cache()

    def _chat_prompt(self, conversation: Messages, template_kwargs: dict) -> Prompt:
        images: list = []
        flat = [_with_parts(m, _parts_of(m["content"], images)) if isinstance(m.get("content"), list) else m
                for m in conversation]
        tk = self.engine.tokenizer
        text = tk.apply_chat_template(flat, **template_kwargs)
        if not images:
            return tk.encode(text, add_special_tokens=False)
        inputs = self.engine.images
        if inputs is None:
            raise InvalidRequestError(f"{self.engine.model_name} takes no images", param="messages")
        tiles = [inputs.tiles(preprocess.decode(im) if isinstance(im, bytes) else im) for im in images]
        try:  # a template that drops a message drops its markers; one taking parts writes the model's own
            text = inputs.expand(text, tiles, at=placeholders.IMAGE if tk.content_format == "string" else None)
        except ValueError as e:
            raise InvalidRequestError(f"the chat template's text: {e}", param="messages") from e
        return {"prompt_token_ids": tk.encode(text, add_special_tokens=False), "multi_modal_data": {"image": tiles}}


def _with_parts(message: dict, parts: list[dict[str, str]]) -> dict:
    """`message` with its content as text and as parts, for the template to take either
    (loaders/chat_content.py)."""
    return {**message, "content": chat_content.joined(parts), chat_content.PARTS: parts}


def _parts_of(parts: list, images: list) -> list[dict[str, str]]:
    """A message's parts as text and {"type": "image"} parts, each image appended to `images` (a PIL
    image, or a data URL's bytes)."""
    out = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind == "image" and isinstance(part.get("image"), Image.Image):
            out.append({"type": "image"})
            images.append(part["image"])
        elif kind == "image_url":
            ref = part.get("image_url")
            url = ref.get("url") if isinstance(ref, dict) else ref
            out.append({"type": "image"})
            images.append(preprocess.data_url_bytes(url if isinstance(url, str) else ""))
        else:
            raise InvalidRequestError(f"content part {j}: text, image (a PIL image) or image_url (a data URL) "
                                      f"parts only, got {part!r:.80}", param="messages")
    return out
