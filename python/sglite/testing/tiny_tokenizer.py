"""A tiny byte-level BPE tokenizer with a ChatML template, trained in about a second (no downloads).

Byte-level, so every string round-trips and multi-byte characters span several tokens (which is
what incremental detokenization must get right). Specials: <|endoftext|> (pad), <|im_start|>,
<|im_end|> (eos), ids 0, 1, 2.
"""

from __future__ import annotations

import glob
import os
import sysconfig

TINY_TOKENIZER_VOCAB = 512
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_SAMPLE_TEXT = "The quick brown fox jumps over the lazy dog. Hello world! café naïve 日本語 🙂\n"


def build_tiny_tokenizer(path: str, vocab_size: int = TINY_TOKENIZER_VOCAB, num_corpus_files: int = 20) -> str:
    """Train a byte-level BPE on some stdlib sources and save_pretrained it (with chat template) to path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:num_corpus_files]
    corpus = [_SAMPLE_TEXT] * 50
    for f in files:
        with open(f, encoding="utf-8") as fh:
            corpus.append(fh.read())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML_TEMPLATE
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(path)
    return path
