"""Speculative decoding: proposers guess several next tokens, and the target model checks them all
in one step (verification lives in `verify.py`, the per-request policy in `controller.py`)."""
