"""The continuous-batching scheduler and its output types."""

from engine.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from engine.sched.scheduler import Scheduler

__all__ = ["CachedRequestData", "NewRequestData", "Scheduler", "SchedulerOutput"]
