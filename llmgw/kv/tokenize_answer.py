"""Reading a ``/tokenize`` answer as it arrives, and only as far as routing can use it.

vLLM (and the simulator) answer ``{"count": N, "max_model_len": M, "tokens": [...], "token_strs": null}``. A
long prompt's answer is megabytes of ids; routing uses at most ``max_ids`` of them (the tier's
``max_prompt_tokens`` plus a margin). :class:`TokenizeAnswerReader` is fed the answer's pieces as they come
and says when it has what it needs: the ``tokens`` array ended, or ``max_ids`` ids were read (the rest of the
answer is never read). Each piece costs a few C-level passes (a regex check, then the JSON scanner, or
``split`` and ``map(int)`` for the piece that holds more ids than needed or is malformed), so a big answer never
holds the event loop for long, and nothing beyond ``max_ids`` ids is parsed or checked.

Bounds: ``max_bytes`` of answer in all (``max_ids`` x 16 bytes plus 64 KiB by default), and
``MAX_OTHER_VALUE_BYTES`` for a member other than ``tokens`` (``count`` is read when it comes first). Anything
else (not an object, no ``tokens`` array, an id that is not a decimal integer below 2^32) raises
:class:`~llmgw.kv.tokenize.TokenizeError` of kind ``answer``.
"""

from __future__ import annotations

import json
import re

from .tokenize import TokenizeError

MAX_OTHER_VALUE_BYTES = 64 * 1024  # a member other than "tokens" (count, max_model_len, token_strs...)
MAX_ID = (1 << 32) - 1
_MEMBER = re.compile(rb'[ \t\r\n]*"([A-Za-z0-9_]{1,64})"[ \t\r\n]*:[ \t\r\n]*')
_IDS_ONLY = re.compile(rb"[0-9 \t\r\n,]*")
_WS = b" \t\r\n"
_decoder = json.JSONDecoder()


def default_max_bytes(max_ids: int) -> int:
    return max_ids * 16 + 64 * 1024


class TokenizeAnswerReader:
    """``feed(piece)`` the answer's pieces until it returns True, then take :attr:`ids` (see the module).

    ``ids`` holds at most ``max_ids`` ids; ``truncated`` is True when the answer had more (or may have: the
    reader stopped at ``max_ids``); ``count`` is the answer's own ``count`` when it came before the ids.
    :meth:`finish` is called at the end of the answer and raises when the ids never ended.
    """

    def __init__(self, max_ids: int, max_bytes: int | None = None):
        if max_ids < 0:
            raise ValueError("max_ids must be >= 0")
        self.max_ids = max_ids
        self.max_bytes = default_max_bytes(max_ids) if max_bytes is None else max_bytes
        self.ids: list[int] = []
        self.count: int | None = None
        self.truncated = False
        self.done = False
        self.bytes_read = 0
        self._buf = bytearray()
        self._state = "start"  # start -> member -> (value | tokens) -> ... -> done

    def feed(self, piece: bytes) -> bool:
        """Take the next piece of the answer; True once the ids routing needs are read (feed no more)."""
        if self.done:
            return True
        self.bytes_read += len(piece)
        if self.bytes_read > self.max_bytes:
            raise TokenizeError("answer", f"/tokenize answer larger than {self.max_bytes} bytes before its ids "
                                          f"ended (read {len(self.ids)} ids)")
        self._buf += piece
        while not self.done and self._step():
            pass
        return self.done

    def finish(self) -> list[int]:
        """The answer ended: its ids, or :class:`TokenizeError` when they were not all there."""
        if not self.done:
            raise TokenizeError("answer", "/tokenize answer ended before its tokens array did"
                                if self._state == "tokens" else "/tokenize answer without a tokens array")
        return self.ids

    # -- the states: each step consumes from the buffer and says whether it made progress --------------------------

    def _step(self) -> bool:
        buf = self._buf
        if self._state == "start":
            stripped = buf.lstrip(_WS)
            if not stripped:
                return False
            if stripped[:1] != b"{":
                raise TokenizeError("answer", "/tokenize answer is not a JSON object")
            del buf[:len(buf) - len(stripped) + 1]
            self._state = "member"
            return True
        if self._state == "member":
            return self._member()
        if self._state == "tokens":
            return self._take_ids()
        return self._other_value()

    def _member(self) -> bool:
        buf = self._buf
        stripped = buf.lstrip(_WS + b",")
        if stripped[:1] == b"}":
            raise TokenizeError("answer", "/tokenize answer without a tokens array")
        match = _MEMBER.match(buf, len(buf) - len(stripped))
        if match is None:
            if len(buf) > 256 or b":" in buf:
                raise TokenizeError("answer", "/tokenize answer: not a JSON object of simple member names")
            return False
        name = match.group(1)
        del buf[:match.end()]
        if name == b"tokens":
            self._state = "array"
        else:
            self._state = "count" if name == b"count" else "value"
        return True

    def _other_value(self) -> bool:
        buf = self._buf
        stripped = buf.lstrip(_WS)
        if len(stripped) < len(buf):
            del buf[:len(buf) - len(stripped)]
        if self._state == "array":
            if not buf:
                return False
            if buf[:1] != b"[":
                raise TokenizeError("answer", "/tokenize answer: tokens is not a list")
            del buf[:1]
            self._state = "tokens"
            return True
        window = bytes(buf[:MAX_OTHER_VALUE_BYTES]).decode("utf-8", "surrogateescape")
        try:
            value, end = _decoder.raw_decode(window)
        except ValueError:  # incomplete (more to come) or invalid (bounded: then refused)
            if len(buf) >= MAX_OTHER_VALUE_BYTES:
                raise TokenizeError("answer", "/tokenize answer: a member other than tokens is too large or not "
                                              "JSON") from None
            return False
        if end == len(window) and isinstance(value, (int, float)) and not isinstance(value, bool):
            return False  # a number may go on in the next piece
        if self._state == "count" and type(value) is int:
            self.count = value
        del buf[:len(window[:end].encode("utf-8", "surrogateescape"))]
        self._state = "member"
        return True

    def _take_ids(self) -> bool:
        buf = self._buf
        close = buf.find(b"]")
        if close >= 0:
            region = bytes(buf[:close])
        else:
            comma = buf.rfind(b",")
            if comma < 0:
                return False
            region = bytes(buf[:comma + 1])
        need = self.max_ids - len(self.ids)
        ids = self._json_ids(region, need, ended=close >= 0)
        if ids is not None:
            return self._took(ids, ended=close >= 0, region=region)
        parts = region.split(b",", need)
        ended = close >= 0 and len(parts) <= need
        if len(parts) > need:  # enough ids here: the rest of the answer is never looked at
            parts = parts[:need]
        elif close < 0:
            parts.pop()  # the empty piece after the region's last comma
        if not _IDS_ONLY.fullmatch(b",".join(parts)):
            raise TokenizeError("answer", "/tokenize answer: tokens holds something other than decimal ids")
        if ended and len(parts) == 1 and not parts[0].strip(_WS) and not self.ids:
            parts = []  # an empty list
        try:
            ids = list(map(int, parts))
        except ValueError:
            raise TokenizeError("answer", "/tokenize answer: tokens is not a list of ints") from None
        return self._took(ids, ended=ended, region=region)

    def _json_ids(self, region: bytes, need: int, *, ended: bool) -> list[int] | None:
        """The ids of ``region`` (the array's rest up to its ``]``, else up to a comma) read by the C JSON scanner
        in one pass (a 3,000-id answer: about half the time of ``split`` and ``map(int)``), when they are all
        needed and well-formed; None sends the region to the piecewise path, which takes what it can and words
        the error (an id with leading zeros, an empty id, more ids than needed)."""
        body = region if ended else region[:-1]  # a region that does not end the array ends with a comma
        if body.count(b",") >= need or not _IDS_ONLY.fullmatch(body):
            return None  # more ids than needed here (or none at all), or not only decimal ids
        try:
            ids: list[int] = json.loads(b"[" + body + b"]")
        except ValueError:
            return None
        if not ids and not (ended and not self.ids):
            return None  # "[,": an empty id (only an empty array has no ids)
        return ids

    def _took(self, ids: list[int], *, ended: bool, region: bytes) -> bool:
        """Keep ``ids`` (the ids of ``region``, the buffer's head); whether to look at the buffer again."""
        if ids and max(ids) > MAX_ID:
            raise TokenizeError("answer", "/tokenize answer: an id above 2^32 - 1")
        self.ids += ids
        if ended:
            self.done = True
        elif len(self.ids) >= self.max_ids:
            self.done = self.truncated = True
        else:
            del self._buf[:len(region)]
            return True
        self._buf = bytearray()
        return False

