"""rlhost from Python: ctypes over librlhost's embedding C API (rlhost/host.h), standard library only.

    import rlhost
    with rlhost.Host() as h:
        h.load_plugins(["dtensor", "generator", "grpo", "environments", "tokenizer_hf",
                        "model_llama", "kernels_cpu"])
        h.load_config("examples/configs/grpo_demo_cpu.yaml")       # or a dict / YAML text
        h.override("grpo.max_num_steps=3")
        h.run(on_metric=lambda name, value, step: print(name, value, step))
        print(h.metrics()[-1])

Tensors in and out as DLPack (ABI 0.4):

    import numpy, torch
    with rlhost.Host() as h:
        tok = h.tokenizer("model_dir")
        ids = tok.encode("1+2=")                            # rlhost.Tensor, int64 [n]
        lp = h.model("model_dir").logprobs(numpy.stack([ids, ids]))   # float32 [2, n]
        out = h.generator("model_dir").generate(torch.from_dlpack(ids), n=4, seed=1)
        print(numpy.from_dlpack(out.ids), tok.decode(ids))

rlhost.Tensor exports a "dltensor_versioned" capsule to DLPack 1.x consumers and the legacy
"dltensor" capsule to older ones (numpy 1.24, torch 1.13); inputs are numpy arrays, torch tensors,
rlhost.Tensor, capsules of either kind, or lists of ints.

librlhost is found through $RLHOST_LIB (a path to librlhost.so), else the dynamic loader's path
(librlhost.so.0.1 / librlhost.so). Errors are rlhost.Error(message, code); code is one of the
RLH_E_* status codes (rlhost.codes).
"""
from .components import Generation, Generator, Model, Tokenizer
from .dlpack import Tensor
from .host import (ABI_MISMATCH, CANCELLED, FAILED_PRECONDITION, INVALID_ARGUMENT, NOT_FOUND, UNIMPLEMENTED,
                   Error, Host, abi_version, codes, load_library)

__all__ = ["Error", "Generation", "Generator", "Host", "Model", "Tensor", "Tokenizer", "abi_version", "codes",
           "load_library"]
__version__ = "0.3.0"
