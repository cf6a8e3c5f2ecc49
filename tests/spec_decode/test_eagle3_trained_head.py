"""benchmarks/eagle3_train_head.py's pieces on a tiny random 8-layer Llama target: the aux
states it trains on are the ones the speculating engine records while serving, the training
loss falls, the saved folder loads in shoal and its drafts keep greedy decoding lossless
(and are accepted more than the untrained head's), and the training-time unrolled forward is
shoal's Eagle3LlamaHead on the same weights, draft step by draft step (so the checkpoint
trained is the formula served)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from engine_helpers import random_prompts, tiny_llm
from oracle import write_tiny_checkpoint

from shoal.attention.packed import PackedSeqs
from shoal.loader.safetensors_loader import load_folder_config
from shoal.spec_decode.eagle3 import Eagle3LlamaHead, renamed_eagle3
from shoal.spec_decode.eagle_head import read_eagle_tensors

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
LAYERS, AUX, K, TTT, DRAFT_VOCAB = 8, (2, 4, 5), 3, 3, 128


@pytest.fixture(scope="module")
def bench():
    """The script's modules (benchmarks/ is not a package)."""
    sys.path.insert(0, str(BENCH))
    try:
        import eagle3_head_data as data
        import eagle3_head_measure as measure
        import eagle3_head_model as model
    finally:
        sys.path.remove(str(BENCH))
    return data, model, measure


@pytest.fixture(scope="module")
def trained(bench, tmp_path_factory):
    """(target folder, plain engine, data, random head folder, trained head folder, log,
    trained head)."""
    data_mod, model_mod, _ = bench
    root = tmp_path_factory.mktemp("eagle3-trained")
    target_dir = write_tiny_checkpoint(root / "target", "llama", seed=3,
                                       num_hidden_layers=LAYERS)
    plain = tiny_llm(target_dir, enable_prefix_caching=False)
    target = plain.llm_engine.core.runner.model
    seqs = data_mod.greedy_sequences(plain, random_prompts(8, seed=2, lo=6, hi=16), 24,
                                     ignore_eos=True)
    data = data_mod.record_states(target, seqs, AUX, tokens_per_pass=128)
    draft_ids = data_mod.draft_vocabulary(data, DRAFT_VOCAB, target.config.vocab_size)
    torch.manual_seed(0)
    shape = model_mod.HeadShape.of_target(target.config, DRAFT_VOCAB)
    head = model_mod.TrainableEagle3Head(shape, target.config,
                                         target.model.embed_tokens.weight, draft_ids)
    head.init_from_target(target.lm_head.weight, target.model.norm.weight)
    head.set_input_scale(data.aux)
    random_dir = model_mod.save_checkpoint(head, root / "random", target.config, AUX)
    cfg = model_mod.TrainConfig(steps=60, batch_size=4, ttt_steps=TTT, lr=3e-3, warmup=5)
    log = model_mod.train_head(head, data, cfg, log=lambda _: None)
    trained_dir = model_mod.save_checkpoint(head, root / "trained", target.config, AUX)
    return target_dir, plain, data, random_dir, trained_dir, log, head


def _spec(folder: Path) -> dict:
    return {"method": "eagle3", "model": str(folder), "num_speculative_tokens": K}


def test_training_loss_falls(trained) -> None:
    log = trained[5]
    assert log.steps_done == 60
    first, last = sum(log.loss[:5]) / 5, sum(log.loss[-5:]) / 5
    assert last < 0.5 * first, (first, last)


def test_trained_head_loads_is_lossless_and_accepted(bench, trained) -> None:
    data_mod, _, measure = bench
    target_dir, plain, data, random_dir, trained_dir, _, _ = trained
    prompts = [{"prompt_token_ids": ids[:12].tolist()} for ids in data.ids]  # trained on
    want = measure.run_prompts(plain, None, prompts, 12, True, True)[1]
    rates = {}
    for name, folder in (("random", random_dir), ("trained", trained_dir)):
        llm = tiny_llm(target_dir, enable_prefix_caching=False,
                       speculative_config=_spec(folder))
        counters = measure.SpecCounters(llm)
        fig, got = measure.run_prompts(llm, counters, prompts, 12, True, True)
        assert got == want, name
        assert fig["num_drafts"] > 0
        rates[name] = fig["draft_acceptance_rate"]
        if name == "trained":
            # served aux states = trained-on aux states (a sequence the engine never saw)
            seq = data.ids[0].tolist()[::-1]
            err = data_mod.serve_time_aux_error(llm, plain.llm_engine.core.runner.model,
                                                seq, AUX, skip_rows=K + 1)
            assert err < 1e-5
        llm.shutdown()
    assert rates["trained"] > max(0.3, rates["random"] + 0.2), rates


@torch.no_grad()
def test_unrolled_forward_is_shoals_head(bench, trained) -> None:
    _, model_mod, _ = bench
    _, plain, data, _, folder, _, trained_head = trained
    target = plain.llm_engine.core.runner.model
    cfg = load_folder_config(folder)
    served = Eagle3LlamaHead(cfg, torch.float32, len(AUX), cfg.hidden_size,
                             use_triton_ops=False)
    served.load_weights(renamed_eagle3(read_eagle_tensors(folder)), target)
    ours = model_mod.TrainableEagle3Head(
        model_mod.HeadShape.of_target(target.config, DRAFT_VOCAB), target.config,
        target.model.embed_tokens.weight, served.d2t + torch.arange(DRAFT_VOCAB))
    ours.load_state_dict({k: v for k, v in read_eagle_tensors(folder).items()})
    ids, aux = data.ids[0], data.aux[0].float()
    n = len(ids) - 1
    states = ours.unroll(aux[None], ids[None], TTT)
    for a, b in zip(states, trained_head.unroll(aux[None], ids[None], TTT)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)  # fc_in_scale folded in

    def shoal_rows(tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Shoal's head over rows at positions 0.., causal, no KV cache (a copy of hidden:
        the fused residual add writes into its input, as the engine lets it)."""
        md = PackedSeqs.build([len(tokens)], True, torch.device("cpu"))
        return served(tokens, torch.arange(len(tokens)), hidden.clone(), md)

    g = served.combine(aux[:n])
    y1 = shoal_rows(ids[1:], g)
    torch.testing.assert_close(states[0][0], y1, rtol=1e-4, atol=1e-4)
    to_target = served.to_target(served.compute_logits(y1).argmax(-1))
    ours_ids = ours.d2t + torch.arange(DRAFT_VOCAB)
    assert torch.equal(ours_ids[ours.logits(states[0][0]).argmax(-1)], to_target)
    for q in (0, 5, n - TTT):  # draft steps 2..TTT of branch q: the serve-time rows
        tokens, hidden, y = list(ids[1:q + 2]), g[:q + 1], y1[q]
        for j in range(2, TTT + 1):
            tokens.append(ids[q + j])
            hidden = torch.cat([hidden, y[None]])
            y = shoal_rows(torch.stack(tokens), hidden)[-1]
            torch.testing.assert_close(states[j - 1][0, q], y, rtol=1e-4, atol=1e-4)
