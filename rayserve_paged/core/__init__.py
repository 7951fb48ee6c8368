"""The pure-Python heart: sequences, the paged block manager and the scheduler (stdlib only)."""

from rayserve_paged.core.block_manager import AllocStatus, BlockCounters, BlockManager, BlockUsage, SlotUsage
from rayserve_paged.core.outputs import NewRequest, ScheduledGroup, SchedulerOutput, StepMessage
from rayserve_paged.core.scheduler import PreemptionMode, Scheduler, SchedulerConfig, SchedulerCounters
from rayserve_paged.core.sequence import (
    SamplingParams,
    SamplingParamsError,
    Sequence,
    SequenceGroup,
    SequenceStatus,
)

__all__ = [
    "AllocStatus",
    "BlockCounters",
    "BlockManager",
    "BlockUsage",
    "NewRequest",
    "PreemptionMode",
    "SamplingParams",
    "SamplingParamsError",
    "ScheduledGroup",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerCounters",
    "SchedulerOutput",
    "Sequence",
    "SequenceGroup",
    "SequenceStatus",
    "SlotUsage",
    "StepMessage",
]
