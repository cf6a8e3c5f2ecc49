"""Lossless greedy speculative decoding on the real SmolLM2 (CPU, float32): with ngram drafts,
the output is token for token the output without speculation, in a batch and alone."""

from __future__ import annotations

import pytest

from shoal import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("both_cores")]

SNIPPETS = [
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i, 'even')\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "SELECT name, age FROM users WHERE age > 30 ORDER BY name;\n",
    "import os\nfor name in os.listdir('.'):\n    print(name)\n",
    "x = [1, 2, 3]\ny = [v * 2 for v in x]\nprint(y)\n",
    "while True:\n    line = input()\n    if not line:\n        break\n",
    "def greet(name):\n    return 'Hello, ' + name + '!'\n",
]
TASKS = ["Repeat this code exactly:", "Rewrite this code with a comment on each line:"]


@pytest.fixture(scope="module")
def prompts(smollm_llm) -> list[dict]:
    inputs = smollm_llm.llm_engine.inputs
    return [{"prompt_token_ids": inputs.process_chat(
        [{"role": "user", "content": f"{TASKS[i % 2]}\n{code}"}]).prompt_token_ids}
        for i, code in enumerate(SNIPPETS)]


def test_ngram_greedy_is_lossless_on_smollm2(smollm_llm, prompts) -> None:
    sp = SamplingParams(temperature=0, max_tokens=40)
    want = [o.outputs[0].token_ids for o in smollm_llm.generate(prompts, sp, use_tqdm=False)]
    spec = LLM(kv_cache_memory_bytes=256 << 20, max_model_len=2048,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    accepted = 0
    inner = spec.llm_engine.core.scheduler.stats

    def stats():
        nonlocal accepted
        s = inner()
        accepted += s.spec_num_accepted_tokens
        return s
    spec.llm_engine.core.scheduler.stats = stats
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, sp, use_tqdm=False)]
    assert got == want
    assert accepted > 40  # the drafts did land: the test exercised acceptance
    alone = spec.generate(prompts[2:3], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == want[2]
