"""The training loop, its metrics and the MFU denominator."""

from moe_data import PREEMPTED_EXIT
from moe_train.train.cadence import Cadence
from moe_train.train.metrics import read_metrics
from moe_train.train.peak import measure_matmul_peak, peak_flops
from moe_train.train.schedule import lr_at
from moe_train.train.step_record import StepRecord
from moe_train.train.trainer import TrainResult, train

__all__ = [
    "PREEMPTED_EXIT",
    "Cadence",
    "StepRecord",
    "TrainResult",
    "lr_at",
    "measure_matmul_peak",
    "peak_flops",
    "read_metrics",
    "train",
]
