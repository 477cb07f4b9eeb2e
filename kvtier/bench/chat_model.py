"""A chat-capable random-weight Llama built offline, plus a real tokenizer (no download).

vLLM's OpenAI server needs a tokenizer (and a chat template for /v1/chat/completions), so unlike
the token-id engine tests this model ships a byte-level BPE tokenizer, trained here with the
``tokenizers`` library on generated pseudo-English. Same files for the same code, every time.

The default geometry is the tests' 2-layer toy (``TINY``); ``BENCH`` is a ~100M-parameter Llama
(12 layers, width 768, GQA 12:4, head dim 64) whose prefill costs enough to be worth measuring.
"""

from __future__ import annotations

import random
from pathlib import Path

__all__ = ["BENCH", "CHAT_TEMPLATE", "MAX_LEN", "SPECIAL", "TINY", "VOCAB", "WORDS", "build_chat_model",
           "build_tokenizer", "make_text"]

VOCAB = 1024  # tokenizer and model vocabulary size, tokens
SPECIAL = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: the model config's bos (1) and eos (2)
MAX_LEN = 16384  # the model's max_position_embeddings, tokens

# LlamaConfig geometries for build_chat_model. TINY: the tests' toy (~0.4M parameters).
# BENCH: 12 x (attention 1.57M + MLP 6.49M) + embeddings 1.57M = ~98M parameters, 24 KiB of
# float32 KV per token (12 layers x K and V x 4 heads x 64 dims x 4 bytes).
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2}
BENCH = {"hidden_size": 768, "intermediate_size": 2816, "num_hidden_layers": 12, "num_attention_heads": 12,
         "num_key_value_heads": 4}

# Role markers, content, and "</s>" (the eos id) after each turn; a generation prompt opens the
# assistant's turn. Content must be a string: vLLM then passes message content as text.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

WORDS = (
    "the of and to in is was for on that with as by at from his her they it this are be had an have not but "
    "which one were all their there been has when who will more no if out so said what up its about into than "
    "them can only other new some could time these two may then do first any my now such like our over man "
    "me even most made after also did many before must through back years where much your way well down "
    "should because each just those people how too little state good very make world still own see men work "
    "long get here between both life being under never day same another know while last might us great old "
    "year off come since against go came right used take three small house light water river city garden "
    "morning evening window table letter story music color paper number road train market winter summer "
    "quiet bright green heavy simple careful early late open close begin follow carry answer question"
).split()


def make_text(seed: int, n_words: int) -> str:
    """Deterministic pseudo-English: ``n_words`` words in sentences of 5-14 words."""
    rng = random.Random(seed)
    sentences, left = [], n_words
    while left > 0:
        n = min(left, rng.randint(5, 14))
        words = [rng.choice(WORDS) for _ in range(n)]
        sentences.append(" ".join([words[0].capitalize(), *words[1:]]) + rng.choice(".,.?.!"))
        left -= n
    return " ".join(sentences)


def build_tokenizer(path: Path):
    """Train the byte-level BPE on generated text and save it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=list(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # make_text's few hundred words saturate well before VOCAB merges; made-up words fill the rest.
    rng = random.Random(0)
    syllables = [c + v for c in "bcdfghklmnprstvwz" for v in "aeiou"]
    made_up = " ".join("".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(20000))
    corpus = [make_text(seed, 200) for seed in range(200)] + [" ".join(WORDS), made_up]
    corpus += [f"<|{role}|>\n" for role in ("system", "user", "assistant")]
    tok.train_from_iterator(corpus, trainer)
    assert tok.get_vocab_size() == VOCAB and [tok.token_to_id(t) for t in SPECIAL] == [0, 1, 2]
    # Like Llama's: a completion prompt starts with <s> (a chat prompt gets it from the template).
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   model_max_length=MAX_LEN, chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(path)
    return fast


def build_chat_model(path: Path, hidden_size: int = TINY["hidden_size"],
                     intermediate_size: int = TINY["intermediate_size"],
                     num_hidden_layers: int = TINY["num_hidden_layers"],
                     num_attention_heads: int = TINY["num_attention_heads"],
                     num_key_value_heads: int = TINY["num_key_value_heads"]) -> str:
    """Write the model (random weights, seed 0, float32) and its tokenizer into ``path``; returns it as str.
    The defaults are ``TINY``; ``build_chat_model(path, **BENCH)`` builds the ~100M-parameter one."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, vocab_size=VOCAB, max_position_embeddings=MAX_LEN,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    build_tokenizer(path)
    return str(path)


def main(argv: list[str] | None = None) -> None:
    """``python -m kvtier.bench.chat_model PATH [--size tiny|bench]``: write the model to PATH."""
    import argparse

    parser = argparse.ArgumentParser(description="Write a random-weight Llama with an offline-trained tokenizer "
                                                 "and chat template (no download).")
    parser.add_argument("path", type=Path)
    parser.add_argument("--size", choices=("tiny", "bench"), default="tiny",
                        help="tiny: 2 layers, ~0.4M parameters; bench: 12 layers, ~100M parameters")
    args = parser.parse_args(argv)
    print(build_chat_model(args.path, **(TINY if args.size == "tiny" else BENCH)))


if __name__ == "__main__":
    main()
