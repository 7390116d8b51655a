"""A random-weight Llama checkpoint in Hugging Face's layout, a tokenizer and a prompt file for the
GRPO step benchmark (bench/grpo_cuda/run.sh), so rlhost and the PyTorch peer run the same shape.

    python3 make_model.py OUT [--shape llama1b|small] [--prompts N] [--prompt-len P]

Writes OUT/model/{config.json, model.safetensors (bf16, tied embeddings), tokenizer.json,
tokenizer_config.json} and OUT/train.jsonl.

The tokenizer is a BPE over single characters with no merges: token i is the code point 0x10000 + i
(four UTF-8 bytes, never a surrogate), so any string of those characters encodes one token per
character. A prompt of P such characters is exactly P tokens, and the vocabulary is the model's
(128,256 at Llama-3.2-1B's shape, which sets the head's cost). The rewards (the math environment
against an answer a random model never writes) are all 0: the step's work does not depend on them.

numpy is used where it is installed (the device); without it the weights are drawn in pure
Python, which is only fast enough for the small shape (a dry run on a CPU machine)."""
import argparse, json, os, random, struct

SHAPES = {
    # Llama-3.2-1B (bench/generator_cuda, torch_grpo_step.py)
    "llama1b": dict(vocab=128256, hidden=2048, ffn=8192, layers=16, heads=32, kv_heads=8, head_dim=64),
    # Llama-3.1-8B's layers (bench/parallel's multi-GPU runs; tied here, untied in the original)
    "llama8b": dict(vocab=128256, hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8, head_dim=128),
    "small": dict(vocab=4096, hidden=128, ffn=256, layers=2, heads=4, kv_heads=2, head_dim=32),
}


def tensors(s):
    """(name, shape, is_norm) of every weight, HF names, tied embeddings (no lm_head)."""
    C, F, D = s["hidden"], s["ffn"], s["head_dim"]
    out = [("model.embed_tokens.weight", (s["vocab"], C), False), ("model.norm.weight", (C,), True)]
    for l in range(s["layers"]):
        p = f"model.layers.{l}."
        out += [(p + "input_layernorm.weight", (C,), True), (p + "post_attention_layernorm.weight", (C,), True),
                (p + "self_attn.q_proj.weight", (s["heads"] * D, C), False),
                (p + "self_attn.k_proj.weight", (s["kv_heads"] * D, C), False),
                (p + "self_attn.v_proj.weight", (s["kv_heads"] * D, C), False),
                (p + "self_attn.o_proj.weight", (C, s["heads"] * D), False),
                (p + "mlp.gate_proj.weight", (F, C), False), (p + "mlp.up_proj.weight", (F, C), False),
                (p + "mlp.down_proj.weight", (C, F), False)]
    return out


def bf16_bytes(name, shape, is_norm, seed):
    n = 1
    for d in shape:
        n *= d
    try:
        import numpy as np
        if is_norm:
            x = np.ones(n, dtype=np.float32)
        else:
            x = np.random.default_rng(seed).standard_normal(n, dtype=np.float32) * np.float32(0.02)
        u = x.view(np.uint32)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # round to nearest even
        return u.astype(np.uint16).tobytes()
    except ImportError:
        rng = random.Random(seed)
        vals = [1.0] * n if is_norm else [rng.gauss(0.0, 0.02) for _ in range(n)]
        out = bytearray()
        for v in vals:
            (u,) = struct.unpack("<I", struct.pack("<f", v))
            u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
            out += struct.pack("<H", u & 0xFFFF)
        return bytes(out)


def write_safetensors(path, s):
    specs = tensors(s)
    header, offset = {}, 0
    for name, shape, _ in specs:
        n = 2
        for d in shape:
            n *= d
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for i, (name, shape, is_norm) in enumerate(specs):
            f.write(bf16_bytes(name, shape, is_norm, 1000 + i))


def token(i):
    return chr(0x10000 + i)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", default="llama1b", choices=sorted(SHAPES))
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    a = ap.parse_args()
    s = SHAPES[a.shape]
    m = os.path.join(a.out, "model")
    os.makedirs(m, exist_ok=True)
    V = s["vocab"]
    bos, eos = V - 2, V - 1  # the last two characters stand for them
    json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V,
               "hidden_size": s["hidden"], "intermediate_size": s["ffn"], "num_hidden_layers": s["layers"],
               "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"], "head_dim": s["head_dim"],
               "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
               "hidden_act": "silu", "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
               "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": "bfloat16"},
              open(os.path.join(m, "config.json"), "w"), indent=1)
    vocab = {token(i): i for i in range(V - 2)}
    tok = {"version": "1.0", "truncation": None, "padding": None,
           "added_tokens": [{"id": bos, "content": "<bos>", "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True},
                            {"id": eos, "content": "<eos>", "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True}],
           "normalizer": None, "pre_tokenizer": None, "post_processor": None, "decoder": None,
           "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                     "vocab": vocab, "merges": []}}
    json.dump(tok, open(os.path.join(m, "tokenizer.json"), "w", encoding="utf-8"), ensure_ascii=False)
    json.dump({"bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": False, "model_max_length": 8192,
               "tokenizer_class": "PreTrainedTokenizerFast"}, open(os.path.join(m, "tokenizer_config.json"), "w"))
    write_safetensors(os.path.join(m, "model.safetensors"), s)
    rng = random.Random(7)
    with open(os.path.join(a.out, "train.jsonl"), "w", encoding="utf-8") as f:
        for _ in range(a.prompts):
            text = "".join(token(rng.randrange(V - 2)) for _ in range(a.prompt_len))
            f.write(json.dumps({"problem": text, "expected_answer": "42"}, ensure_ascii=False) + "\n")
    print(f"{a.shape}: {m} ({sum(1 for _ in tensors(s))} tensors), {a.prompts} prompts of {a.prompt_len} tokens")


if __name__ == "__main__":
    main()
