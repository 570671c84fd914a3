from banyan.scheduler.batch import Batch, SampledToken, ScheduledRequest, StepResult
from banyan.scheduler.scheduler import Scheduler

__all__ = ["Batch", "SampledToken", "ScheduledRequest", "Scheduler", "StepResult"]
