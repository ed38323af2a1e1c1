"""Speculative decoding with exact verification."""
