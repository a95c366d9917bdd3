"""The target's auxiliary hidden states (an EAGLE-3 head's features) against transformers'
output_hidden_states. fp32 on the CPU, atol = rtol = 1e-4."""

import pytest
import torch
from helpers.models import make_model
from benchmark.lib.one_request import decode_batch, extend_batch, slot_table

from lightllm.common.token_table import TokenTable
from lightllm.models import load_model, read_config
from lightllm.utils.dist import TPGroup

TOL = dict(atol=1e-4, rtol=1e-4)
MAX_LEN = 32
CPU = torch.device("cpu")


TARGETS = {"llama": ("llama_gqa_llama3_rope", (2, 3, 4)), "qwen3": ("qwen3_head_dim_24", (2, 3, 4)),
           "llama_first_and_last": ("llama_gqa_llama3_rope", (0, 3, 6))}


@pytest.mark.parametrize("target", list(TARGETS))
def test_aux_hidden_states_match_transformers(target, tmp_path):
    """The hidden states entering the chosen layers of a 7-layer target, for a prefill and then
    a decode token, as transformers' output_hidden_states (hidden_states[i] enters layer i); the
    logits the same with the capture as without."""
    name, layers = TARGETS[target]
    hf_model = make_model(name, tmp_path, num_hidden_layers=7)
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
