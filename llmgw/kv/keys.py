"""Block keys: vLLM's chained prefix-cache block hash, and the key functions the router indexes by.

vLLM (0.10.2+) hashes a request's tokens block by block::

    NONE_HASH = H(seed_string)
    h_i = H((h_{i-1}, tuple(block_i_tokens), extra_i))    # h_{-1} = NONE_HASH

where ``H`` is a serialiser (canonical CBOR or pickle protocol 5) followed by a
digest (SHA-256 or XXH3-128), and KV events carry the low 64 bits of ``h_i``.
See ``docs/kv.md`` and ``docs/vllm-notes.md`` section 4.

Two :class:`BlockKeyFunction` implementations turn token ids into one unsigned
64-bit key per full block:

- :class:`VllmBlockKeys` reproduces vLLM's chain, so its keys equal the hashes
  in the engine's events when the algorithm, seed and block size match;
- :class:`ContentChainKeys` is a much faster private chain for a mirror that
  re-keys events from their ``token_ids``.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import lru_cache
from itertools import repeat
from operator import itemgetter
from typing import NamedTuple, Protocol, cast, runtime_checkable

import cbor2
import xxhash

from .block_messages import (
    PICKLE_PROTOCOL,
    BlockMessages,
    CborBlockMessages,
    PickleBlockMessages,
    cbor_block_triple,
    extra_cbor,
    per_block,
    pickle_block_triple,
)

ALGORITHMS = ("sha256_cbor", "sha256", "xxhash", "xxhash_cbor")
DEFAULT_KEY_FUNCTION = "content"  # the router's block keys unless a model's routing_options key_function says
DEFAULT_SEED_STRING = "vllm-none-hash"  # vLLM >= 0.29, sha256*/sha256_cbor with PYTHONHASHSEED unset
U64_MASK = 0xFFFF_FFFF_FFFF_FFFF

ExtraKeys = Sequence[tuple[object, ...] | None]


# --------------------------------------------------------------------------- serialisation


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_SERIALISE_OBJECT: dict[str, Callable[[object], bytes]] = {
    "sha256_cbor": lambda obj: cbor2.dumps(obj, canonical=True),
    "xxhash_cbor": lambda obj: cbor2.dumps(obj, canonical=True),
    "sha256": lambda obj: pickle.dumps(obj, protocol=PICKLE_PROTOCOL),
    "xxhash": lambda obj: pickle.dumps(obj, protocol=PICKLE_PROTOCOL),
}
_SERIALISE_TRIPLE = {
    "sha256_cbor": cbor_block_triple,
    "xxhash_cbor": cbor_block_triple,
    "sha256": pickle_block_triple,
    "xxhash": pickle_block_triple,
}
_DIGEST: dict[str, Callable[[bytes], bytes]] = {
    "sha256_cbor": _sha256,
    "sha256": _sha256,
    "xxhash_cbor": xxhash.xxh3_128_digest,  # canonical, i.e. big-endian, 16 bytes
    "xxhash": xxhash.xxh3_128_digest,
}


def _check_algo(algo: str) -> None:
    if algo not in _DIGEST:
        raise ValueError(f"unknown prefix-caching hash algorithm {algo!r} (known: {', '.join(ALGORITHMS)})")


def hash_object(algo: str, obj: object) -> bytes:
    """vLLM's ``H(obj)`` for ``algo``: serialise, then digest (no truncation)."""
    _check_algo(algo)
    return _DIGEST[algo](_SERIALISE_OBJECT[algo](obj))


def block_hasher(algo: str) -> Callable[[bytes, Sequence[int], tuple[object, ...] | None], bytes]:
    """``hash_block(parent, tokens, extra) -> digest`` for ``algo``."""
    _check_algo(algo)
    serialise, digest = _SERIALISE_TRIPLE[algo], _DIGEST[algo]

    def hash_block(parent: bytes, tokens: Sequence[int], extra: tuple[object, ...] | None) -> bytes:
        return digest(serialise(parent, tokens, extra))

    return hash_block


# --------------------------------------------------------------------------- the chain


def none_hash(algo: str, seed: str | None) -> bytes:
    """The chain's root (vLLM's ``NONE_HASH``) under the rules of vLLM >= 0.29.

    ``seed`` is the engine's ``PYTHONHASHSEED`` string exactly as set (``"0"``
    and ``"00"`` differ), or None when it is unset. Unset gives the fixed seed
    ``"vllm-none-hash"`` for sha256/sha256_cbor, and a random per-process root
    for xxhash/xxhash_cbor, which no router can reproduce (ValueError).
    """
    _check_algo(algo)
    if seed is None:
        if algo.startswith("xxhash"):
            raise ValueError(
                f"{algo} with PYTHONHASHSEED unset uses a random per-process NONE_HASH; "
                "set PYTHONHASHSEED for the engine and pass it as seed"
            )
        seed = DEFAULT_SEED_STRING
    if not isinstance(seed, str):
        raise TypeError(f"seed must be the PYTHONHASHSEED string or None, not {type(seed).__name__}")
    return hash_object(algo, seed)


def hashable_block_count(num_tokens: int, block_size: int, lookahead: int = 0) -> int:
    """How many blocks vLLM hashes: full blocks only, each needing ``lookahead`` tokens after it."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if lookahead < 0:
        raise ValueError(f"lookahead must be >= 0, got {lookahead}")
    return max(num_tokens - lookahead, 0) // block_size


def _extras_for(extra_keys: ExtraKeys | None, count: int) -> Sequence[tuple[object, ...] | None]:
    """One extra-key item per block; items must be None or tuples (pickle tells a list from a tuple)."""
    if extra_keys is None:
        return (None,) * count
    if len(extra_keys) < count:
        raise ValueError(f"extra_keys has {len(extra_keys)} entries for {count} blocks")
    for i in range(count):
        if extra_keys[i] is not None and type(extra_keys[i]) is not tuple:
            raise TypeError(f"extra_keys[{i}] must be None or a tuple, not {type(extra_keys[i]).__name__}")
    return extra_keys


def _as_int_list(token_ids: Sequence[int]) -> Sequence[int]:
    return token_ids if type(token_ids) in (list, tuple) else [int(t) for t in token_ids]


def block_digests(
    token_ids: Sequence[int],
    block_size: int,
    *,
    algo: str = "sha256_cbor",
    seed: str | None = None,
    extra_keys: ExtraKeys | None = None,
    parent: bytes | None = None,
    lookahead: int = 0,
) -> list[bytes]:
    """vLLM's full block digests, one per hashable full block (the partial tail is ignored).

    ``extra_keys`` holds the exact third item of each block's hashed triple
    (see :func:`request_extra_keys`); entries beyond the hashed blocks are
    ignored. ``parent`` continues an existing chain (default: the seed's
    NONE_HASH). ``lookahead`` is EAGLE's lookahead token count (0.33+): blocks
    are hashed only once that many tokens follow them.
    """
    hash_block = block_hasher(algo)
    if parent is None:
        parent = none_hash(algo, seed)
    tokens = _as_int_list(token_ids)
    count = hashable_block_count(len(tokens), block_size, lookahead)
    extras = _extras_for(extra_keys, count)
    digests = []
    for i in range(count):
        parent = hash_block(parent, tokens[i * block_size : (i + 1) * block_size], extras[i])
        digests.append(parent)
    return digests


def event_int(digest: bytes) -> int:
    """The int form KV events carry: the digest's last 8 bytes, big-endian unsigned."""
    return int.from_bytes(digest[-8:], "big")


def normalize_hash(h: int | bytes) -> int:
    """An event hash as the router's unsigned 64-bit key: ints masked, bytes via :func:`event_int`."""
    if type(h) is int:
        return h & U64_MASK
    if isinstance(h, (bytes, bytearray, memoryview)):
        return int.from_bytes(bytes(h[-8:]), "big")
    raise TypeError(f"a block hash is an int or bytes, not {type(h).__name__}")


# --------------------------------------------------------------------------- extra keys


class MultiModalItem(NamedTuple):
    """A multimodal placeholder: vLLM's item identifier and its token range ``[offset, offset+length)``."""

    identifier: str
    offset: int
    length: int


EXTRA_KEY_STYLES = {
    "current": "hash input of vLLM 0.31+: tagged tuples ('lora', name, path), ('mm', id, offset), ('cache_salt', s)",
    "event": "what BlockStored.extra_keys carries in 0.19+: untagged name, (id, offset), salt; no lookahead tokens",
    "untagged": "hash input of 0.19.0-0.30.x: LoRA name, (identifier, offset), salt",
    "untagged_mm_id": "hash input of 0.11.1-0.18.x: LoRA name, bare mm identifier, salt",
    "lora_int_id": "hash input of 0.10.2-0.11.0: LoRA integer id, bare mm identifier, salt",
}


def _lora_piece(style: str, lora: tuple[str, str] | None, lora_int_id: int | None) -> object | None:
    if style == "lora_int_id":
        if lora is not None and lora_int_id is None:
            raise ValueError("style 'lora_int_id' needs lora_int_id (the engine's integer adapter id)")
        return lora_int_id
    if lora is None:
        return None
    name, path = lora
    return ("lora", name, path) if style == "current" else name


def _mm_piece(style: str, item: MultiModalItem, block_start: int) -> object:
    if style == "current":
        return ("mm", item.identifier, item.offset - block_start)
    if style in ("untagged", "event"):
        return (item.identifier, item.offset - block_start)
    return item.identifier


def request_extra_keys(
    num_tokens: int,
    block_size: int,
    *,
    lora: tuple[str, str] | None = None,
    cache_salt: str | None = None,
    mm_items: Sequence[MultiModalItem | tuple[str, int, int]] = (),
    style: str = "current",
    lora_int_id: int | None = None,
    lookahead: int = 0,
    token_ids: Sequence[int] | None = None,
) -> list[tuple[object, ...] | None]:
    """The extra-key item of each hashable block of a request, in vLLM's order.

    Per block: LoRA (every block), each multimodal item overlapping the block
    (offset relative to the block start, negative once the item began
    earlier), then the cache salt (block 0 only). ``lora`` is
    ``(lora_name, lora_path)``; ``style`` picks the release's shape (see
    :data:`EXTRA_KEY_STYLES`). Prompt-embedding digests are not supported (a
    router never has the embeddings).

    With EAGLE ``lookahead`` L > 0 (0.33+), only ``(num_tokens - L) //
    block_size`` blocks exist, each item is computed over the block widened by
    L tokens, and the hash styles append the L following tokens (from
    ``token_ids``): ``(E, t_end, ..., t_end+L-1)``; style ``"event"`` gives
    ``E`` alone, as ``BlockStored.extra_keys`` publishes it.

    The multimodal overlap rule is the one vLLM applies when it hashes a whole
    prompt at once; the 0.10.2-0.18 off-by-one only affected blocks hashed
    later during decoding.
    """
    if style not in EXTRA_KEY_STYLES:
        raise ValueError(f"unknown extra-key style {style!r} (known: {', '.join(EXTRA_KEY_STYLES)})")
    if lookahead and style not in ("current", "event"):
        raise ValueError("lookahead hashing exists only in vLLM 0.33+ (styles 'current' and 'event')")
    appends_lookahead = lookahead > 0 and style != "event"
    if appends_lookahead:
        if token_ids is None or len(token_ids) != num_tokens:
            raise ValueError("lookahead hashing needs the request's token_ids (num_tokens of them)")
    following: Sequence[int] = token_ids if token_ids is not None else ()
    items = [MultiModalItem(*item) for item in mm_items]
    lora_piece = _lora_piece(style, lora, lora_int_id)
    salt_piece = None
    if cache_salt is not None:
        salt_piece = ("cache_salt", cache_salt) if style == "current" else cache_salt

    out: list[tuple[object, ...] | None] = []
    for index in range(hashable_block_count(num_tokens, block_size, lookahead)):
        start = index * block_size
        end = start + block_size
        window_end = end + lookahead
        pieces: list[object] = []
        if lora_piece is not None:
            pieces.append(lora_piece)
        for item in items:
            if item.offset < window_end and item.offset + item.length > start:
                pieces.append(_mm_piece(style, item, start))
        if salt_piece is not None and start == 0:
            pieces.append(salt_piece)
        extra = tuple(pieces) if pieces else None
        if appends_lookahead:
            extra = (extra, *following[end:window_end])
        out.append(extra)
    return out


# --------------------------------------------------------------------------- compact block bytes


# Unsigned 32-bit little-endian token ids; unsigned typecodes convert lists twice as fast as signed ones.
_U32 = next(code for code in "IL" if array(code).itemsize == 4)


def _pack_u32le(tokens: Sequence[int]) -> bytes:
    try:
        packed = array(_U32, tokens)
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"token ids must be ints in [0, 2**32): {exc}") from None
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


# --------------------------------------------------------------------------- key functions


@runtime_checkable
class BlockKeyFunction(Protocol):
    """Turns token ids into one unsigned 64-bit key per full block (a chained hash)."""

    name: str

    def keys(self, token_ids: Sequence[int], block_size: int, extra_keys: ExtraKeys | None = None) -> list[int]:
        """One key per full block of ``token_ids``; ``extra_keys`` holds one item (or None) per block."""
        ...


_MESSAGES: dict[str, Callable[[], BlockMessages]] = {
    "sha256_cbor": CborBlockMessages,
    "xxhash_cbor": CborBlockMessages,
    "sha256": PickleBlockMessages,
    "xxhash": PickleBlockMessages,
}


class VllmBlockKeys:
    """vLLM's own chain; the keys equal the int hashes in the engine's KV events.

    Needs the engine's ``--prefix-caching-hash-algo``, its ``PYTHONHASHSEED``
    (``seed``; None means unset) and block size. Each block's serialised
    triple is built by :mod:`llmgw.kv.block_messages` (a few C-level passes
    over the prompt, then one concatenation and one digest per block).

    The memo maps ``(block size, uint32 tokens, extra, parent digest)`` of a
    block (flat bytes: :func:`_memo_key_starts`) to its digest (and the digest to its event int) and is an
    **LRU** bounded by ``memo_size`` entries (0 disables it). LRU rather than
    clear-when-full because the entries worth keeping (shared system prompts,
    earlier turns of a chat) are exactly the recently used ones, while most
    prompt tails are unique: clearing would periodically drop the hot prefixes
    together with the junk. Lookups stop at the first miss (its successors have
    a new parent); a hit serialises nothing. About 340 bytes per entry with
    16-token blocks (21 MiB at the default size), plus the token tables shared
    by every instance (about 100 bytes per distinct id). Not thread-safe: use
    one instance per thread.
    """

    name = "vllm"

    def __init__(self, algo: str = "sha256_cbor", seed: str | None = "0", memo_size: int = 65536) -> None:
        if memo_size < 0:
            raise ValueError(f"memo_size must be >= 0, got {memo_size}")
        self.algo = algo
        self.seed = seed
        self.none_hash = none_hash(algo, seed)
        self.memo_size = memo_size
        self._hash_block = _DIGEST[algo]  # a block's serialised triple -> its digest
        self._messages = _MESSAGES[algo]()
        self._memo: OrderedDict[bytes, bytes] = OrderedDict()
        self._event_ints: dict[bytes, int] = {}  # digest -> event int, of the memo's digests

    def __repr__(self) -> str:
        return f"VllmBlockKeys(algo={self.algo!r}, seed={self.seed!r}, memo_size={self.memo_size})"

    def keys(self, token_ids: Sequence[int], block_size: int, extra_keys: ExtraKeys | None = None) -> list[int]:
        return self._chain(token_ids, block_size, extra_keys, self.none_hash, 0)[1]

    def keys_after(self, token_ids: Sequence[int], block_size: int, extra_keys: ExtraKeys | None = None, *,
                   parent: bytes | None = None) -> tuple[list[int], bytes | None]:
        """The keys of ``token_ids``' full blocks continuing the chain after the digest ``parent`` (None: the
        chain's start), and the last block's digest (the next slice's ``parent``): a long prompt hashed in
        slices gets the keys :meth:`keys` gives it whole."""
        digests, ints = self._chain(token_ids, block_size, extra_keys, self.none_hash if parent is None else parent,
                                    0)
        return ints, digests[-1] if digests else parent

    def digests(
        self,
        token_ids: Sequence[int],
        block_size: int,
        extra_keys: ExtraKeys | None = None,
        *,
        parent: bytes | None = None,
        lookahead: int = 0,
    ) -> list[bytes]:
        """Full digests (as :func:`block_digests`), memoised; ``parent`` continues a chain."""
        start = self.none_hash if parent is None else parent
        return self._chain(token_ids, block_size, extra_keys, start, lookahead)[0]

    @property
    def memo_entries(self) -> int:
        return len(self._memo)

    def clear_memo(self) -> None:
        self._memo.clear()
        self._event_ints.clear()

    def _chain(
        self, token_ids: Sequence[int], block_size: int, extra_keys: ExtraKeys | None, parent: bytes, lookahead: int
    ) -> tuple[list[bytes], list[int]]:
        """The digest and the event int of each block.

        A memo hit gives the same int objects every time, which the index's dict lookups then match on
        identity (0.15 ms less per warm decision at 32k tokens). They are kept in a dict of their own rather
        than in tuples with the digests: a dict of bytes and ints is invisible to the cyclic GC, tuples are not
        until a collection (and a memo of new tuples makes collections frequent: +0.09 ms per cold chat).
        """
        tokens = _as_int_list(token_ids)
        count = hashable_block_count(len(tokens), block_size, lookahead)
        extras = None if extra_keys is None else _extras_for(extra_keys, count)
        memo_keys = None
        if self.memo_size and len(parent) == len(self.none_hash):
            try:
                memo_keys = _memo_key_starts(tokens, block_size, extras, count)
            except ValueError:
                pass  # ids outside uint32 (never from a tokenizer): hash without the memo
        digests = [] if memo_keys is None else self._memo_hits(memo_keys, parent)
        ints = list(map(self._event_ints.__getitem__, digests))
        if len(digests) < count:
            self._hash_blocks(digests, ints, tokens, block_size, extras, digests[-1] if digests else parent, count,
                              memo_keys)
        return digests, ints

    def _memo_hits(self, memo_keys: list[bytes], parent: bytes) -> list[bytes]:
        """The digests of the chain's leading blocks found in the memo (marked most recently used)."""
        memo = self._memo
        out = []
        for key_start in memo_keys:
            key = key_start + parent
            hit = memo.get(key)
            if hit is None:
                break
            memo.move_to_end(key)
            out.append(hit)
            parent = hit
        return out

    def _hash_blocks(self, digests: list[bytes], ints: list[int], tokens: Sequence[int], block_size: int,
                     extras: ExtraKeys | None, parent: bytes, count: int, memo_keys: list[bytes] | None) -> None:
        """Hashes blocks ``len(digests)`` to ``count - 1`` (after ``parent``) onto ``digests`` and ``ints``, and
        memoises them."""
        first = len(digests)
        if first:
            tokens = tokens[first * block_size : count * block_size]
            extras = None if extras is None else extras[first:count]
        messages = self._messages
        payloads = messages.payloads(tokens, count - first, block_size, extras)
        heads = messages.heads(len(self.none_hash), payloads)
        digest, reference = self._hash_block, messages.reference
        root = parent
        for i, (head, payload) in enumerate(zip(heads, payloads)):
            if i == 0 and payload is not None and len(parent) != len(self.none_hash):
                head = messages.head(len(parent), payload)
            if head is None or payload is None:
                message = reference(parent, tokens[i * block_size : (i + 1) * block_size],
                                    None if extras is None else extras[i])
            else:
                message = head + parent + payload
            parent = digest(message)
            digests.append(parent)
        new = digests[first:]
        ints.extend(_event_ints(new, len(self.none_hash)))
        if memo_keys is not None:
            memo, event_ints = self._memo, self._event_ints
            parents = [root, *new[:-1]]
            for key_start, parent, block_digest, key in zip(memo_keys[first:], parents, new, ints[first:]):
                memo[key_start + parent] = block_digest
                event_ints[block_digest] = key
            for _ in range(len(memo) - self.memo_size):  # the least recently used out (as if evicted one by one)
                event_ints.pop(memo.popitem(last=False)[1], None)


def _memo_key_starts(tokens: Sequence[int], block_size: int, extras: ExtraKeys | None, count: int) -> list[bytes]:
    """Each block's memo key but the parent: block size + uint32 tokens [+ 0xff + CBOR of the extra].

    The key is that + the parent digest: flat bytes (invisible to the cyclic GC, which otherwise re-scans a large
    memo of tuples), unambiguous (the block size says where the tokens end; every parent here has the digest's
    length), and cheaper to build than the block's serialised triple, so a memo hit costs no serialising. Built
    for all blocks at once; ValueError for ids outside uint32.
    """
    stride = 4 * block_size
    chunks = map(itemgetter(0), _chunks(stride).iter_unpack(_pack_u32le(tokens[: count * block_size])))
    tails = repeat(b"", count) if extras is None else \
        cast("list[bytes]", per_block(extras, count, lambda e: b"\xff" + extra_cbor(e), b""))  # none=b"": no None
    return list(map(b"".join, zip(repeat(block_size.to_bytes(4, "little")), chunks, tails)))


@lru_cache(maxsize=64)
def _chunks(size: int) -> struct.Struct:
    return struct.Struct(f"{size}s")


def _event_ints(digests: list[bytes], digest_size: int) -> list[int]:
    """:func:`event_int` of each digest, in one or a few C calls."""
    joined = b"".join(digests)
    if len(digests) <= 256:
        return list(_digest_tails(digest_size, len(digests)).unpack(joined))
    return [key for (key,) in _digest_tails(digest_size, 1).iter_unpack(joined)]


@lru_cache(maxsize=128)
def _digest_tails(digest_size: int, count: int) -> struct.Struct:
    return struct.Struct(">" + f"{digest_size - 8}xQ" * count)


class ContentChainKeys:
    """A fast private chain over token ids. **Not** vLLM's hash: its keys never match event hashes.

    ``key_i = xxh3_64(tokens_i as uint32 little-endian [+ CBOR of extra_i], seed=key_{i-1})``
    with ``key_{-1} = root``. Use it where the mirror re-keys each
    ``BlockStored`` from its ``token_ids`` (continuing from the parent block's
    key via ``parent``) and keeps an engine-hash -> key map to apply
    ``BlockRemoved``: it is independent of the engine's algorithm and seed and
    5-10x cheaper than :class:`VllmBlockKeys`, but the block size must still
    match. Token ids must lie in ``[0, 2**32)`` (ValueError otherwise). Token
    blocks have a fixed byte length for a given block size, so a block with
    extras can never be confused with one without.
    """

    name = "content"

    def __init__(self, root: int = 0) -> None:
        self.root = root & U64_MASK

    def __repr__(self) -> str:
        return f"ContentChainKeys(root={self.root})"

    def keys(
        self,
        token_ids: Sequence[int],
        block_size: int,
        extra_keys: ExtraKeys | None = None,
        *,
        parent: int | None = None,
    ) -> list[int]:
        count = hashable_block_count(len(token_ids), block_size)
        extras = _extras_for(extra_keys, count)
        packed = _pack_u32le(token_ids[: count * block_size])
        stride = block_size * 4
        key = self.root if parent is None else parent & U64_MASK
        digest = xxhash.xxh3_64_intdigest
        out = []
        for i in range(count):
            data = packed[i * stride : (i + 1) * stride]
            extra = extras[i]
            if extra is not None:
                data += extra_cbor(extra)
            key = digest(data, key)
            out.append(key)
        return out
