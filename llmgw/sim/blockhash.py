"""vLLM's block hashes for one simulated request, extended as its tokens grow.

The engine-wide :class:`BlockHashing` holds the algorithm, the NONE_HASH seed
(``PYTHONHASHSEED`` as vLLM >= 0.29 reads it), the block size and a memo shared
by all requests (``llmgw.kv.keys.VllmBlockKeys``). Each request gets a
:class:`SequenceHashes` that hashes every block once it is full: the prompt's
blocks when the request arrives, generated blocks as decoding fills them (vLLM
caches those too). Extra keys follow vLLM 0.31+: ``("lora", name, path)`` on
every block of a LoRA request and ``("cache_salt", salt)`` on block 0; events
publish the untagged form.
"""

from __future__ import annotations

import os
from typing import Callable

from llmgw.kv.keys import VllmBlockKeys, event_int, request_extra_keys


def none_hash_seed(algo: str, environ: dict[str, str] | None = None) -> str:
    """The NONE_HASH seed string vLLM >= 0.29 would use in this environment.

    ``PYTHONHASHSEED`` as given; unset gives ``"vllm-none-hash"`` for sha256*
    and a random per-process seed for xxhash* (not reproducible, as in vLLM).
    """
    env = os.environ if environ is None else environ
    seed = env.get("PYTHONHASHSEED")
    if seed is not None:
        return seed
    if algo.startswith("xxhash"):
        return os.urandom(32).hex()
    return "vllm-none-hash"


def event_hash_converter(environ: dict[str, str] | None = None) -> Callable[[bytes], int | bytes]:
    """How digests appear in events: low 64 bits as an int, or raw bytes when
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``."""
    env = os.environ if environ is None else environ
    if env.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1").strip().lower() in ("0", "false"):
        return bytes
    return event_int


class BlockHashing:
    """Engine-wide hashing configuration and memo."""

    def __init__(self, block_size: int, algo: str = "sha256", seed: str = "vllm-none-hash",
                 to_event: Callable[[bytes], int | bytes] = event_int, memo_size: int = 65536):
        self.block_size = block_size
        self.algo = algo
        self.seed = seed
        self.keys = VllmBlockKeys(algo, seed, memo_size=memo_size)
        self.to_event = to_event

    def for_request(self, lora: tuple[str, str] | None = None, cache_salt: str | None = None) -> "SequenceHashes":
        return SequenceHashes(self, lora, cache_salt)


class SequenceHashes:
    """The digests of a request's full blocks, and each block's extra keys (hashed and published forms)."""

    __slots__ = ("hashing", "digests", "_hash_extras", "_event_extras")

    def __init__(self, hashing: BlockHashing, lora: tuple[str, str] | None, cache_salt: str | None):
        self.hashing = hashing
        self.digests: list[bytes] = []
        if lora is None and cache_salt is None:
            self._hash_extras = self._event_extras = None
        else:
            # Only LoRA (every block) and the salt (block 0) occur here, so block 1 stands for all later blocks.
            size = hashing.block_size
            self._hash_extras = request_extra_keys(2 * size, size, lora=lora, cache_salt=cache_salt)
            self._event_extras = request_extra_keys(2 * size, size, lora=lora, cache_salt=cache_salt, style="event")

    def hash_extra(self, index: int) -> tuple | None:
        extras = self._hash_extras
        return None if extras is None else extras[min(index, 1)]

    def event_extra(self, index: int) -> list[object] | None:
        extras = self._event_extras
        extra = None if extras is None else extras[min(index, 1)]
        return None if extra is None else list(extra)

    def extend(self, token_ids: list[int]) -> None:
        """Hash every block of ``token_ids`` that became full since the last call."""
        size = self.hashing.block_size
        done = len(self.digests)
        full = len(token_ids) // size
        if full <= done:
            return
        extras = None
        if self._hash_extras is not None:
            extras = [self.hash_extra(i) for i in range(done, full)]
        self.digests.extend(self.hashing.keys.digests(
            token_ids[done * size: full * size], size, extras,
            parent=self.digests[-1] if done else None))
