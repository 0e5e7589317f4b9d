"""A task's figures from its requests' log-likelihoods, as lm-evaluation-harness defines them.

- `acc`: the share of rows whose choice of highest log-likelihood is the gold one;
- `acc_norm`: the same with each log-likelihood divided by its choice's length in
  characters (`len` of the choice's string);
- `bits_per_byte`: the negative log2-likelihood of every token of the text over its UTF-8
  bytes.

Ties go to the first choice (numpy's argmax), as in lm-eval.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from moe_train.tasks.files import MultipleChoiceTask, TextTask
from moe_train.tasks.requests import text_bytes


def choice_predictions(
    task: MultipleChoiceTask, loglikelihoods: Sequence[float]
) -> tuple[list[int], list[int]]:
    """Per row, the chosen index by raw and by length-normalised log-likelihood."""
    chosen, chosen_norm = [], []
    position = 0
    for row in task.rows:
        lls = np.asarray(loglikelihoods[position : position + len(row.choices)], dtype=np.float64)
        position += len(row.choices)
        lengths = np.asarray([float(len(choice)) for choice in row.choices])
        chosen.append(int(np.argmax(lls)))
        chosen_norm.append(int(np.argmax(lls / lengths)))
    return chosen, chosen_norm


def choice_metrics(task: MultipleChoiceTask, loglikelihoods: Sequence[float]) -> dict[str, float]:
    """`acc` and `acc_norm` of the task."""
    chosen, chosen_norm = choice_predictions(task, loglikelihoods)
    golds = [row.gold for row in task.rows]
    rows = len(golds)
    return {
        "acc": sum(c == g for c, g in zip(chosen, golds, strict=True)) / rows,
        "acc_norm": sum(c == g for c, g in zip(chosen_norm, golds, strict=True)) / rows,
    }


def text_metrics(task: TextTask, loglikelihoods: Sequence[float]) -> dict[str, float]:
    """`bits_per_byte` of the task."""
    return {"bits_per_byte": -math.fsum(loglikelihoods) / math.log(2) / text_bytes(task)}
