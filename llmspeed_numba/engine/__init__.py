"""The inference engine: ``LLM`` (vLLM's offline API), request scheduling (continuous batching,
chunked prefill, preemption) and the model runner (CUDA-graph decode, GPU sampling). Needs the
``models`` extra (torch)."""

from .llm import LLM, RequestOutput
from .sampling_params import SamplingParams
from .scheduler import Batch, BatchEntry, Request, RequestStatus, Scheduler

__all__ = ["LLM", "Batch", "BatchEntry", "Request", "RequestOutput", "RequestStatus",
           "SamplingParams", "Scheduler"]
