"""Benchmarks: `python -m infire_jax.bench latency|throughput|serve|suite` (see `--help`)."""
