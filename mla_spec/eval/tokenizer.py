"""A small word-level tokenizer for the synthetic task, saved as a Hugging Face ``tokenizer.json``.

Why not BPE: arithmetic is learnable only when every number is spelled digit by digit, and the
task's vocabulary is closed (template words, names, objects), so a word-level vocabulary of a few
hundred entries is enough and keeps the embedding and ``lm_head`` tiny.

Pre-tokenization (``tokenizers`` pipeline, decoded exactly back to the text):

1. newline runs are their own tokens (``"\\n"``, ``"\\n\\n"``: the blank line between shots);
2. Metaspace: a space becomes ``"▁"`` glued to the next word (``" apples"`` -> ``"▁apples"``);
3. each digit is its own token, the first one of a number carrying the space
   (``" 19"`` -> ``"▁1"``, ``"9"``);
4. ``. , ? ! : ;`` are split off words (``"apples."`` -> ``"▁apples"``, ``"."``).

Special tokens: ``<bos>`` = 0 (prepended by the post-processor, as DeepSeek's tokenizer adds
BOS), ``<eos>`` = 1, ``<pad>`` = 2, ``<unk>`` = 3, matching ``config.json``'s
``bos_token_id`` / ``eos_token_id``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

__all__ = ["SPECIAL_TOKENS", "build_tokenizer", "load_tokenizer"]

SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>", "<unk>")


def _pipeline(tok: Tokenizer) -> None:
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\n+"), behavior="isolated"),
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True),
        pre_tokenizers.Split(Regex(r"▁?\d"), behavior="isolated"),
        pre_tokenizers.Split(Regex(r"[.,?!:;]"), behavior="isolated"),
    ])
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="never", split=True)


def build_tokenizer(texts: Iterable[str], vocab_size: int = 512,
                    words: Iterable[str] = ()) -> Tokenizer:
    """Train the word-level vocabulary (at most ``vocab_size`` entries, special tokens
    included) on ``texts``; every digit and every one of ``words`` (``gsm_synth``'s
    ``vocabulary_words()``, in their ``"▁word"`` form) is in it. ``encode(text).ids`` starts
    with ``<bos>``."""
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    _pipeline(tok)
    digits = " ".join(f"{d} {d}{d}" for d in range(10))  # "▁d" and "d" forms
    trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, min_frequency=1,
                                        special_tokens=list(SPECIAL_TOKENS))
    listed = " " + " ".join(words)  # a leading space: every word in its "▁word" form
    tok.train_from_iterator([digits, listed, *texts], trainer=trainer)
    bos = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                       special_tokens=[("<bos>", bos)])
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load ``tokenizer.json`` from a file or a model folder."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.exists():
        raise FileNotFoundError(f"no tokenizer.json at {p}")
    return Tokenizer.from_file(str(p))
