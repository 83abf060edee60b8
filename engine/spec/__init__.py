"""Speculative decoding: draft proposal, verification (greedy and rejection sampling) and the back-off policy."""
