"""Records what Hugging Face transformers makes of each hand-written config in this folder.

Run where transformers and torch are installed (the device machine):
    python3 make_hf_expectations.py <configs folder> <out folder>
For every <name>.json it writes <name>.hf.json with the tensors save_pretrained writes (name ->
shape), the rotary inv_freq and attention_scaling HF computes, each layer's sliding window and
the attention softmax scale. It also writes rope_golden.json: HF inv_freq for RoPE cases that no
supported architecture config reaches (longrope, dynamic beyond the context, partial rotary).
test_describe_config.cpp compares describe() and rope_inv_freq() against these files, so the
expected values come from HF, not from the code under test.
"""
import glob, json, os, struct, sys, tempfile

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

src, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)


def st_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


def saved_tensors(model):
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        tensors = {}
        for p in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
            for k, v in st_header(p).items():
                if k != "__metadata__":
                    tensors[k] = v["shape"]
        return tensors


for path in sorted(glob.glob(os.path.join(src, "*.json"))):
    if path.endswith(".hf.json") or os.path.basename(path) == "rope_golden.json":
        continue
    name = os.path.basename(path)[:-5]
    with tempfile.TemporaryDirectory() as d:
        with open(path) as f, open(os.path.join(d, "config.json"), "w") as g:
            g.write(f.read())
        cfg = AutoConfig.from_pretrained(d)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    rot = model.model.rotary_emb
    layers = model.model.layers
    sliding = []
    for layer in layers:
        if cfg.model_type in ("mistral", "mixtral"):
            sliding.append(cfg.sliding_window)
        else:
            sliding.append(getattr(layer.self_attn, "sliding_window", None))
    rec = {
        "transformers": transformers.__version__,
        "tensors": saved_tensors(model),
        "inv_freq": [float(x) for x in rot.inv_freq.tolist()],
        "attention_scaling": float(rot.attention_scaling),
        "sliding_window": [s if s else 0 for s in sliding],
        "softmax_scale": float(layers[0].self_attn.scaling),
    }
    with open(os.path.join(out, name + ".hf.json"), "w") as f:
        json.dump(rec, f, indent=1, sort_keys=True)
    print("ok", name, len(rec["tensors"]))

# RoPE cases beyond the architecture configs. "desc" is the RopeDesc the test builds.
golden = []


def add(label, cfg, desc, seq_len=None):
    kind = cfg.rope_parameters["rope_type"]
    inv, scale = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu", seq_len=seq_len)
    golden.append({"label": label, "desc": desc, "seq_len": seq_len or 0,
                   "inv_freq": [float(x) for x in inv.tolist()], "attention_scaling": float(scale)})


common = dict(vocab_size=32, hidden_size=64, num_attention_heads=4, num_hidden_layers=1, max_position_embeddings=256)
short = [1.0, 1.1, 1.3, 1.7, 2.2, 3.0, 4.1, 5.5]
long_ = [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0]
lr = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short, "long_factor": long_,
      "original_max_position_embeddings": 64}
c = LlamaConfig(**common, rope_parameters=dict(lr))
d = {"kind": "longrope", "theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
     "max_position_embeddings": 256, "short_factor": short, "long_factor": long_, "rotary_dim": 16}
add("longrope_short", c, d, None)
add("longrope_long", LlamaConfig(**common, rope_parameters=dict(lr)), d, 100)
dyn = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 3.0}
d = {"kind": "dynamic", "theta": 10000.0, "factor": 3.0, "max_position_embeddings": 256, "rotary_dim": 16}
add("dynamic_within", LlamaConfig(**common, rope_parameters=dict(dyn)), d, 100)
add("dynamic_beyond", LlamaConfig(**common, rope_parameters=dict(dyn)), d, 1000)
pr = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0, "partial_rotary_factor": 0.5}
d = {"kind": "linear", "theta": 10000.0, "factor": 2.0, "rotary_dim": 8, "partial_rotary_factor": 0.5}
add("linear_partial", LlamaConfig(**common, rope_parameters=dict(pr)), d, None)
ym = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 64,
      "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}
d = {"kind": "yarn", "theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 64,
     "max_position_embeddings": 256, "mscale": 1.0, "mscale_all_dim": 0.707, "rotary_dim": 16}
add("yarn_mscale", LlamaConfig(**common, rope_parameters=dict(ym)), d, None)
yn = {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 16.0, "original_max_position_embeddings": 64,
      "attention_factor": 1.25, "beta_fast": 8, "beta_slow": 0.5, "truncate": False}
d = {"kind": "yarn", "theta": 500000.0, "factor": 16.0, "original_max_position_embeddings": 64,
     "max_position_embeddings": 256, "attention_factor": 1.25, "beta_fast": 8.0, "beta_slow": 0.5,
     "truncate": False, "rotary_dim": 16}
add("yarn_attention_factor_no_truncate", LlamaConfig(**common, rope_parameters=dict(yn)), d, None)
l3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}
c = LlamaConfig(vocab_size=32, hidden_size=4096, num_attention_heads=32, num_hidden_layers=1,
                max_position_embeddings=131072, rope_parameters=dict(l3))
d = {"kind": "llama3", "theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192, "max_position_embeddings": 131072, "rotary_dim": 128}
add("llama32_like", c, d, None)
with open(os.path.join(out, "rope_golden.json"), "w") as f:
    json.dump(golden, f, indent=1)
print("golden", len(golden))
