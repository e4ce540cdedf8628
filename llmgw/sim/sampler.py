"""Deterministic "model output": the tokens a simulated request generates.

The whole output is drawn once, when the request is admitted, from a PRNG seeded
with the simulator's ``--seed``, the request's ``seed`` and a checksum of the
prompt ids. So the same prompt and seeds give the same text on every run and
every replica, and no per-token Python work is spent on sampling. The text is
lower-case words (one byte token each character), so every id is valid in the
tokenizer; unless ``ignore_eos`` is set, the output ends with EOS after a
"natural" length drawn from ``output_range``.
"""

from __future__ import annotations

import random
import zlib
from array import array
from dataclasses import dataclass

from .tokenizer import BYTE_OFFSET, EOS_ID

_WORDS = (
    "the of and to in is that it was for on are as with his they at be this from have or by one had not but "
    "what all were when we there can an your which their said if do will each about how up out them then she "
    "many some so these would other into has more her two like him see time could no make than first been its "
    "who now people my made over did down only way find use may water long little very after words called just "
    "where most know get through back much go good new write our me man too any day same right look think also "
    "around another came come work three must because does part even place well such here take why help put "
    "different away again off went old number great tell men say small every found still between name should "
    "home big give air line set own under read last never us left end along while might next sound below saw "
    "something thought both few those always show large often together asked house world going want school "
    "important until form food keep children feet land side without boy once animal life enough took four head "
    "above kind began almost live page got earth need far hand high year mother light country father let night "
    "picture being study second soon story since white ever paper hard near sentence better best across during "
    "today however sure knew try told young sun thing whole hear example heard several change answer room sea "
    "against top turned learn point city play toward five himself usually money seen car morning"
).split()
_WORD_IDS = [[BYTE_OFFSET + b for b in (" " + w).encode()] for w in _WORDS]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What a request asks of generation (the parts the simulator honours)."""

    max_tokens: int
    min_tokens: int = 0
    ignore_eos: bool = False
    seed: int | None = None


def prompt_checksum(prompt_ids: list[int]) -> int:
    """A cheap, stable 32-bit checksum of the prompt ids."""
    return zlib.crc32(array("I", prompt_ids).tobytes())


def output_tokens(prompt_ids: list[int], params: SamplingParams, *, engine_seed: int,
                  output_range: tuple[int, int]) -> list[int]:
    """The full output of a request: at most ``max_tokens`` ids, the last one EOS if it stopped naturally."""
    rng = random.Random((engine_seed & 0xFFFFFFFF) << 64 | ((params.seed or 0) & 0xFFFFFFFF) << 32
                        | prompt_checksum(prompt_ids))
    low, high = output_range
    natural = max(rng.randint(low, high), params.min_tokens + 1)
    stops = not params.ignore_eos and natural <= params.max_tokens
    length = natural if stops else params.max_tokens
    text_len = length - 1 if stops else length
    out: list[int] = []
    while len(out) < text_len:
        for word in rng.choices(_WORD_IDS, k=max(1, (text_len - len(out)) // 4 + 1)):
            out.extend(word)
    del out[text_len:]
    if stops:
        out.append(EOS_ID)
    return out
