"""The host side of serving, free of jax: requests, the scheduler, and the KV cache's page bookkeeping."""
