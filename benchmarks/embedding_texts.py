"""The embedding benchmarks' workload: N deterministic English-like texts of varied length
(3 to 120 words, most short, as retrieval passages and queries are), made from a fixed
word list and a seeded generator so every run and every engine embeds the same texts."""

from __future__ import annotations

import random

_WORDS = (
    "the of and to in is was for on that with as by at from his her an which are this be "
    "have had not but or they were one all there their been has who more can when would "
    "about into time only new some could these two may then first any like other than now "
    "its over also after most made many where before through back years much way well down "
    "should because each people just those over state such work government world life "
    "system data model engine memory cache request token vector search query document "
    "retrieval embedding sentence language server latency throughput batch kernel network "
    "river mountain city history science music game market energy water health school "
    "policy research student family company country report design product service quick "
    "brown fox jumps lazy dog paris france london weather coffee garden library museum"
).split()


def make_texts(n: int = 1000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        length = min(120, max(3, int(rng.lognormvariate(2.8, 0.6))))
        words = [rng.choice(_WORDS) for _ in range(length)]
        texts.append(" ".join(words).capitalize() + ".")
    return texts
