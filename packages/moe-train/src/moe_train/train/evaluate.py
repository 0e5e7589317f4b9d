"""Held-out evaluation: the mean token loss over the same eval batches every time.

Eval batch i holds sequences ``i * global_batch_size ...`` of the eval data in order (wrapping
around), cut into micro-batches exactly as a training batch is, so every layout evaluates the
same micro-batches and expert-parallel ranks run the same number of them (with the training
micro-batch size, capacity-bounded dispatch drops as it would in training). Forward only, in
the compute dtype, with attention kept inside documents when training keeps it there
(data.document_masking). Evaluation leaves training untouched: the model is put in eval mode (no
routing statistics are recorded), and the RNG state (random routing draws from it) is
restored afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from moe_data import TokenDataset, trained_targets
from moe_plan.config import Config
from moe_train.errors import DataError
from moe_train.model import Documents, head_lm_loss
from moe_train.train.micro_batches import model_inputs
from moe_train.train.runtime import Runtime
from moe_train.train.step import StepRunner


@contextmanager
def eval_mode_keeping_rng(model: torch.nn.Module) -> Iterator[None]:
    """`model` in eval mode for the block; afterwards back in training mode, with the RNG state
    of the CPU and of every CUDA device as it was before (random routing draws from it)."""
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    model.eval()
    try:
        yield
    finally:
        model.train()
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


class Evaluator:
    """Computes `eval_loss` on this rank's share of the eval batches (collective)."""

    def __init__(self, config: Config, runner: StepRunner, runtime: Runtime) -> None:
        self.config, self.runner, self.runtime = config, runner, runtime
        data, evaluation = config.data, config.eval
        cache_dir = Path(data.cache_dir) if data.cache_dir else None
        self.dataset = TokenDataset(
            evaluation.paths,
            data.seq_len,
            cache_dir=cache_dir,
            label_mask=data.label_mask,
            split_long_examples=data.split_long_examples,
        )
        if self.dataset.vocab_size > config.model.vocab_size:
            raise DataError(
                f"eval.paths hold token ids up to {self.dataset.vocab_size - 1} but "
                f"model.vocab_size={config.model.vocab_size}; the eval data must come from the "
                f"training data's tokenizer"
            )

    def batch(self, index: int) -> Tensor:
        """Eval batch `index`: the next global_batch_size sequences in order, wrapping."""
        size = self.config.data.global_batch_size
        rows = [
            self.dataset.sequence((index * size + row) % self.dataset.num_sequences)
            for row in range(size)
        ]
        return torch.from_numpy(np.stack(rows))

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean token loss over eval.batches global batches (the same on every rank); with
        data.label_mask, the mean over the trained targets of all of them."""
        runner, model = self.runner, self.runner.model
        masked = self.config.data.label_mask
        # With a mask, micro-batch losses are sums (normalizer 1) and the targets are counted.
        # Under context parallelism each rank's loss is its part of the micro-batch mean.
        normalizer = torch.ones((), device=self.runtime.device) if masked else None
        if not masked and self.runtime.layout.cp > 1:
            data = self.config.data
            normalizer = torch.tensor(
                float(data.micro_batch_size * data.seq_len), device=self.runtime.device
            )
        totals = torch.zeros(2, dtype=torch.float64, device=self.runtime.device)
        with eval_mode_keeping_rng(model):
            for index in range(self.config.eval.batches):
                for micro, documents in runner.my_micro_batches(self.batch(index)):
                    totals[0] += self._micro_loss(micro, documents, normalizer)
                    if masked:
                        totals[1] += trained_targets(micro)
        loss_sum, trained = self.runtime.sum_over_world(totals).tolist()
        if masked:  # the pp and cp ranks of a data-parallel rank count the same rows
            layout = self.runtime.layout
            return loss_sum / max(trained / (layout.pp * layout.cp), 1.0)
        return loss_sum / (runner.num_micro * self.config.eval.batches)

    def _micro_loss(
        self, micro: Tensor, documents: Documents | None, normalizer: Tensor | None
    ) -> Tensor:
        """The LM loss of one micro-batch [mbs, seq + 1] (0 on ranks without the head), with
        attention inside its `documents` as in training; with `normalizer`, it carries a
        label mask (see `head_lm_loss`)."""
        runner = self.runner
        inputs, targets = model_inputs(micro, normalizer is not None, runner.context)
        if runner.pipeline is None:
            with runner.autocast():
                return runner.model(
                    inputs, targets_BS=targets, documents=documents, loss_normalizer=normalizer
                ).double()
        return _pipeline_micro_loss(runner, inputs, targets, normalizer, documents)


def _pipeline_micro_loss(
    runner: StepRunner,
    inputs: Tensor,
    targets: Tensor,
    normalizer: Tensor | None,
    documents: Documents | None,
) -> Tensor:
    """The LM loss of one micro-batch run through the pipeline (0 on ranks without the last
    stage)."""
    normed = pipeline_forward(runner, inputs, documents)
    if normed is None:
        return torch.zeros((), dtype=torch.float64, device=inputs.device)
    with runner.autocast():
        return head_lm_loss(normed, runner.model.head.weight, targets, normalizer).double()


def pipeline_forward(
    runner: StepRunner, inputs: Tensor, documents: Documents | None
) -> Tensor | None:
    """Forward of one micro-batch through the pipeline stages in order, hidden states passed
    from stage to stage by point-to-point sends (every rank of a pipeline walks the same
    stage sequence, so each send meets its receive): the normed output of the last stage on
    the rank holding it, None elsewhere. With multi-token prediction the stages also pass the
    token embeddings on, as in training; the MTP modules do not run (the loss is the head's)."""
    pipeline, layout = runner.pipeline, runner.runtime.layout
    plan = pipeline.plan
    modules = {stage: s.submod for stage, s in zip(plan.stages, pipeline.stages, strict=True)}
    carried = 2 if runner.config.model.mtp_depth else 1  # hidden states (and embeddings)
    hidden_shape = (*inputs.shape, runner.config.model.d_model)
    passed: list[Tensor] = []
    for stage in range(plan.num_stages):
        if stage not in modules:
            continue
        previous = dist.get_global_rank(layout.pp_group, (stage - 1) % layout.pp)
        if stage > 0 and previous != layout.rank:
            passed = [
                torch.empty(hidden_shape, dtype=runner.param_dtype, device=inputs.device)
                for _ in range(carried)
            ]
            for tensor in passed:
                dist.recv(tensor, src=previous)
        modules[stage].expect([documents] if documents is not None else None)
        output = modules[stage](*(passed if stage > 0 else [inputs.contiguous()]))
        passed = [t.contiguous() for t in (output if isinstance(output, tuple) else [output])]
        if stage == plan.num_stages - 1:
            if carried == 1:
                return passed[0]
            with runner.autocast():
                return modules[stage].head[0](passed[0])  # the final norm MTP stages leave
        following = dist.get_global_rank(layout.pp_group, (stage + 1) % layout.pp)
        if following != layout.rank:
            for tensor in passed:
                dist.send(tensor, dst=following)
    return None
