"""A token id's own bytes, as OpenAI's logprobs ``bytes`` field gives them.

Decoding one token alone loses bytes: a byte-level BPE token may hold half a UTF-8 character.
So the bytes come from the vocabulary entry: byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM) maps
each byte to a printable character (``bytes_to_unicode``); SentencePiece writes a space as "▁"
and a lone byte as ``<0xNN>``. Special tokens are their text. Anything else: ``decode([id])``.
"""

from __future__ import annotations

import functools
from typing import Any


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: printable character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


class TokenBytes:
    """``TokenBytes(tokenizer)(id) -> bytes``, memoised per id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.byte_level = _byte_level(tokenizer)
        self.special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.memo: dict[int, bytes] = {}

    def __call__(self, token: int) -> bytes:
        got = self.memo.get(token)
        if got is None:
            got = self.memo[token] = self._bytes(token)
        return got

    def _bytes(self, token: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if not isinstance(piece, str):
            return b""
        if token in self.special:
            return piece.encode()
        if self.byte_level:
            table = _byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
            return bytes([int(piece[3:5], 16)])
        if "▁" in piece:
            return piece.replace("▁", " ").encode()
        return str(self.tokenizer.decode([token])).encode()
