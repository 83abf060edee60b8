"""The prefix cache's page keys, in a module without torch so that a router can compute them too.

A page holding tokens t[i*P : (i+1)*P] has key_i = H(key_{i-1} | t[...] as int64) with key_-1 = H(salt), H =
blake2b-128 (engine/cache/prefix_cache.py publishes under these keys; gateway/kv_index.py scores prompts with them).
Only full pages have keys."""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

KEY_BYTES = 16


def root_key(salt: str) -> bytes:
    """key_-1: what every chain starts from (the salt names model, dtype, draft and page size)."""
    return hashlib.blake2b(salt.encode(), digest_size=KEY_BYTES).digest()


def chain_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a page holding `tokens` whose previous page's key is `parent` (the root for the first)."""
    digest = hashlib.blake2b(parent, digest_size=KEY_BYTES)
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


def page_keys(root: bytes, token_ids: Sequence[int], page_size: int, max_tokens: int | None = None) -> list[bytes]:
    """Keys of the full pages of token_ids[:max_tokens] (all of them by default), first page first."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    limit = len(token_ids) if max_tokens is None else min(max_tokens, len(token_ids))
    keys: list[bytes] = []
    key = root
    for start in range(0, limit - page_size + 1, page_size):
        key = chain_key(key, token_ids[start : start + page_size])
        keys.append(key)
    return keys
