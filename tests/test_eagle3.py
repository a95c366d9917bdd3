"""EAGLE-3 heads: our module (models/eagle3.py, over the token table) against a plain-torch
reference of the paper's head (helpers/eagle3.py) on tiny random heads in the published
checkpoint layouts and over two gloo ranks, and the target's auxiliary hidden states against
transformers' output_hidden_states. fp32 on the CPU, atol = rtol = 1e-4."""

import pytest
import torch
import torch.multiprocessing as mp
from helpers.eagle3 import HEAD, head_tensors, reference_head, reference_target_id, write_head
from helpers.models import make_model
from test_tp import free_port, leave_together
from benchmark.lib.one_request import decode_batch, extend_batch, slot_table

from lightllm.common.token_table import TokenTable
from lightllm.models import (Eagle3Config, ModelConfigError, WeightLoadError, load_eagle3, load_model, read_config,
                             read_eagle3_config)
from lightllm.utils.dist import TPGroup, init_tp

TOL = dict(atol=1e-4, rtol=1e-4)
MAX_LEN = 32
CPU = torch.device("cpu")


def load_head(model_dir, target_embed=None, tp=TPGroup()):
    cfg = read_eagle3_config(model_dir)
    head = load_eagle3(cfg, dtype=torch.float32, device=CPU, tp=tp, max_positions=MAX_LEN,
                       target_embed=target_embed)
    kv = TokenTable(MAX_LEN, 1, head.kv_heads, cfg.layer.head_dim, torch.float32, CPU)
    return head, kv


def prefill(head, kv, gen, n=6):
    tokens = torch.randint(HEAD["vocab_size"], (n,), generator=gen)
    features = torch.randn(n, 3 * HEAD["target_hidden_size"], generator=gen)
    logits, hidden = head.forward(extend_batch(tokens, 0, slot_table(MAX_LEN, CPU), HEAD["head_dim"]), kv, features)
    return tokens.tolist(), list(features), logits, hidden


def test_head_matches_reference_over_prefill_chained_steps_and_an_extend(tmp_path):
    """A prefill from the target's features, three chained steps (each drafting from the last
    step's logits through d2t and feeding its hidden state back, the K/V reused), then an
    extend of two more target features: every step's logits and hidden states as the
    reference's over the whole sequence, and the same drafted tokens."""
    tensors, gen = head_tensors(), torch.Generator().manual_seed(1)
    write_head(tmp_path, tensors)
    head, kv = load_head(tmp_path)
    tokens, features, logits, hidden = prefill(head, kv, gen)
    ref_logits, ref_hidden = reference_head(tensors, tokens, features)
    torch.testing.assert_close(logits, ref_logits, **TOL)
    torch.testing.assert_close(hidden, ref_hidden, **TOL)
    req_to_token = slot_table(MAX_LEN, CPU)
    for _ in range(3):
        draft = head.target_ids(logits[-1].argmax())
        assert int(draft) == reference_target_id(tensors, int(ref_logits[-1].argmax()))
        tokens.append(int(draft))
        features.append(ref_hidden[-1])
        position, fed = torch.tensor([len(tokens) - 1]), hidden[-1:]
        kept = fed.clone()
        logits, hidden = head.forward(decode_batch(draft[None], position, req_to_token, MAX_LEN), kv, fed)
        assert torch.equal(fed, kept)  # the features fed back are left as they were
        ref_logits, ref_hidden = reference_head(tensors, tokens, features)
        torch.testing.assert_close(logits[0], ref_logits[-1], **TOL)
        torch.testing.assert_close(hidden[0], ref_hidden[-1], **TOL)
    more = torch.randint(HEAD["vocab_size"], (2,), generator=gen)
    more_features = torch.randn(2, 3 * HEAD["target_hidden_size"], generator=gen)
    logits, hidden = head.forward(extend_batch(more, len(tokens), req_to_token, HEAD["head_dim"]), kv, more_features)
    ref_logits, ref_hidden = reference_head(tensors, tokens + more.tolist(), features + list(more_features))
    torch.testing.assert_close(logits, ref_logits[-2:], **TOL)
    torch.testing.assert_close(hidden, ref_hidden[-2:], **TOL)


def test_target_logits_spread_the_draft_vocabulary(tmp_path):
    write_head(tmp_path, head_tensors())
    head = load_head(tmp_path)[0]
    logits = torch.randn(2, HEAD["draft_vocab_size"])
    full = head.target_logits(logits)
    ids = head.draft_to_target
    assert full.shape == (2, HEAD["vocab_size"]) and torch.equal(full[:, ids], logits)
    assert torch.isinf(full).sum() == 2 * (HEAD["vocab_size"] - HEAD["draft_vocab_size"])
    assert torch.equal(head.target_ids(torch.arange(HEAD["draft_vocab_size"])), ids)


def tp_head_worker(rank, world_size, port, head_dir, out_file):
    head, kv = load_head(head_dir, tp=init_tp(rank, world_size, port, "cpu"))
    tokens, features, logits, hidden = prefill(head, kv, torch.Generator().manual_seed(5))
    draft = head.target_ids(logits[-1].argmax())
    batch = decode_batch(draft[None], torch.tensor([len(tokens)]), slot_table(MAX_LEN, CPU), MAX_LEN)
    step_logits, step_hidden = head.forward(batch, kv, hidden[-1:])
    if rank == 0:
        torch.save(dict(tokens=tokens + [int(draft)], features=features + [hidden[-1]], logits=logits, hidden=hidden,
                        step_logits=step_logits, step_hidden=step_hidden), out_file)
    leave_together()


def test_head_over_two_ranks_matches_the_reference(tmp_path):
    """Two gloo ranks, each with half the heads, of fc's input, of the MLP and of a draft
    vocabulary that does not divide by 2 (41: padded shards): a prefill and a chained step."""
    tensors = head_tensors(seed=6, draft_vocab_size=41)
    write_head(tmp_path / "head", tensors, draft_vocab_size=41)
    mp.spawn(tp_head_worker, args=(2, free_port(), tmp_path / "head", tmp_path / "tp2.pt"), nprocs=2, join=True)
    got = torch.load(tmp_path / "tp2.pt")
    ref_logits, ref_hidden = reference_head(tensors, got["tokens"], got["features"])
    torch.testing.assert_close(got["logits"], ref_logits[:-1], **TOL)
    torch.testing.assert_close(got["hidden"], ref_hidden[:-1], **TOL)
    assert got["tokens"][-1] == reference_target_id(tensors, int(ref_logits[-2].argmax()))
    torch.testing.assert_close(got["step_logits"][0], ref_logits[-1], **TOL)
    torch.testing.assert_close(got["step_hidden"][0], ref_hidden[-1], **TOL)


# (architecture, file, names of the decoder layer, config.json's extra fields, the head's own embedding)
LAYOUTS = {
    # the first published heads (yuhuili/EAGLE3-*): LlamaForCausalLM with a draft_vocab_size, a .bin
    "eagle_bin": ("LlamaForCausalLM", "pytorch_model.bin", "midlayer", {}, True),
    # SGLang's and vLLM's name, a safetensors file, the residual stream from the normed feature
    "norm_before_residual": ("LlamaForCausalLMEagle3", "model.safetensors", "midlayer",
                             {"norm_before_residual": True}, False),
    # the speculators layout: layers.0 names, the layer's fields nested
    "speculators": ("Eagle3LlamaForCausalLM", "model.safetensors", "layers.0",
                    {"transformer_layer_config": {"rms_norm_eps": 1e-6}}, True),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_published_layouts_load_and_match_the_reference(layout, tmp_path):
    architecture, file, prefix, config, own_embed = LAYOUTS[layout]
    tensors = head_tensors(seed=2)
    saved = {k.replace("midlayer.", f"{prefix}."): v for k, v in tensors.items()
             if own_embed or k != "embed_tokens.weight"}
    write_head(tmp_path / "head", saved, architecture, file, **config)
    target_embed = None
    if not own_embed:  # the target's embedding (here another head's with the same tensors), shared
        write_head(tmp_path / "other", tensors)
        target_embed = load_head(tmp_path / "other")[0].embed
    head, kv = load_head(tmp_path / "head", target_embed)
    tokens, features, logits, hidden = prefill(head, kv, torch.Generator().manual_seed(3))
    eps = config.get("transformer_layer_config", {}).get("rms_norm_eps", HEAD["rms_norm_eps"])
    ref_logits, ref_hidden = reference_head(tensors, tokens, features, config.get("norm_before_residual", False),
                                            rms_norm_eps=eps)
    torch.testing.assert_close(logits, ref_logits, **TOL)
    torch.testing.assert_close(hidden, ref_hidden, **TOL)


def test_malformed_heads_are_refused(tmp_path):
    tensors = head_tensors()
    write_head(tmp_path / "wide_fc", tensors, target_hidden_size=HEAD["target_hidden_size"] + 16)
    with pytest.raises(WeightLoadError, match="fc.weight"):
        load_head(tmp_path / "wide_fc")
    write_head(tmp_path / "bad_d2t", {**tensors, "d2t": tensors["d2t"] + HEAD["vocab_size"]})
    with pytest.raises(WeightLoadError, match="d2t"):
        load_head(tmp_path / "bad_d2t")
    write_head(tmp_path / "no_d2t", {k: v for k, v in tensors.items() if k != "d2t"})
    with pytest.raises(WeightLoadError, match="no d2t"):
        load_head(tmp_path / "no_d2t")
    write_head(tmp_path / "plain", tensors, "LlamaForCausalLM", draft_vocab_size=None)
    with pytest.raises(ModelConfigError, match="not an EAGLE-3 head"):
        load_head(tmp_path / "plain")


def test_aux_layers_default_and_from_config():
    assert Eagle3Config(None, 32000, 4096).aux_layers(32) == (2, 16, 29)  # Llama-3.1-8B
    # the config names the layers whose output it takes: the inputs of the next ones
    assert Eagle3Config(None, 32000, 4096, aux_layer_ids=(1, 17, 33)).aux_layers(36) == (2, 18, 34)
    with pytest.raises(ModelConfigError, match="three ascending"):
        Eagle3Config(None, 32000, 4096).aux_layers(5)  # (2, 2, 2)


TARGETS = {"llama": ("llama_gqa_llama3_rope", None), "qwen3": ("qwen3_head_dim_24", None),
           "llama_first_and_last": ("llama_gqa_llama3_rope", (0, 3, 6))}


@pytest.mark.parametrize("target", list(TARGETS))
def test_aux_hidden_states_match_transformers(target, tmp_path):
    """The hidden states entering the chosen layers of a 7-layer target, for a prefill and then
    a decode token, as transformers' output_hidden_states (hidden_states[i] enters layer i); the
    logits the same with the capture as without."""
    name, layers = TARGETS[target]
    hf_model = make_model(name, tmp_path, num_hidden_layers=7)
    layers = layers or Eagle3Config(None, 0, 64).aux_layers(7)
    model = load_model(read_config(tmp_path), dtype=torch.float32, device=CPU, tp=TPGroup(), max_positions=MAX_LEN)
    ids = torch.randint(101, (9,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        hidden = hf_model(ids[None], output_hidden_states=True).hidden_states
    expected = torch.cat([hidden[i][0] for i in layers], -1)
    req_to_token, head_dim = slot_table(MAX_LEN, CPU), model.config.head_dim

    def table():
        return TokenTable(MAX_LEN, 7, model.kv_heads, head_dim, torch.float32, CPU, model.kv_shapes)

    kv, plain_kv = table(), table()
    logits, aux = model.forward(extend_batch(ids[:8], 0, req_to_token, head_dim, layers), kv)
    torch.testing.assert_close(aux, expected[:8], **TOL)
    assert torch.equal(logits, model.forward(extend_batch(ids[:8], 0, req_to_token, head_dim), plain_kv))
    logits, aux = model.forward(decode_batch(ids[8:], torch.tensor([8]), req_to_token, MAX_LEN, layers), kv)
    torch.testing.assert_close(aux, expected[8:], **TOL)
    assert torch.equal(logits, model.forward(decode_batch(ids[8:], torch.tensor([8]), req_to_token, MAX_LEN), plain_kv))
