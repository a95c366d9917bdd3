"""Tiny random PEFT LoRA adapters for a saved model directory, and PEFT's greedy tokens under them
(transformers + peft: the oracle of the LoRA tests)."""

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model_dir, out_dir, rank, alpha, targets, rslora=False, seed=0):
    """Save a PEFT adapter of the model in `model_dir` (any family) to out_dir, every A and B 0.3 times a standard normal
    (PEFT starts B at zero, which would hide an adapter that is not applied)."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0)
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out_dir)
    return out_dir


def peft_greedy(model_dir, adapter_dir, prompts, new_tokens, device: str = "cpu") -> list[list[int]]:
    """Greedy tokens of each prompt on the base model (adapter_dir None) or under the adapter, EOS ignored."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.to(device).eval()
    model.generation_config.eos_token_id = None
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            full = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                  do_sample=False)
            out.append(full[0, len(p):].tolist())
    return out
