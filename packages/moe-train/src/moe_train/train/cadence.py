"""When the loop logs, evaluates and saves: the one rule behind every file and line that names
a step.

Step N is the state after N optimizer steps: the metrics row, the routing row, the console
line, the evaluation and the checkpoint `step_0000000N` of step N all describe that state.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_plan.config import Config


@dataclass(frozen=True)
class Cadence:
    """Which steps are logged, evaluated and saved (by step count; time-based saves and stop
    requests are the loop's)."""

    max_steps: int
    """train.max_steps: the last step of the run, always logged, evaluated and saved."""
    log_interval: int
    """Steps between logged steps."""
    eval_interval: int = 0
    """Steps between evaluations; 0 turns evaluation off."""
    checkpoint_interval: int = 0
    """Steps between step-based saves; 0 saves only at the end and before a stop."""

    @classmethod
    def of(cls, config: Config) -> Cadence:
        return cls(
            max_steps=config.train.max_steps,
            log_interval=config.train.log_interval,
            eval_interval=config.eval.interval if config.eval.enabled else 0,
            checkpoint_interval=config.checkpoint.interval,
        )

    def logs(self, step: int, *, final: bool = False) -> bool:
        """Whether step `step` gets a metrics row, a routing row and a console line: every
        log_interval steps, the run's last step, and the `final` step this process runs (a
        stop, or an earlier end asked for)."""
        return final or step % self.log_interval == 0 or step == self.max_steps

    def evaluates(self, step: int) -> bool:
        """Whether the state after step `step` is evaluated: every eval_interval steps and
        after the run's last step."""
        if not self.eval_interval:
            return False
        return step % self.eval_interval == 0 or step == self.max_steps

    def saves(self, step: int, *, final: bool = False) -> bool:
        """Whether the state after step `step` is saved by step count: every
        checkpoint_interval steps and at the `final` step this process runs."""
        interval = self.checkpoint_interval
        return final or (bool(interval) and step % interval == 0)
