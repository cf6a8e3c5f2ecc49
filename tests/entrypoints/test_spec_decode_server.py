"""`shoal serve --speculative-config '<json>'`: the real server with ngram drafts, through the
official openai client; its spec_decode counters on /metrics."""

from __future__ import annotations

import json

import pytest

from .conftest import RemoteServer

pytestmark = pytest.mark.slow

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4}
CODE = "def area(width, height):\n    return width * height\n\nprint(area(3, 4))\n"


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer("--speculative-config", json.dumps(SPEC))
    yield srv
    srv.stop()


def test_completions_and_chat_with_speculation(server) -> None:
    client = server.openai()
    chat = client.chat.completions.create(
        model=client.models.list().data[0].id, temperature=0, max_tokens=48,
        messages=[{"role": "user", "content": f"Repeat this code exactly:\n{CODE}"}])
    assert chat.choices[0].message.content and chat.usage.completion_tokens > 0
    stream = client.completions.create(model=client.models.list().data[0].id,
                                       prompt=f"{CODE}\n# The same code again:\n{CODE}",
                                       temperature=0.7, max_tokens=24, seed=3, stream=True)
    text = "".join(c.choices[0].text for c in stream)
    assert text
    drafts = server.wait_metric("spec_decode_num_drafts_total", lambda v: v > 0)
    accepted = server.metric("spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and accepted > 0
    assert server.metric("spec_decode_num_draft_tokens_total") >= accepted
