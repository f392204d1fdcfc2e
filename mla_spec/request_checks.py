"""Checks of a request: what it may hold (when added) and when it ends (as tokens come).

A request that reaches a step must not be able to fail it, so ``max_new_tokens``, ``stop`` and
the prompt (token ids in the vocabulary, within ``max_position_embeddings``) are checked when
added (:class:`RequestRejectedError`). :func:`commit_tokens` ends a request on eos,
``max_new_tokens`` or a stop string.
"""

import numbers
import operator
import time
import warnings
from collections.abc import Callable, Sequence

from mla_spec.scheduler import Req, RequestRejectedError

__all__ = ["check_max_new_tokens", "check_stop", "prompt_token_ids", "commit_tokens"]


def check_max_new_tokens(n) -> int:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"max_new_tokens {n!r} ({type(n).__name__}): must be an int >= 1")
    if n < 1:
        raise ValueError(f"max_new_tokens {n}: must be >= 1")
    return int(n)


def check_stop(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, Sequence) or not all(isinstance(s, str) for s in stops):
        raise TypeError(f"stop {stop!r}: must be None, a str or a list of str")
    if any(s == "" for s in stops):
        raise ValueError(f"stop = {list(stops)!r}: an empty stop string matches at once; "
                         "stop strings must be non-empty")
    return tuple(stops)


def prompt_token_ids(prompt, tokenizer, vocab_size: int | None,
                     max_positions: int | None, max_new_tokens: int) -> list[int]:
    """The prompt's token ids, checked (see the module docstring)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestRejectedError("text prompts need a tokenizer (tokenizer.json in the "
                                       "model folder or tokenizer=); or pass token ids")
        prompt = tokenizer.encode(prompt).ids
    prompt = prompt.tolist() if hasattr(prompt, "tolist") else prompt  # tensors, arrays
    if not isinstance(prompt, Sequence):
        raise RequestRejectedError(f"prompt {prompt!r}: must be a str or a sequence of int "
                                   "token ids")
    ids = []
    for i, t in enumerate(prompt):
        try:
            if isinstance(t, bool):
                raise TypeError
            ids.append(operator.index(t))
        except TypeError:
            raise RequestRejectedError(f"prompt token {i} is {t!r} ({type(t).__name__}): "
                                       "token ids are ints") from None
        if vocab_size is not None and not 0 <= ids[-1] < vocab_size:
            raise RequestRejectedError(f"prompt token {i} is {ids[-1]}: outside the vocabulary "
                                       f"(ids 0..{vocab_size - 1})")
    if max_positions is not None:
        if len(ids) > max_positions:
            raise RequestRejectedError(
                f"prompt of {len(ids)} tokens: the model has {max_positions} positions "
                f"(max_position_embeddings); shorten it to at most {max_positions} tokens")
        if len(ids) + max_new_tokens > max_positions:
            warnings.warn(f"a request may generate past max_position_embeddings "
                          f"({max_positions}): positions the model was not trained on",
                          RuntimeWarning, stacklevel=3)
    return ids


def commit_tokens(req: Req, toks: list[int], decode_text: Callable[[list[int]], str]
                  ) -> tuple[int, str | None]:
    """Append new tokens to ``req`` -> (tokens kept, finish reason or None).

    Committed one at a time as plain decoding would: the request ends at the first eos,
    max_new_tokens or stop string; later accepted tokens are dropped (outputs equal spec off)."""
    start = len(req.output_ids)
    if req.metrics.first_token_time is None:
        req.metrics.first_token_time = time.perf_counter()
    reason = None
    for t in toks:
        if req.remaining <= 0:
            break
        req.output_ids.append(int(t))
        if t in req.stop_token_ids:
            reason = "eos"
            break
    if reason is None and req.remaining <= 0:
        reason = "length"
    n = len(req.output_ids)

    def text(end: int, why: str | None) -> str:  # output_ids[:end], without a final eos
        return decode_text(req.output_ids[: end - 1 if why == "eos" else end])

    if req.stop:  # the first new token whose text (as plain decoding saw it) has a stop string
        txt = req.text
        for end in range(start + 1, n + 1):
            txt = text(end, reason if end == n else None)
            cut = [i for i in (txt.find(s) for s in req.stop) if i >= 0]
            if cut:
                del req.output_ids[end:]
                txt, reason = txt[: min(cut)], "stop"
                break
        req.text = txt
    elif reason is not None:
        req.text = text(n, reason)
    req.metrics.completion_tokens = len(req.output_ids)
    return len(req.output_ids) - start, reason
