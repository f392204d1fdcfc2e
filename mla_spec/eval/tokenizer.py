"""A small word-level tokenizer for the synthetic task, saved as a Hugging Face ``tokenizer.json``.

Not BPE: arithmetic is learnable only when numbers are spelled digit by digit, and the closed
vocabulary (template words, names, objects) fits in a few hundred entries (a tiny ``lm_head``).
Pre-tokenization, decoded exactly back to the text: newline runs are tokens (``"\\n\\n"`` between
shots); a space becomes ``"▁"`` glued to the next word (Metaspace); each digit is a token, the
first of a number carrying the space (``" 19"`` -> ``"▁1"``, ``"9"``); ``. , ? ! : ;`` are split
off. Special tokens ``<bos>`` 0 (prepended, as DeepSeek's tokenizer does), ``<eos>`` 1, ``<pad>``
2, ``<unk>`` 3 match ``config.json``'s ``bos_token_id`` / ``eos_token_id``.
"""

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
