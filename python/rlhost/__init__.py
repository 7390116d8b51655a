"""rlhost from Python: ctypes over librlhost's embedding C API (rlhost/host.h), standard library only.

    import rlhost
    with rlhost.Host() as h:
        h.load_plugins(["dtensor", "generator", "grpo", "environments", "tokenizer_hf",
                        "model_llama", "kernels_cpu"])
        h.load_config("examples/configs/grpo_demo_cpu.yaml")       # or a dict / YAML text
        h.override("grpo.max_num_steps=3")
        h.run(on_metric=lambda name, value, step: print(name, value, step))
        print(h.metrics()[-1])

librlhost is found through $RLHOST_LIB (a path to librlhost.so), else the dynamic loader's path
(librlhost.so.0.1 / librlhost.so). Errors are rlhost.Error(message, code); code is one of the
RLH_E_* status codes (rlhost.codes).
"""
from .host import (ABI_MISMATCH, CANCELLED, FAILED_PRECONDITION, INVALID_ARGUMENT, NOT_FOUND, UNIMPLEMENTED,
                   Error, Host, abi_version, codes, load_library)

__all__ = ["Error", "Host", "abi_version", "codes", "load_library"]
__version__ = "0.2.0"
