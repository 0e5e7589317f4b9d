"""Pipeline parallelism: the layers split into stages over the pp ranks.

Built on `torch.distributed.pipelining` (GPipe, 1F1B, interleaved 1F1B). Stage `s` of
`pp * virtual_stages` holds an equal run of consecutive layers and lives on pp rank
`s % pp` (the loop placement interleaved schedules expect); the embedding belongs to stage 0
and the final norm and head to the last stage. Each pp rank holds one `Transformer` cut down
to its stages' layers (`apply_pipeline_split` on the meta-device model: parameter names stay
global), and one `StageModule` per stage runs its part; the last stage ends with the final
norm, and the schedule's loss function applies the head fused with the loss
(`head_lm_loss`). The MoE auxiliary losses need nothing from the schedule: they enter the
backward inside their own stage (see `Transformer.set_aux_loss_scale`). With MTP modules
(model.mtp_depth), which run on the last stage, the stages also pass the first stage's
token embeddings along with the hidden states (the modules read them; their gradients
travel back to the embedding), and the last stage hands the loss function its output before
the final norm, which the main loss and the MTP loss both start from.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from moe_parallel import Layout
from moe_plan.config import Config, StagePlan
from moe_train.model import Documents, Transformer, head_lm_loss
from moe_train.parallelize import context_shard
from moe_train.train.micro_batches import MicroBatches, model_inputs


class StageModule(nn.Module):
    """One pipeline stage: runs its layers (after the embedding on the first; with the final
    norm on the last, whose output the loss function takes to the head)."""

    def __init__(
        self,
        model: Transformer,
        layers: tuple[int, ...],
        *,
        first: bool,
        last: bool,
        autocast: Callable[[], contextlib.AbstractContextManager],
    ) -> None:
        super().__init__()
        # The stage shares the rank's Transformer; registering its parts keeps
        # `parameters()` of the stage to exactly what the stage computes with.
        self.blocks = nn.ModuleList(model.blocks[str(i)] for i in layers)
        self.embed = model.embed if first else None
        self.head = nn.ModuleList([model.norm, model.head]) if last else None
        self.mtp = model.mtp if last else None
        self._norm = model.norm
        self._with_embeddings = model.config.mtp_depth > 0
        self._run = model.run_layers
        self._layer_names = [str(i) for i in layers]
        self._first, self._last = first, last
        self._autocast = autocast
        self._documents: collections.deque[Documents] | None = None

    def expect(self, documents: Sequence[Documents] | None) -> None:
        """The documents of the micro-batches the next forwards run, in order (a schedule runs
        each stage's forwards in micro-batch order); None: attention over whole rows."""
        self._documents = collections.deque(documents) if documents is not None else None

    def check_all_run(self) -> None:
        if self._documents:
            raise RuntimeError(f"{len(self._documents)} micro-batches' documents left unused")

    def forward(self, x: Tensor, embedded: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Hidden states after this stage's layers (normed on the last stage); with MTP, also
        the token embeddings (made on the first stage, passed on by the others), and the last
        stage's hidden states are left before the final norm."""
        documents = self._documents.popleft() if self._documents is not None else None
        with self._autocast():
            if self._first and self._with_embeddings:
                embedded = self.embed(x)
                x = embedded
            x = self._run(
                x,
                self._layer_names,
                embed=self._first and not self._with_embeddings,
                documents=documents,
            )
            if embedded is not None:
                return x, embedded.view_as(embedded)  # a node of its own, for the exchange
            return self._norm(x) if self._last else x


class PipelineRunner:
    """Runs one optimizer step's forward and backward through this rank's stages."""

    def __init__(
        self,
        model: Transformer,
        plan: StagePlan,
        config: Config,
        layout: Layout,
        device: torch.device,
        hidden_dtype: torch.dtype,
        autocast: Callable[[], contextlib.AbstractContextManager],
        micro_batches: int,
        num_micro_total: int,
    ) -> None:
        # Imported here: torch.distributed.pipelining pulls in triton and more (seconds of
        # start-up that runs without pipeline parallelism do not need).
        from torch.distributed.pipelining import (
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        schedules = {
            "gpipe": ScheduleGPipe,
            "1f1b": Schedule1F1B,
            "interleaved_1f1b": ScheduleInterleaved1F1B,
        }
        self.plan = plan
        self._context = context_shard(layout)
        self.num_micro_total = num_micro_total
        self._autocast = autocast
        self._head_weight = model.head.weight if plan.has_last else None
        self._model = model
        self.step_losses: list[Tensor] = []
        self.loss_normalizer: Tensor | None = None
        """The step's `accumulate_gradients` normalizer (None: the batch has no mask)."""
        self.stages = self._build_stages(config, layout, device, hidden_dtype)
        schedule_class = schedules[config.parallel.pp_schedule]
        interleaved = config.parallel.pp_schedule == "interleaved_1f1b"
        # Gradients are scaled by the loss itself (1 / micro-batches of the whole step, over
        # every dp rank), as in the non-pipelined loop, so the schedule must not rescale.
        self.schedule = schedule_class(
            self.stages if interleaved else self.stages[0],
            n_microbatches=micro_batches,
            loss_fn=self._loss,
            scale_grads=False,
        )

    def _build_stages(
        self, config: Config, layout: Layout, device: torch.device, hidden_dtype: torch.dtype
    ) -> list:
        """This rank's `PipelineStage`s, one per stage of the plan, each over a `StageModule` of
        the rank's model, with the shapes and dtypes the stages exchange."""
        from torch.distributed.pipelining import PipelineStage  # see PipelineRunner.__init__

        model, plan = self._model, self.plan
        data, model_config = config.data, config.model
        micro_shape = (data.micro_batch_size, data.seq_len // layout.cp)  # the rank's positions
        # Shapes and dtypes of what stages exchange (static: no shape-inference pass). Hidden
        # states need gradients, so the stages also exchange their gradients in backward.
        hidden = torch.empty(
            *micro_shape,
            model_config.d_model,
            dtype=hidden_dtype,
            device=device,
            requires_grad=True,
        )
        tokens = torch.empty(micro_shape, dtype=torch.long, device=device)
        exchanged: Tensor | tuple[Tensor, Tensor] = hidden
        if model_config.mtp_depth:
            exchanged = (hidden, hidden.detach().clone().requires_grad_(True))
        stages = []
        for stage in plan.stages:
            first, last = stage == 0, stage == plan.num_stages - 1
            module = StageModule(
                model, plan.layers_of_stage[stage], first=first, last=last, autocast=self._autocast
            )
            stages.append(
                PipelineStage(
                    module,
                    stage,
                    plan.num_stages,
                    device,
                    input_args=tokens if first else exchanged,
                    output_args=exchanged,
                    group=layout.pp_group,
                )
            )
        return stages

    def _loss(self, output: Tensor | tuple[Tensor, Tensor], targets: Tensor) -> Tensor:
        """The last stage's output (see `StageModule.forward`) to the micro-batch's loss."""
        with self._autocast():
            if isinstance(output, tuple):
                hidden_BSD, embedded_BSD = output
                loss = head_lm_loss(
                    self._model.norm(hidden_BSD), self._head_weight, targets, self.loss_normalizer
                )
                loss = self._model.with_mtp_loss(loss, hidden_BSD, embedded_BSD, targets)
            else:
                loss = head_lm_loss(output, self._head_weight, targets, self.loss_normalizer)
        self.step_losses.append(loss.detach())
        return loss / self.num_micro_total

    def forward_backward(
        self, micro_batches: MicroBatches, loss_normalizer: Tensor | None = None
    ) -> Tensor:
        """Forward and backward of this pipeline's micro-batches (`loss_normalizer`: they
        carry a label mask, see `accumulate_gradients`).

        Returns the sum of their LM losses on the rank holding the last stage, else 0.
        """
        self.step_losses = []
        self.loss_normalizer = loss_normalizer
        for stage in self.stages:
            stage.submod.expect(micro_batches.documents)
        tokens = micro_batches.tokens
        inputs, targets = model_inputs(tokens, loss_normalizer is not None, self._context)
        # Contiguous: the schedule splits these into micro-batches, and some torch versions
        # (2.11) check each one's strides against the stage's static input shape.
        inputs = inputs.flatten(0, 1).contiguous()
        targets = targets.flatten(0, 1).contiguous()
        args = (inputs,) if self.plan.has_first else ()
        kwargs = {"target": targets} if self.plan.has_last else {}
        self.schedule.step(*args, **kwargs)
        for stage in self.stages:
            stage.submod.check_all_run()
        total = torch.zeros((), dtype=torch.float64, device=tokens.device)
        for loss in self.step_losses:
            total += loss.double()
        return total
