"""The grammar bitmask applied to logits (shoal's torch version against xgrammar's own), and a
model vocabulary padded past the tokenizer's."""

from __future__ import annotations

import pytest
import torch

from shoal.structured_output.bitmask import apply_token_bitmask, unpack_bitmask

xgr = pytest.importorskip("xgrammar")


@pytest.mark.parametrize("vocab", [64, 100, 1000])
def test_matches_xgrammar_on_a_subset_of_rows(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g)
    words = torch.randint(-2**31, 2**31 - 1, (3, -(-vocab // 32)), generator=g,
                          dtype=torch.int64).to(torch.int32)
    rows = [0, 2, 4]
    ours = logits.clone()
    apply_token_bitmask(ours, words, rows)
    theirs = logits.clone()
    full = torch.full((5, words.shape[1]), -1, dtype=torch.int32)
    full[rows] = words
    xgr.apply_token_bitmask_inplace(theirs, full, indices=rows)
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[1], logits[1]) and torch.equal(ours[3], logits[3])


def test_logits_wider_than_the_bitmask_mask_the_padding():
    words = torch.full((1, 2), -1, dtype=torch.int32)  # 64 tokens allowed
    allowed = unpack_bitmask(words, 70)
    assert allowed[0, :64].all() and not allowed[0, 64:].any()
    logits = torch.zeros(1, 70)
    apply_token_bitmask(logits, words, [0])
    assert torch.isinf(logits[0, 64:]).all() and torch.isfinite(logits[0, :64]).all()


def test_padded_vocabulary_never_allows_ids_past_the_tokenizer(smollm_gguf):
    from shoal.loader import load_model
    from shoal.structured_output.manager import make_backend
    from shoal.structured_output.params import StructuredOutputsParams

    tok = load_model(None, load_format="dummy").tokenizer
    padded = len(tok) + 100
    backend = make_backend("xgrammar", tok, padded, [tok.eos_token_id])
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(regex=".*")))
    bitmask = torch.full((1, -(-padded // 32)), -1, dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    allowed = unpack_bitmask(bitmask, padded)[0]
    assert allowed[:len(tok)].any() and not allowed[len(tok):].any()


@pytest.mark.parametrize("rows", [[0, 1, 2], [0, 2]])
def test_a_bitmask_narrower_than_the_logits_bans_the_rest(rows):
    """Logits padded past the grammar's vocabulary: the padding is -inf in the masked rows,
    the bitmask decides the rest, other rows are untouched (whole batch or a subset)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 200, generator=g)
    words = torch.randint(-2**31, 2**31 - 1, (len(rows), 3), generator=g,
                          dtype=torch.int64).to(torch.int32)  # 96 ids
    ours = logits.clone()
    apply_token_bitmask(ours, words, rows)
    want = logits.clone()
    want[rows, :96] = want[rows, :96].masked_fill(unpack_bitmask(words, 96, allowed=False),
                                                  float("-inf"))
    want[rows, 96:] = float("-inf")
    assert torch.equal(ours, want)


def test_grammar_vocabulary_is_the_tokenizers(smollm_gguf):
    """The bitmask and the grammar engine cover the tokenizer's ids, not the model's padded
    logits (each padding id would cost every fill and accept)."""
    from shoal.loader import load_model
    from shoal.structured_output.manager import StructuredOutputManager, grammar_vocab_size
    from shoal.structured_output.params import StructuredOutputsParams

    tok = load_model(None, load_format="dummy").tokenizer
    n = len(tok)
    assert grammar_vocab_size(tok, n + 1000) == n
    assert grammar_vocab_size(tok, n - 10) == n - 10
    assert grammar_vocab_size(None, 77) == 77
    # A model whose end-of-sequence id lies past the tokenizer's (a finished grammar allows
    # only it): the grammar's vocabulary reaches it.
    assert grammar_vocab_size(tok, n + 1000, [n + 500]) == n + 501
    manager = StructuredOutputManager("xgrammar", tok, n + 1000, [tok.eos_token_id])
    req = manager.request(StructuredOutputsParams(choice=["yes", "no"]))
    manager.validate(req.params)
    bitmask = manager.fill_bitmask([req]).clone()  # the manager's buffer: copy it
    assert bitmask.shape == (1, -(-n // 32))
    allowed = unpack_bitmask(bitmask, n)[0]
    assert 0 < int(allowed.sum()) < 100  # the first tokens of "yes" / "no" only
    manager._buffer.fill_(-1)  # a fill writes whole rows: no memset needed before it
    assert torch.equal(manager.fill_bitmask([req]), bitmask)
    manager.shutdown()


def test_an_ended_grammar_row_is_allowed_all(smollm_gguf):
    """A step scheduled behind the one that ended a grammar (async scheduling) still has the
    request's row: it is allowed-all (the token is dropped) instead of asking the finished
    matcher, which xgrammar refuses; the other rows are filled as usual."""
    from shoal.loader import load_model
    from shoal.structured_output.manager import StructuredOutputManager
    from shoal.structured_output.params import StructuredOutputsParams

    tok = load_model(None, load_format="dummy").tokenizer
    manager = StructuredOutputManager("xgrammar", tok, len(tok), [tok.eos_token_id])
    so = StructuredOutputsParams(choice=["yes", "no"])
    done, live = manager.request(so), manager.request(so)
    manager.validate(so)
    for t in tok.encode("yes", add_special_tokens=False) + [tok.eos_token_id]:
        assert done.accept(t)
    assert done.ended and done.matcher.is_terminated() and not live.ended
    bitmask = manager.fill_bitmask([done, live] * 5)  # 10 rows: the batched fill
    assert (bitmask[0::2] == -1).all()
    allowed = unpack_bitmask(bitmask[1::2], len(tok))
    assert (allowed.sum(dim=1) < 100).all() and (allowed.sum(dim=1) > 0).all()
    manager.shutdown()
