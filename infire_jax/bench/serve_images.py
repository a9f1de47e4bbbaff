"""`bench serve --images-per-request N --image-size WxH`: chat requests that carry images.

As vLLM's `bench serve` sends its random multimodal prompts: each request is one user message, its
text first, then N random-pixel JPEG images as `image_url` data URLs. Image parts exist only in chat
messages, so these requests go to the chat endpoint. The same N images go with every request (drawn
once from --seed): each request's own text comes first, so requests share no prefix, and no
megabytes of base64 are drawn per request.

Random prompts are token ids, which a chat message cannot carry without the server's tokenizer:
each id becomes one of a few short English words instead (`text_of`), so --input-len counts words,
about one token each for a BPE tokenizer; the prompt tokens reported are the server's usage.
"""

from __future__ import annotations

import argparse
import base64
import io

from infire_jax.bench.common import BenchError

WORDS = ("the", "a", "of", "and", "to", "in", "is", "it", "that", "was", "for", "on", "are", "with", "as", "his",
         "they", "be", "at", "one", "have", "this", "from", "or", "had", "by", "word", "but", "what", "some",
         "we", "can", "out", "other", "were", "all", "there", "when", "up", "use", "your", "how", "said", "an",
         "each", "she", "which", "do", "their", "time")


def image_size(text: str) -> tuple[int, int]:
    """`WxH` pixels (width, height), or `N` for N x N."""
    parts = text.lower().split("x")
    try:
        sides = [int(p) for p in parts]
    except ValueError:
        sides = []
    if len(sides) not in (1, 2) or min(sides) < 1:
        raise argparse.ArgumentTypeError(f"expected WxH (e.g. 1024x768) or N pixels, got {text!r}")
    return (sides[0], sides[-1])


def data_urls(count: int, size: tuple[int, int], seed: int) -> list[str]:
    """`count` random-pixel images of `size` (width, height) as JPEG data URLs."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng((seed, 3))
    urls = []
    for _ in range(count):
        pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="JPEG")
        urls.append("data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode())
    return urls


def text_of(prompt: str | list[int]) -> str:
    """A prompt as chat text: a dataset's text as it is, random token ids as words (module docstring)."""
    if isinstance(prompt, str):
        return prompt
    return " ".join(WORDS[t % len(WORDS)] for t in prompt)


def messages(prompt: str | list[int], urls: list[str]) -> list[dict]:
    """One user message: the prompt's text, then the images."""
    text = text_of(prompt)
    if not text:
        raise BenchError("a prompt with images needs text")
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         *({"type": "image_url", "image_url": {"url": u}} for u in urls)]}]
