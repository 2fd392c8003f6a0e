"""Build the tiny Llama the real-vLLM tests serve, deterministically and without a model hub.

    python tiny_model.py OUT_DIR

writes a Hugging Face model directory vLLM loads: config.json, model.safetensors (seeded random
weights), a byte-level BPE tokenizer trained here on seeded text (tokenizer.json,
tokenizer_config.json with a chat template) and generation_config.json. The same script gives the
same bytes on every machine: the weights come from one seeded generator, the tokenizer from one
seeded corpus, and the JSON is written with sorted keys.

The tokenizer makes every word of `WORDS` one token with its leading space, as in real BPE
vocabularies; `xpyd bench` builds its prompts from such words (`xpyd.bench.load.PROMPT_WORDS`, a
subset of these: tests/unit/test_tiny_model.py keeps them so), so a prompt of N words is N tokens
for this model too.

Runs with the vLLM environment's Python (numpy, safetensors and tokenizers are vLLM's own
dependencies); imports them only in `build`, so the word list can be read without them.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

SEED = 20261203
#: The architecture: small enough to load in seconds on a CPU, large enough to be a real Llama
#: (grouped-query attention: 4 query heads share 2 KV heads).
HIDDEN = 256
LAYERS = 2
HEADS = 4
KV_HEADS = 2
INTERMEDIATE = 512
VOCAB = 1024
MAX_POSITIONS = 4096
#: The output layer's weight scale (see build_weights).
LOGIT_STD = 0.5
SPECIAL = ("<s>", "</s>", "<unk>")
#: One-token words (with their leading space). Includes every word `xpyd bench` writes prompts from.
_WORD_TEXT = (
    "the and for are but not you all any can had her was one our out day get has him his how man new now "
    "old see two way who did its let put say she too use "
    "pod node cache model serve token block route scale queue load time rate fast slow user chat text "
    "data run job step test good bad long short last first next pair role leak high low")
WORDS = tuple(f" {w}" for w in _WORD_TEXT.split())
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|> ' + message['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}"
)


def corpus(lines: int = 4000, words_per_line: int = 24) -> list[str]:
    """Seeded text over `WORDS` with some punctuation and digits (so every byte merges somewhere)."""
    rng = random.Random(SEED)
    extra = (".", ",", "?", "!", " 0", " 1", " 2", " 3", " 42", " 128", "\n", " <|user|>", " <|assistant|>")
    return ["".join(rng.choice(WORDS) if rng.random() < 0.9 else rng.choice(extra)
                    for _ in range(words_per_line)) for _ in range(lines)]


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def build_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=list(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    multi = [w for w in WORDS if len(tokenizer.encode(w).ids) != 1]
    if multi:
        raise SystemExit(f"tiny model: these words are not one token each: {multi}")
    tokenizer.save(str(out / "tokenizer.json"))
    write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "add_bos_token": False, "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE,
    })
    write_json(out / "special_tokens_map.json", {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    return int(tokenizer.get_vocab_size())


def build_weights(out: Path, vocab: int) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(SEED)
    head_dim = HIDDEN // HEADS

    def normal(*shape: int, std: float = 0.02) -> Any:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    # A wide output layer makes the logits peaked (std about 8 over the vocabulary), so greedy decoding
    # does not flip between near-equal tokens on rounding: a decode engine that loaded the KV from a
    # prefill engine then writes exactly what one engine alone writes, which the tests compare.
    tensors = {"model.embed_tokens.weight": normal(vocab, HIDDEN), "model.norm.weight": np.ones(HIDDEN, np.float32),
               "lm_head.weight": normal(vocab, HIDDEN, std=LOGIT_STD)}
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}"
        tensors |= {
            f"{prefix}.input_layernorm.weight": np.ones(HIDDEN, np.float32),
            f"{prefix}.post_attention_layernorm.weight": np.ones(HIDDEN, np.float32),
            f"{prefix}.self_attn.q_proj.weight": normal(HEADS * head_dim, HIDDEN),
            f"{prefix}.self_attn.k_proj.weight": normal(KV_HEADS * head_dim, HIDDEN),
            f"{prefix}.self_attn.v_proj.weight": normal(KV_HEADS * head_dim, HIDDEN),
            f"{prefix}.self_attn.o_proj.weight": normal(HIDDEN, HEADS * head_dim),
            f"{prefix}.mlp.gate_proj.weight": normal(INTERMEDIATE, HIDDEN),
            f"{prefix}.mlp.up_proj.weight": normal(INTERMEDIATE, HIDDEN),
            f"{prefix}.mlp.down_proj.weight": normal(HIDDEN, INTERMEDIATE),
        }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_json(out / "config.json", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": head_dim, "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "vocab_size": vocab, "tie_word_embeddings": False, "torch_dtype": "float32",
        "bos_token_id": SPECIAL.index("<s>"), "eos_token_id": SPECIAL.index("</s>"),
    })
    write_json(out / "generation_config.json", {"bos_token_id": SPECIAL.index("<s>"),
                                                "eos_token_id": SPECIAL.index("</s>")})


def build(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    build_weights(out, build_tokenizer(out))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: tiny_model.py OUT_DIR")
    build(Path(sys.argv[1]))
