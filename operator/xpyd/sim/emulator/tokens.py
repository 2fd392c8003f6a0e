"""The emulator's token ids: what it hashes into prefix-cache blocks, without a tokenizer.

- A prompt of token ids is taken as it is.
- Text is cut into chunks of four characters (the last may be shorter); each chunk is one token whose
  id is `chunk_id(chunk)`: the first 8 bytes of the chunk's UTF-8 BLAKE2b digest, big-endian, modulo
  `TEXT_VOCAB` (128,000, Llama 3's regular vocabulary, below its special tokens). The same text gives
  the same ids in every process and on every engine, so texts that share a prefix of whole chunks share
  those tokens; distinct chunks may rarely share an id, as distinct words never do in a real vocabulary.
  An empty text is one token, `BOS`.
- A chat prompt is framed as Llama 3's chat template frames it, with fixed ids for its special tokens:
  `BOS`, then per message `START_HEADER`, the role (its text's `chunk_id`), `END_HEADER`, the chunk id
  of "\\n\\n", the content's tokens and `EOT`; then the assistant header `START_HEADER`,
  chunk_id("assistant"), `END_HEADER`, chunk_id("\\n\\n"). That is 1 + per message (5 + content) + 4
  tokens, as the emulator has always counted a chat.
- Every generated token is `GENERATED` (the chunk id of " tok", the text the emulator answers with),
  so a follow-up prompt that carries an answer's text back gets the ids the answer had.

`xpyd bench` writes prompts of four-character words, one block of text per 512-token block of a
Mooncake trace (`xpyd.bench.load`): equal `hash_ids` give equal text, so equal token ids, so equal
block hashes, and an emulated engine finds in its prefix cache exactly the blocks the trace says repeat.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Final

CHARS_PER_TOKEN: Final = 4
TEXT_VOCAB: Final = 128_000
"""Text tokens take ids below this (Llama 3's regular vocabulary; 128,000 and up are special)."""
BOS: Final = 128_000          # <|begin_of_text|>
START_HEADER: Final = 128_006  # <|start_header_id|>
END_HEADER: Final = 128_007    # <|end_header_id|>
EOT: Final = 128_009           # <|eot_id|>
GENERATED_TEXT: Final = " tok"


@functools.lru_cache(maxsize=1 << 16)
def chunk_id(chunk: str) -> int:
    """The token id of a chunk of text (see the module docstring)."""
    digest = hashlib.blake2b(chunk.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % TEXT_VOCAB


GENERATED: Final = chunk_id(GENERATED_TEXT)
NEWLINES: Final = chunk_id("\n\n")


def text_ids(text: str) -> list[int]:
    """A text's token ids: one per four characters (none for an empty text)."""
    return [chunk_id(text[start:start + CHARS_PER_TOKEN]) for start in range(0, len(text), CHARS_PER_TOKEN)]


def prompt_ids(text: str) -> list[int]:
    """A completion prompt's token ids: its text's, or `BOS` alone for an empty one."""
    return text_ids(text) or [BOS]


def chat_ids(messages: list[tuple[str, str]]) -> list[int]:
    """A chat's token ids from its (role, text) messages, framed as Llama 3's template frames them."""
    ids = [BOS]
    for role, text in messages:
        ids += (START_HEADER, chunk_id(role), END_HEADER, NEWLINES)
        ids += text_ids(text)
        ids.append(EOT)
    ids += (START_HEADER, chunk_id("assistant"), END_HEADER, NEWLINES)
    return ids
