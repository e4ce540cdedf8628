"""The bytes vLLM digests for each block, ``serialise((parent, tuple(tokens), extra))``, built fast.

vLLM's ``sha256_cbor``/``xxhash_cbor`` digest ``cbor2.dumps(triple, canonical=True)``.
Calling cbor2 once per block costs more than the digest itself (it builds an
encoder each call), so :meth:`CborBlockMessages.payloads` builds every block's
part after the parent in a few C-level passes over the whole prompt: each token
id's CBOR item comes from a table filled on first use by cbor2 itself, and the
items are joined with the fixed framing around them. Only the part before the
parent (:meth:`BlockMessages.head`) and the parent digest are added per block,
in the chain. The triple is ``0x83`` (array of 3), the parent as a byte
string, an array of the token items, the extra (``0xf6`` for None); CBOR has
no context, so the parts encoded apart are byte-identical to the triple encoded
at once (property-tested in ``tests/unit/test_block_messages.py``). Token ids
are ints (a bool counts as its int value).

``sha256``/``xxhash`` digest ``pickle.dumps(triple, protocol=5)``, whose C
pickler is already cheaper per block than any framing written here:
:class:`PickleBlockMessages` leaves every block to it.
"""

from __future__ import annotations

import marshal
import operator
import pickle
from collections.abc import Callable, Iterable, Sequence
from itertools import islice, repeat
from typing import Any, cast

import cbor2

PICKLE_PROTOCOL = 5  # pickle.HIGHEST_PROTOCOL on every CPython vLLM supports
TOKEN_TABLE_LIMIT = 1 << 18  # ids remembered per table (about 100 bytes each); later ones are encoded on each use
EXTRA_CACHE_LIMIT = 4096

_CBOR_TRIPLE = b"\x83"  # array of 3 items
_CBOR_NONE = b"\xf6"


def _cbor_head(major: int, length: int) -> bytes:
    """A canonical (shortest-form) CBOR item head."""
    if length < 24:
        return bytes((major << 5 | length,))
    for info, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if length < 1 << (8 * size):
            return bytes((major << 5 | info,)) + length.to_bytes(size, "big")
    raise ValueError(f"CBOR length {length} does not fit in 64 bits")


_PARENT_HEADS = {16: _cbor_head(2, 16), 32: _cbor_head(2, 32)}


def cbor_block_triple(parent: bytes, tokens: Sequence[int], extra: tuple[Any, ...] | None) -> bytes:
    """``cbor2.dumps((parent, tuple(tokens), extra), canonical=True)``, about 1.2x faster.

    cbor2's C encoder does the per-token work (so integer semantics stay
    cbor2's own, bignums included); only the fixed framing around it is written
    here. CBOR has no context, so encoding the parts separately is
    byte-identical to encoding the triple (property-tested in
    ``tests/unit/test_block_keys.py``).
    """
    head = _PARENT_HEADS.get(len(parent)) or _cbor_head(2, len(parent))
    tail = _CBOR_NONE if extra is None else cbor2.dumps(extra, canonical=True)
    return b"".join((_CBOR_TRIPLE, head, parent, cbor2.dumps(tokens, canonical=True), tail))


def pickle_block_triple(parent: bytes, tokens: Sequence[int], extra: tuple[Any, ...] | None) -> bytes:
    """What vLLM's ``sha256``/``xxhash`` algorithms digest: the triple pickled with protocol 5."""
    return pickle.dumps((parent, tuple(tokens), extra), protocol=PICKLE_PROTOCOL)


# --------------------------------------------------------------------------- per-token and per-extra bytes


class _TokenBytes(dict[int, bytes]):
    """Token id -> its encoded bytes, computed by ``encode`` on first use and kept for ``limit`` ids."""

    def __init__(self, encode: Callable[[int], bytes], limit: int = TOKEN_TABLE_LIMIT):
        super().__init__()
        self.encode = encode
        self.limit = limit

    def __missing__(self, token: int) -> bytes:
        token = operator.index(token)  # a bool is its int (a later lookup of the int finds it anyway)
        data = self.encode(token)
        if len(self) < self.limit:
            self[token] = data
        return data

    def join_blocks(self, tokens: Sequence[int], count: int, block_size: int, before: bytes,
                    after: bytes | Sequence[bytes | None]) -> list[bytes]:
        """``before + encoded tokens of block i + after`` (or ``after[i]``) for each of the first ``count`` blocks."""
        items = map(self.__getitem__, islice(tokens, count * block_size))
        afters = repeat(after, count) if isinstance(after, bytes) else after
        return list(map(b"".join, zip(repeat(before, count), *[items] * block_size, afters)))


def _cbor_int(token: int) -> bytes:
    return cbor2.dumps(token, canonical=True)


_CBOR_TOKENS = _TokenBytes(_cbor_int)
_EXTRA_CBOR: dict[bytes, bytes] = {}


def extra_cbor(extra: tuple[Any, ...]) -> bytes:
    """``cbor2.dumps(extra, canonical=True)``, cached by the extra's exact value.

    The cache key is the extra's ``marshal`` form, which tells ``1`` from
    ``True`` and ``1.0`` (equal as dict keys, encoded differently by CBOR);
    values ``marshal`` refuses are encoded each time.
    """
    try:
        key = marshal.dumps(extra, 0)  # version 0: no interning or reference flags, one form per value
    except ValueError:
        return cbor2.dumps(extra, canonical=True)
    data = _EXTRA_CBOR.get(key)
    if data is None:
        data = cbor2.dumps(extra, canonical=True)
        if len(_EXTRA_CBOR) >= EXTRA_CACHE_LIMIT:
            _EXTRA_CBOR.clear()
        _EXTRA_CBOR[key] = data
    return data


def per_block(extras: Sequence[tuple[Any, ...] | None], count: int, encode: Callable[[tuple[Any, ...]], bytes | None],
               none: bytes | None) -> list[bytes | None]:
    """``encode(extra)`` of each block's extra (``none`` for None), once per run of the same extra object."""
    out: list[bytes | None] = []
    last: object = None
    data = none
    for extra in islice(extras, count):
        if extra is not last:
            last = extra
            data = none if extra is None else encode(extra)
        out.append(data)
    return out


# --------------------------------------------------------------------------- messages


class BlockMessages:
    """Builds the serialised triple of every block: ``head(len(parent), payload) + parent + payload``."""

    reference: Callable[[bytes, Sequence[int], tuple[Any, ...] | None], bytes]  # for the blocks left as None

    def payloads(self, tokens: Sequence[int], count: int, block_size: int,
                 extras: Sequence[tuple[Any, ...] | None] | None) -> list[bytes | None]:
        """Each of the first ``count`` blocks' bytes after the parent, or None where :attr:`reference` must
        serialise."""
        raise NotImplementedError

    def head(self, parent_size: int, payload: bytes) -> bytes | None:
        """The bytes before a parent of ``parent_size`` bytes, or None where :attr:`reference` must serialise."""
        raise NotImplementedError

    def heads(self, parent_size: int, payloads: Iterable[bytes | None]) -> Iterable[bytes | None]:
        """:meth:`head` of each payload for parents of ``parent_size`` bytes."""
        return [None if payload is None else self.head(parent_size, payload) for payload in payloads]


class CborBlockMessages(BlockMessages):
    """``cbor2.dumps((parent, tuple(tokens), extra), canonical=True)`` of each block."""

    reference = staticmethod(cbor_block_triple)
    tokens = _CBOR_TOKENS  # shared by every instance: the bytes of an id never change

    def payloads(self, tokens: Sequence[int], count: int, block_size: int,
                 extras: Sequence[tuple[Any, ...] | None] | None) -> list[bytes | None]:
        tails: bytes | list[bytes | None] = (_CBOR_NONE if extras is None
                                             else per_block(extras, count, extra_cbor, _CBOR_NONE))
        payloads = self.tokens.join_blocks(tokens, count, block_size, _cbor_head(4, block_size), tails)
        return cast("list[bytes | None]", payloads)  # every block has its bytes (list is invariant)

    def head(self, parent_size: int, payload: bytes) -> bytes:
        return _CBOR_TRIPLE + _cbor_head(2, parent_size)

    def heads(self, parent_size: int, payloads: Iterable[bytes | None]) -> Iterable[bytes | None]:
        return repeat(self.head(parent_size, b""))


class PickleBlockMessages(BlockMessages):
    """``pickle.dumps((parent, tuple(tokens), extra), protocol=5)`` of each block, by the pickler itself."""

    reference = staticmethod(pickle_block_triple)

    def payloads(self, tokens: Sequence[int], count: int, block_size: int,
                 extras: Sequence[tuple[Any, ...] | None] | None) -> list[bytes | None]:
        return [None] * count

    def head(self, parent_size: int, payload: bytes) -> None:
        return None

    def heads(self, parent_size: int, payloads: Iterable[bytes | None]) -> Iterable[bytes | None]:
        return repeat(None)
