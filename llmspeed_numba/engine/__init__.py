"""The inference engine: request scheduling (continuous batching, chunked prefill, preemption)."""

from .sampling_params import SamplingParams
from .scheduler import Batch, BatchEntry, Request, RequestStatus, Scheduler

__all__ = ["Batch", "BatchEntry", "Request", "RequestStatus", "SamplingParams", "Scheduler"]
