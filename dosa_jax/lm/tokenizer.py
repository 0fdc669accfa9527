"""Byte-level tokenizer: a token is one UTF-8 byte (256 symbols).

No learned merges: every text encodes, the vocabulary is fixed, and "1M tokens"
means 1 MiB of text. Byte 0 separates documents in a stream (see ``corpora``).
"""

from __future__ import annotations

import numpy as np

VOCAB_SIZE = 256


def encode(text: str) -> np.ndarray:
    """UTF-8 bytes of ``text`` as uint8 token ids."""
    return np.frombuffer(text.encode("utf-8"), np.uint8).copy()


def decode(tokens) -> str:
    """Inverse of :func:`encode` (invalid UTF-8 sequences are replaced)."""
    return np.asarray(tokens, np.uint8).tobytes().decode("utf-8", errors="replace")
