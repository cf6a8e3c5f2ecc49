"""The host paths of a constrained step give the same bitmasks and tokens whichever way they
run: xgrammar's batched fill on one thread or several, the row-by-row fallback (an xgrammar
without the batch API), a subset of rows; a grammar's end seen without asking the matcher
after every token."""

from __future__ import annotations

import pytest
import torch

from shoal.structured_output.bitmask import apply_token_bitmask, unpack_bitmask

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["note", "task"]},
                                           "n": {"type": "integer"}},
          "required": ["kind", "n"]}


@pytest.fixture(scope="module")
def tok(smollm_gguf):
    from shoal.loader import load_model

    return load_model(None, load_format="dummy").tokenizer


def _manager(tok):
    from shoal.structured_output.manager import StructuredOutputManager

    return StructuredOutputManager("xgrammar", tok, len(tok), [tok.eos_token_id])


def _walk(manager, reqs, steps, fill, pick):
    """Advances every request `steps` tokens, each the pick() of its row's allowed ids;
    returns the bitmasks (copies) and the tokens of each step."""
    masks, tokens = [], []
    for _ in range(steps):
        bm = fill(reqs).clone()
        allowed = unpack_bitmask(bm, manager.vocab_size)
        toks = []
        for i, r in enumerate(reqs):
            if r.ended:
                toks.append(-1)
                continue
            t = pick(i, torch.nonzero(allowed[i]).flatten())
            assert r.accept(t)
            toks.append(t)
        masks.append(bm)
        tokens.append(toks)
    return masks, tokens


def _fills(manager, monkeypatch, how):
    import shoal.structured_output.xgrammar_backend as xb

    backend = manager._get_backend()
    if how == "threads":  # the many-thread batcher for any batch
        monkeypatch.setattr(xb, "THREADED_FILL_ROWS", 1)
        backend._batch_many = type(backend._batch_one)(max_threads=2)
    elif how == "rows":  # the fallback: no batch API
        backend._batch_one = backend._batch_many = None
    return manager.fill_bitmask


@pytest.mark.parametrize("how", ["threads", "rows"])
def test_batched_and_row_by_row_fills_agree(tok, monkeypatch, how):
    """12 requests walk the JSON schema on different allowed tokens (varied states), the
    reference on the default path (one-thread batch), the other on `how`: the same bitmasks
    and tokens at every step."""
    from shoal.structured_output.params import StructuredOutputsParams

    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)

    def pick(i, ids):  # varied but the same on both sides
        return int(ids[(7 * i + 3) % len(ids)])

    runs = []
    for variant in ("one-thread", how):
        with monkeypatch.context() as mp:
            manager = _manager(tok)
            manager.validate(so)
            fill = manager.fill_bitmask if variant == "one-thread" else _fills(manager, mp, how)
            reqs = [manager.request(so) for _ in range(12)]
            for r in reqs:
                r.settle()
            runs.append(_walk(manager, reqs, 12, fill, pick))
            manager.shutdown()
    (masks_a, toks_a), (masks_b, toks_b) = runs
    assert toks_a == toks_b
    for a, b in zip(masks_a, masks_b):
        assert torch.equal(a, b)


def test_a_subset_of_rows_fills_as_the_whole_batch(tok):
    """Rows of ended grammars are allowed-all; the others match a fill of the live rows
    alone, with the batch API and row by row."""
    from shoal.structured_output.params import StructuredOutputsParams

    manager = _manager(tok)
    so = StructuredOutputsParams(choice=["yes", "no"])
    manager.validate(so)
    reqs = [manager.request(so) for _ in range(10)]
    for r in reqs[::3]:
        for t in tok.encode("no", add_special_tokens=False) + [tok.eos_token_id]:
            assert r.accept(t)
        assert r.ended
    live = [r for r in reqs if not r.ended]
    want = manager.fill_bitmask(live).clone()
    got = manager.fill_bitmask(reqs).clone()
    assert (got[::3] == -1).all()
    assert torch.equal(got[[i for i in range(10) if i % 3]], want)
    backend = manager._get_backend()
    backend._batch_one = backend._batch_many = None
    assert torch.equal(manager.fill_bitmask(reqs), got)
    manager.shutdown()


def test_the_end_is_seen_only_after_a_stop_token(tok):
    """accept() asks is_terminated() after the tokens that may complete the grammar only:
    `ended` is what asking after every token would say, for xgrammar (its stop tokens) and for
    a matcher that names none (asked every time)."""
    from shoal.structured_output.params import StructuredOutputsParams

    manager = _manager(tok)
    so = StructuredOutputsParams(choice=["yes", "no"])
    manager.validate(so)
    for names_stops in (True, False):
        req = manager.request(so)
        req.settle()
        if names_stops:
            assert tok.eos_token_id in req.matcher.stop_token_ids
        else:
            req.matcher.stop_token_ids = None
        for t in tok.encode("yes", add_special_tokens=False):
            assert req.accept(t)
            assert not req.ended and not req.matcher.is_terminated()
        assert req.accept(tok.eos_token_id)
        assert req.ended and req.matcher.is_terminated()
    refused = manager.request(so)
    assert not refused.accept(tok.encode("maybe", add_special_tokens=False)[0])
    assert refused.ended
    manager.shutdown()


def test_every_row_needs_no_index_list():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 100, generator=g)
    words = torch.randint(-2**31, 2**31 - 1, (4, 3), generator=g,
                          dtype=torch.int64).to(torch.int32)
    a, b = logits.clone(), logits.clone()
    apply_token_bitmask(a, words, None)
    apply_token_bitmask(b, words, [0, 1, 2, 3])
    assert torch.equal(a, b) and torch.isinf(a[:, 96:]).all()


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_verify_rows_follow_the_drafts_and_leave_the_grammar_where_it_was(tok, backend):
    """A verify step's bitmask: row j of a request is what its grammar allows after its
    first j drafts (rows past a refused draft or the grammar's end allow everything); the
    matchers are back where they were (the next fill is the one before), and a refused draft
    leaves a matcher usable (llguidance's would stay in error had it been fed one)."""
    from shoal.structured_output.manager import StructuredOutputManager
    from shoal.structured_output.params import StructuredOutputsParams

    if backend == "guidance":
        pytest.importorskip("llguidance")
    manager = StructuredOutputManager(backend, tok, len(tok), [tok.eos_token_id])
    so = StructuredOutputsParams(choice=["yes sir", "no"])
    manager.validate(so)
    yes = tok.encode("yes sir", add_special_tokens=False)
    assert len(yes) >= 2
    bad = tok.encode("maybe", add_special_tokens=False)[0]
    eos = tok.eos_token_id
    reqs = [manager.request(so) for _ in range(3)]
    for r in reqs:
        r.settle()
    before = manager.fill_bitmask(reqs).clone()
    # 0: two right drafts; 1: a right one then a refused one then a right one; 2: the whole
    # answer, its end, and one more
    drafts = [yes[:2], [yes[0], bad, yes[1]], yes + [eos, yes[0]]]
    mask = manager.fill_bitmask(reqs, drafts).clone()
    assert mask.shape[0] == sum(len(d) + 1 for d in drafts)
    ref = manager.request(so)
    ref.settle()

    def after(tokens):
        fresh = manager.request(so)
        fresh.settle()
        for t in tokens:
            assert fresh.accept(t)
        return manager.fill_bitmask([fresh]).clone()[0]

    row = 0
    for d in drafts:
        for j in range(len(d) + 1):
            prefix = d[:j]
            if bad in prefix or eos in prefix:
                assert (mask[row + j] == -1).all(), (d, j)
            else:
                assert torch.equal(mask[row + j], after(prefix)), (d, j)
        row += len(d) + 1
    assert torch.equal(manager.fill_bitmask(reqs), before)
    for r in reqs:  # every matcher still takes the answer
        for t in yes + [eos]:
            assert r.accept(t)
        assert r.ended
    manager.shutdown()
