"""PoolingParams: an embedding request, the pooling counterpart of SamplingParams (vLLM's name).

A pooling request is prefill only: it runs its prompt through the same scheduler as any request (chunked,
preemptible), is never sampled, and ends the step its prompt is computed, its pages freed then. Its one
output is the pooled hidden state of the model's last layer (after the final norm):

    last:  the hidden state of the prompt's last token (decoder LMs trained for embedding: the default)
    mean:  the mean over every prompt token (sentence-transformers' mean pooling)

then truncated to `dimensions` (Matryoshka models only) and L2-normalised. How a model pools is the engine's
setting (ModelConfig.pooling, else the model's sentence-transformers config, else last): `pooling_type` is
filled in by the engine, not chosen per request.
"""

from __future__ import annotations

from dataclasses import dataclass

from banyan.errors import InvalidParameterError

POOLING_TYPES = ("last", "mean")


@dataclass(frozen=True)
class PoolingParams:
    dimensions: int | None = None
    """Keep the first `dimensions` values before normalising (a Matryoshka model's shorter embedding); None: all."""
    normalize: bool = True
    """L2-normalise the embedding (OpenAI's embeddings are unit vectors)."""
    pooling_type: str | None = None
    """last or mean; None until the engine fills in the model's."""

    def __post_init__(self):
        if self.dimensions is not None and (type(self.dimensions) is not int or self.dimensions < 1):
            raise InvalidParameterError("dimensions", f"must be a positive integer, got {self.dimensions!r}")
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise InvalidParameterError("pooling",
                                        f"must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
