"""Speculative decoding: draft proposers and their verification."""
