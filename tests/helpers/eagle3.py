"""EAGLE-3 heads for the tests: random tensors under the published checkpoint's names, written as a
head directory, and a plain-torch reference of the head's forward written from the paper's
definition (arXiv 2503.01840; the published heads' code), not from lightllm's layers: one
sequence, full causal attention recomputed over every position each call."""

import json
import math

import torch
from safetensors.torch import save_file

# a tiny head: its own hidden 64 over a target of hidden 48 (target_hidden_size), 101 target tokens of
# which 40 are draft tokens
HEAD = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=101, draft_vocab_size=40, target_hidden_size=48, rms_norm_eps=1e-5, rope_theta=10000.0)


def head_tensors(seed: int = 0, **changes) -> dict[str, torch.Tensor]:
    """Every tensor of a head of HEAD's sizes (and `changes`) under its published name: weights
    0.15 x a standard normal, norms 1 + 0.1 x one, d2t from a random draft vocabulary."""
    c = {**HEAD, **changes}
    gen = torch.Generator().manual_seed(seed)
    h, d, inter = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    shapes = {"embed_tokens.weight": (c["vocab_size"], h), "fc.weight": (h, 3 * c["target_hidden_size"]),
              "midlayer.self_attn.q_proj.weight": (q, 2 * h), "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
              "midlayer.self_attn.v_proj.weight": (kv, 2 * h), "midlayer.self_attn.o_proj.weight": (h, q),
              "midlayer.mlp.gate_proj.weight": (inter, h), "midlayer.mlp.up_proj.weight": (inter, h),
              "midlayer.mlp.down_proj.weight": (h, inter), "lm_head.weight": (c["draft_vocab_size"], h)}
    tensors = {name: 0.15 * torch.randn(shape, generator=gen) for name, shape in shapes.items()}
    for name in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        tensors[f"{name}.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    draft_ids = torch.randperm(c["vocab_size"], generator=gen)[: c["draft_vocab_size"]].sort().values
    tensors["d2t"] = draft_ids - torch.arange(c["draft_vocab_size"])
    tensors["t2d"] = torch.zeros(c["vocab_size"], dtype=torch.bool).index_fill_(0, draft_ids, True)
    return tensors


def write_head(out_dir, tensors: dict[str, torch.Tensor], architecture: str = "LlamaForCausalLMEagle3",
               file: str = "model.safetensors", **config) -> None:
    """A head directory: config.json (HEAD's fields and `config`; None leaves a field out) and
    the tensors in `file` (safetensors, or a torch.save'd pytorch_model.bin)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    fields = {"architectures": [architecture], "model_type": "llama", "num_hidden_layers": 1, "hidden_act": "silu",
              "max_position_embeddings": 2048, "tie_word_embeddings": False, "torch_dtype": "float32", **HEAD, **config}
    (out_dir / "config.json").write_text(json.dumps({k: v for k, v in fields.items() if v is not None}))
    if file.endswith(".safetensors"):
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / file))
    else:
        torch.save(tensors, out_dir / file)


def _rms_norm(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x, positions, theta):
    """Rotary embedding, Llama's layout: the first half of each head's dims paired with the second."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions[:, None].float() * inv_freq[None]  # [n, d / 2]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    first, second = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-second, first], -1) * sin


def _attention(t, x, positions, c):
    n, d = x.shape[0], c["head_dim"]
    q = (x @ t["midlayer.self_attn.q_proj.weight"].T).view(n, -1, d)
    k = (x @ t["midlayer.self_attn.k_proj.weight"].T).view(n, -1, d)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(n, -1, d)
    q, k = _rotate(q, positions, c["rope_theta"]), _rotate(k, positions, c["rope_theta"])
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
    return out @ t["midlayer.self_attn.o_proj.weight"].T


def reference_head(t: dict[str, torch.Tensor], token_ids: list[int], features: list[torch.Tensor],
                   norm_before_residual: bool = False, **changes) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence from position 0: token_ids[p] with features[p], which is either the target's
    three hidden states concatenated [3 x target hidden] (through fc) or a hidden state of the
    head's own [hidden]. Returns the draft-vocabulary logits [n, draft vocab] and the output
    hidden states [n, hidden] (before the final norm) of every position."""
    c = {**HEAD, **changes}
    eps = c["rms_norm_eps"]
    g = torch.stack([t["fc.weight"] @ f if f.shape[0] == 3 * c["target_hidden_size"] else f for f in features])
    emb = t["embed_tokens.weight"][torch.tensor(token_ids)]
    normed_g = _rms_norm(g, t["midlayer.hidden_norm.weight"], eps)
    x = torch.cat([_rms_norm(emb, t["midlayer.input_layernorm.weight"], eps), normed_g], -1)
    stream = (normed_g if norm_before_residual else g) + _attention(t, x, torch.arange(len(token_ids)), c)
    h = _rms_norm(stream, t["midlayer.post_attention_layernorm.weight"], eps)
    mlp = t["midlayer.mlp.down_proj.weight"] @ (torch.nn.functional.silu(t["midlayer.mlp.gate_proj.weight"] @ h.T)
                                                 * (t["midlayer.mlp.up_proj.weight"] @ h.T))
    out = stream + mlp.T
    return _rms_norm(out, t["norm.weight"], eps) @ t["lm_head.weight"].T, out


def reference_target_id(t: dict[str, torch.Tensor], draft_id: int) -> int:
    return draft_id + int(t["d2t"][draft_id])
