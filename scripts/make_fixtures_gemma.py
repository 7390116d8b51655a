"""Makes the Gemma reference fixtures of tests/engine/fixtures with Hugging Face transformers: run on
the device, where torch and transformers are installed (python3 scripts/make_fixtures_gemma.py OUT_DIR).

The same recipe as ../shared/tools/make_fixtures.py (which made the other fixtures): a tiny random
model saved as config.json + model.safetensors (float32), then, in float64 with eager attention,
reference.safetensors with input_ids, logits, token logprobs, the mean next-token cross-entropy,
its gradient for every parameter, and 24 greedy tokens after an 8-token prompt.

gemma3-tiny: Gemma3ForCausalLM (text), 4 layers with layer_types sliding/full alternating (window
8 over 40-token sequences), a RoPE table per layer type (global: theta 1e6 with linear scaling x2;
local: theta 1e4), query_pre_attn_scalar 24 (not head_dim), q/k norms, sandwich norms, (1 + w)
RMSNorm weights randomised around 0, GeGLU (gelu_pytorch_tanh), sqrt(hidden) embedding scale,
tied head. No soft-capping (Gemma-3 has none).

gemma2-tiny: Gemma2ForCausalLM, the same shape with Gemma-2's soft-capping made strong enough to
bend a tiny random model's values (attn_logit_softcapping 1.0 on scores of about 0.5,
final_logit_softcapping 1.5 on logits of about 0.6), sliding/full layers alternating (window 8),
query_pre_attn_scalar 24, sandwich norms, GeGLU, embedding scale, tied head, one RoPE table
(theta 1e4).
"""
import os
import sys

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

out_root = sys.argv[1]
torch.manual_seed(0)


def specs():
    base = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
        initializer_range=0.08, bos_token_id=2, eos_token_id=1, pad_token_id=0, query_pre_attn_scalar=24,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
        hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None, attn_logit_softcapping=None,
        tie_word_embeddings=True)
    # transformers 5 keeps one RoPE parameter set per layer type; 4.x had rope_theta,
    # rope_local_base_freq and rope_scaling. Either way: global theta 1e6 scaled linearly x2,
    # local theta 1e4 unscaled.
    try:
        cfg = Gemma3TextConfig(**base, rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    except (TypeError, ValueError, KeyError) as e:
        print("legacy RoPE keys:", e, flush=True)
        cfg = Gemma3TextConfig(**base, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                               rope_scaling={"rope_type": "linear", "factor": 2.0})
    yield "gemma3-tiny", Gemma3ForCausalLM, cfg

    g2 = dict(base, attn_logit_softcapping=1.0, final_logit_softcapping=1.5)
    try:
        cfg2 = Gemma2Config(**g2)
    except (TypeError, ValueError) as e:  # a transformers without layer_types: the same pattern by default
        print("Gemma2Config without layer_types:", e, flush=True)
        g2.pop("layer_types")
        cfg2 = Gemma2Config(**g2)
    yield "gemma2-tiny", Gemma2ForCausalLM, cfg2


def randomize_norms(model):
    # Gemma's norms scale by (1 + w): w around 0 exercises the offset.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.2 * torch.randn_like(p))


for name, cls, cfg in specs():
    d = os.path.join(out_root, name)
    os.makedirs(d, exist_ok=True)
    cfg._attn_implementation = "eager"
    model = cls(cfg).float()
    randomize_norms(model)
    model.save_pretrained(d, safe_serialization=True)
    m64 = cls.from_pretrained(d, dtype=torch.float64, attn_implementation="eager")
    m64.eval()
    g = torch.Generator().manual_seed(1)
    B, T = 2, 40
    ids = torch.randint(3, cfg.vocab_size, (B, T), generator=g)
    out = m64(input_ids=ids)
    logits = out.logits
    lp = torch.log_softmax(logits[:, :-1], -1)
    nll = -lp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss = nll.mean()
    loss.backward()
    tensors = {"input_ids": ids.to(torch.int64).contiguous(), "logits": logits.detach().contiguous(),
               "token_logprobs": (-nll).detach().contiguous(), "loss": loss.detach().reshape(1)}
    for pn, p in m64.named_parameters():
        tensors["grad." + pn] = (p.grad if p.grad is not None else torch.zeros_like(p)).detach().contiguous()
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as sf:
        saved = set(sf.keys())
    for k in list(tensors):  # only what the checkpoint holds (the tied head has no tensor of its own)
        if k.startswith("grad.") and k[5:] not in saved:
            del tensors[k]
    prompt = ids[:, :8]
    with torch.no_grad():
        gen = m64.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0,
                           attention_mask=torch.ones_like(prompt))
    tensors["greedy_prompt"] = prompt.contiguous()
    tensors["greedy_output"] = gen.contiguous()
    save_file(tensors, os.path.join(d, "reference.safetensors"),
              metadata={"made_with": f"transformers {transformers.__version__}, torch {torch.__version__}",
                        "loss": repr(loss.item()),
                        "what": "logits/token_logprobs/grads in float64 for mean next-token CE over input_ids; "
                                "greedy_output = prompt + 24 greedy tokens"})
    print(name, "params", sum(p.numel() for p in m64.parameters()), "loss", loss.item(),
          "keys", sorted(saved)[:6], flush=True)
    print(open(os.path.join(d, "config.json")).read(), flush=True)
