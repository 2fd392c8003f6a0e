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
  tokens, as the emulator has always counted a chat. vLLM's chat fields change it as the template and
  the tokenizer would: `add_generation_prompt: false` leaves out the assistant header,
  `continue_final_message: true` leaves the last message open (no `EOT`, no header after it), and
  `add_special_tokens: true` puts a second `BOS` in front (the tokenizer's, beside the template's).
- Each token has a text (`/tokenize`'s `token_strs`): its chunk for text, the role or "\\n\\n" for
  the framing's, and Llama 3's names for the special ones (`SPECIAL_TEXT`); `token_id` maps a token's
  text back to its id.
- Every generated token is `GENERATED` (the chunk id of " tok", the text the emulator answers with),
  so a follow-up prompt that carries an answer's text back gets the ids the answer had.

`xpyd bench` writes prompts of four-character words, one block of text per 512-token block of a
Mooncake trace (`xpyd.bench.load`): equal `hash_ids` give equal text, so equal token ids, so equal
block hashes, and an emulated engine finds in its prefix cache exactly the blocks the trace says repeat.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, TypeVar

T = TypeVar("T")

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


def text_strs(text: str) -> list[str]:
    """A text's tokens as texts: its chunks of four characters (none for an empty text)."""
    return [text[start:start + CHARS_PER_TOKEN] for start in range(0, len(text), CHARS_PER_TOKEN)]


def text_ids(text: str) -> list[int]:
    """A text's token ids: one per chunk (`text_strs`)."""
    return [chunk_id(chunk) for chunk in text_strs(text)]


def prompt_ids(text: str) -> list[int]:
    """A completion prompt's token ids: its text's, or `BOS` alone for an empty one."""
    return text_ids(text) or [BOS]


@dataclass(frozen=True)
class ChatFlags:
    """vLLM's chat fields that change a chat's tokens (`ChatCompletionRequest`'s and `TokenizeChatRequest`'s
    defaults)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False


def _frame(messages: list[tuple[str, str]], flags: ChatFlags, text: Callable[[str], list[T]],
           one: Callable[[str], T], special: Callable[[int], T]) -> list[T]:
    """A chat's tokens, framed as Llama 3's template frames them: `text` makes a content's tokens, `one`
    the single token of a role or of "\\n\\n", `special` a special token's."""
    out = [special(BOS)] * (2 if flags.add_special_tokens else 1)
    last = len(messages) - 1
    for position, (role, content) in enumerate(messages):
        out += (special(START_HEADER), one(role), special(END_HEADER), one("\n\n"))
        out += text(content)
        if not (flags.continue_final_message and position == last):
            out.append(special(EOT))
    if flags.add_generation_prompt and not flags.continue_final_message:
        out += (special(START_HEADER), one("assistant"), special(END_HEADER), one("\n\n"))
    return out


def chat_ids(messages: list[tuple[str, str]], flags: ChatFlags = ChatFlags()) -> list[int]:
    """A chat's token ids from its (role, text) messages, framed as Llama 3's template frames them."""
    return _frame(messages, flags, text_ids, chunk_id, int)


SPECIAL_TEXT: Final = {BOS: "<|begin_of_text|>", START_HEADER: "<|start_header_id|>",
                       END_HEADER: "<|end_header_id|>", EOT: "<|eot_id|>"}
"""The special tokens' texts (Llama 3's)."""
_SPECIAL_IDS: Final = {text: token for token, text in SPECIAL_TEXT.items()}


def prompt_strs(text: str) -> list[str]:
    """`prompt_ids`' tokens as texts."""
    return text_strs(text) or [SPECIAL_TEXT[BOS]]


def chat_strs(messages: list[tuple[str, str]], flags: ChatFlags = ChatFlags()) -> list[str]:
    """`chat_ids`' tokens as texts."""
    return _frame(messages, flags, text_strs, str, SPECIAL_TEXT.__getitem__)


def token_id(text: str) -> int:
    """The id of a token given as its text (a special token's name, else a chunk's id)."""
    special = _SPECIAL_IDS.get(text)
    return chunk_id(text) if special is None else special
