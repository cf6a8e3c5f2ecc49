"""Why the engine ended a request with an error, as a code that travels beside the message
(EngineCoreOutput.error_code, a rejection's code). The frontends decide how to answer from
the code alone (which exception the offline LLM raises, which HTTP status the server sends:
shoal/engine/request_errors.py, shoal/entrypoints/openai/errors.py); the message is for
people and may change freely."""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    """Numbered from 1, so that no code is falsy; a value is never reused for another kind."""

    # The client's fault: a constraint the grammar backend cannot compile (the scheduler's
    # fail_request), or a request the core refused with a ValueError (core_proc's rejected).
    BAD_REQUEST = 1
    # Older than request_timeout (RequestTable.expired, ended by the schedulers).
    TIMED_OUT = 2
    # The model produced non-finite logits (scheduler.update) or values (pooling_scheduler).
    NON_FINITE = 3
    # The sampled token does not fit the request's grammar (engine/token_results.py): the
    # bitmask left nothing allowed, e.g. min_tokens banned the only stop token.
    OUTSIDE_GRAMMAR = 4
    # A step raised while running the request (the schedulers' fail_steps), or the core
    # refused the request with an unexpected exception (core_proc's rejected).
    ENGINE_FAILED = 5
    # The data-parallel replica running the request died (dp_client's lost).
    REPLICA_LOST = 6
