"""Conveyor's inference engine: paged KV cache, prefix caching, chunked prefill, preemption.

Here: the step loop (engine), its scheduling (scheduler), the request and output data (request, outputs), the
boundaries (protocol), config, errors, the step costs it keeps and its warm-up. What computes a step is an injected
model runner (protocol.py): transformers' own model definitions (any Llama-family causal LM; only the attention
product is replaced), model/; or the simulator, sim/. Beside them: kv/ (the paged pool, its prefix cache, paused
sessions' KV), sampling/ (logits to tokens: sampling, grammars, speculative drafts), cpu/ (the C++ kernels and the
GEMM plans). Importing this package does not import torch.
"""

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.engine.errors import (
    OOM,
    TOO_LONG,
    WORKER_ERROR,
    EngineError,
    EngineLoadError,
    FatalEngineError,
    InvalidRequestError,
    RecoverableEngineError,
)
from services.worker.engine.outputs import EngineStats, RequestOutput, StepResult, TokenLogprobs
from services.worker.engine.protocol import Engine, ModelRunner
from services.worker.engine.request import EngineRequest, SamplingOptions, SequenceStatus

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineLoadError",
    "EngineRequest",
    "EngineStats",
    "FatalEngineError",
    "InvalidRequestError",
    "LLMEngine",
    "ModelRunner",
    "OOM",
    "RecoverableEngineError",
    "RequestOutput",
    "SamplingOptions",
    "SequenceStatus",
    "StepResult",
    "TOO_LONG",
    "TokenLogprobs",
    "WORKER_ERROR",
]
