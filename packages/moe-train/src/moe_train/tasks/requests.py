"""Scoring requests: the token rows whose log-likelihoods a task's metrics need.

A request is one forward row: its tokens (inputs are all but the last, targets all but the
first) and how many of its last targets are scored. Tokens are cut as lm-evaluation-harness
cuts them, so an exported model scored there sees the same rows:

- a choice: trailing whitespace of the context moves to the front of the continuation, the
  whole text is encoded and the continuation is what follows the context's own tokens; an
  empty context is the end-of-document token; the row keeps its last `seq_len + 1` tokens;
- a text document: the end-of-document token, then the document's tokens, scored every one
  in windows of up to `seq_len` targets, each window's inputs the `seq_len` tokens before
  its last target (lm-eval's rolling windows with a context of one token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from moe_data import Tokenizer
from moe_train.tasks.files import MultipleChoiceTask, TextTask


@dataclass(frozen=True)
class Request:
    tokens: tuple[int, ...]
    """The row: inputs `tokens[:-1]`, targets `tokens[1:]`."""
    scored: int
    """How many of the last targets the log-likelihood sums."""


def choice_requests(task: MultipleChoiceTask, tokenizer: Tokenizer, seq_len: int) -> list[Request]:
    """One request per choice, row after row (row 0's choices first)."""
    return [
        _continuation(row.context, choice, tokenizer, seq_len)
        for row in task.rows
        for choice in row.choices
    ]


def text_requests(task: TextTask, tokenizer: Tokenizer, seq_len: int) -> list[Request]:
    """The windows of every document, in order."""
    requests = []
    for document in task.documents:
        stream = [tokenizer.eos_id, *_ids(tokenizer.encode(document))]
        for first in range(1, len(stream), seq_len):
            last = min(first + seq_len, len(stream))
            start = max(0, last - seq_len - 1)
            requests.append(Request(tuple(stream[start:last]), last - first))
    return requests


def text_bytes(task: TextTask) -> int:
    """UTF-8 bytes of the task's documents: what bits per byte divides by."""
    return sum(len(document.encode("utf-8")) for document in task.documents)


def _continuation(context: str, continuation: str, tokenizer: Tokenizer, seq_len: int) -> Request:
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = _ids(tokenizer.encode(context + continuation))
    context_ids = _ids(tokenizer.encode(context)) if context else []
    continuation_ids = whole[len(context_ids) :]
    if not context_ids:
        context_ids = [tokenizer.eos_id]
    tokens = (context_ids + continuation_ids)[-(seq_len + 1) :]
    return Request(tuple(tokens), min(len(continuation_ids), len(tokens) - 1))


def _ids(array: np.ndarray | Sequence[int]) -> list[int]:
    return [int(i) for i in array]
