"""The OpenAI-compatible HTTP server (aiohttp) over the async engine."""
