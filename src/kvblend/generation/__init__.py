"""Generation: sampling, decode loops over a caller-owned cache, streaming text."""

from kvblend.generation.decode import decode_steps, generate_ids, prefill
from kvblend.generation.sampling import Sampler, SamplingParams
from kvblend.generation.stream import (
    Completion, StreamEvent, collect, encode_prompt, render_chat, stream, stream_from, validate_messages,
)

__all__ = [
    "Completion", "Sampler", "SamplingParams", "StreamEvent", "collect", "decode_steps",
    "encode_prompt", "generate_ids", "prefill", "render_chat", "stream", "stream_from",
    "validate_messages",
]
