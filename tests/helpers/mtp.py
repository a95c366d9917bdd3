"""A hybrid checkpoint's MTP layer in tests: random `mtp.*` tensors written beside a tiny model's,
and the layer computed with transformers' own modules (the oracle of the runner's drafts)."""

import json

import torch
from safetensors.torch import load_file, save_file


def add_mtp(model_dir, seed: int = 5, scale: float = 0.15) -> dict[str, torch.Tensor]:
    """Write random mtp.* tensors into model_dir's checkpoint (the decoder layer's shapes are its
    first full-attention layer's) and mtp_num_hidden_layers = 1 into its config; returns them."""
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    layer = next(n.split(".self_attn.")[0] for n in sorted(tensors) if n.endswith("self_attn.q_proj.weight"))
    gen = torch.Generator().manual_seed(seed)
    hidden = tensors["model.embed_tokens.weight"].shape[1]

    def rand(shape, norm=False):
        noise = torch.randn(shape, generator=gen)
        return 0.1 * noise if norm else scale * noise  # zero-centred norms: weight 0 is a scale of 1

    mtp = {f"mtp.layers.0{name[len(layer):]}": rand(t.shape, "norm" in name) for name, t in tensors.items()
           if name.startswith(layer + ".")}
    mtp["mtp.fc.weight"] = rand((hidden, 2 * hidden))
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{name}.weight"] = rand((hidden,), norm=True)
    save_file({**tensors, **mtp}, path, metadata={"format": "pt"})
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["mtp_num_hidden_layers"] = 1
    config_path.write_text(json.dumps(config))
    return mtp


@torch.no_grad()
def reference_chain(hf_model, mtp: dict[str, torch.Tensor], sequence: list[int], k: int) -> list[int]:
    """The MTP layer's greedy chain of k drafts after `sequence` (a prompt and its first sampled
    token): row p reads the target's final hidden state at p and token p + 1; each chained row reads
    the layer's own output of the row before and the draft before."""
    with torch.no_grad():
        hidden = hf_model.model(torch.tensor([sequence[:-1]])).last_hidden_state[0]
    tokens, drafts = sequence[1:], []
    for _ in range(k):
        logits, out = reference_mtp(hf_model, mtp, tokens, hidden)
        drafts.append(int(logits[-1].argmax()))
        tokens, hidden = tokens + drafts[-1:], torch.cat([hidden, out[-1:]])
    return drafts


@torch.no_grad()
def reference_mtp(hf_model, mtp: dict[str, torch.Tensor], tokens: list[int],
                  hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP layer's logits [T, vocab] and output hidden states [T, hidden] over a whole sequence,
    with transformers' modules: row p reads hidden[p] and the embedding of tokens[p]."""
    inner = hf_model.model
    layer_index = next(i for i, t in enumerate(hf_model.config.layer_types) if t == "full_attention")
    layer = type(inner.layers[layer_index])(hf_model.config, layer_index).eval()
    layer.load_state_dict({n[len("mtp.layers.0."):]: t for n, t in mtp.items() if n.startswith("mtp.layers.0.")})
    norm_cls = type(inner.norm)

    def norm(name):
        module = norm_cls(hf_model.config.hidden_size, eps=hf_model.config.rms_norm_eps)
        module.weight.copy_(mtp[f"mtp.{name}.weight"])
        return module

    ids = torch.tensor([tokens])
    x = torch.cat([norm("pre_fc_norm_embedding")(inner.embed_tokens(ids)), norm("pre_fc_norm_hidden")(hidden[None])],
                  dim=-1) @ mtp["mtp.fc.weight"].T
    positions = torch.arange(len(tokens))[None]
    out = layer(x, position_embeddings=inner.rotary_emb(x, positions), attention_mask=_causal(len(tokens)),
                position_ids=positions)
    out = out[0] if isinstance(out, tuple) else out
    out = norm("norm")(out)[0]
    return hf_model.lm_head(out), out


def _causal(n: int) -> torch.Tensor:
    return torch.full((n, n), float("-inf")).triu(1)[None, None]
