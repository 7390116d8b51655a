#!/usr/bin/env python3
"""librlhost embedded from Python with ctypes alone: the C API needs no C++ and no headers at
run time. Creates a host, loads configuration text, applies overrides, resolves it, lists plugins,
checks error statuses, and destroys the host."""
import ctypes
import json
import sys

lib = ctypes.CDLL(sys.argv[1])


class Status(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("code", ctypes.c_int32), ("reserved0", ctypes.c_uint32),
                ("message", ctypes.c_char_p), ("message_len", ctypes.c_size_t),
                ("destroy", ctypes.CFUNCTYPE(None, ctypes.c_void_p))]


WRITE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
StatusP = ctypes.POINTER(Status)
for name, args in [("rlhost_create", [ctypes.POINTER(ctypes.c_void_p)]),
                   ("rlhost_load_config_text", [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p]),
                   ("rlhost_apply_override", [ctypes.c_void_p, ctypes.c_char_p]),
                   ("rlhost_resolve_config", [ctypes.c_void_p, WRITE, ctypes.c_void_p]),
                   ("rlhost_list_plugins", [ctypes.c_void_p, WRITE, ctypes.c_void_p]),
                   ("rlhost_load_plugin", [ctypes.c_void_p, ctypes.c_char_p])]:
    getattr(lib, name).restype = StatusP
    getattr(lib, name).argtypes = args
lib.rlhost_destroy.argtypes = [ctypes.c_void_p]
lib.rlhost_abi_version.argtypes = [ctypes.POINTER(ctypes.c_uint32)] * 2


def check(status, what):
    if status:
        msg = status.contents.message.decode()
        status.contents.destroy(ctypes.cast(status, ctypes.c_void_p))
        raise RuntimeError(f"{what}: {msg}")


def collect():
    chunks = []
    fn = WRITE(lambda user, data, n: chunks.append(ctypes.string_at(data, n)))
    return chunks, fn


major, minor = ctypes.c_uint32(), ctypes.c_uint32()
lib.rlhost_abi_version(ctypes.byref(major), ctypes.byref(minor))
assert major.value == 0, major.value

host = ctypes.c_void_p()
check(lib.rlhost_create(ctypes.byref(host)), "create")
text = b"grpo:\n  num_prompts_per_step: 4\npolicy:\n  train_global_batch_size: ${mul:${grpo.num_prompts_per_step},8}\n"
check(lib.rlhost_load_config_text(host, text, len(text), b"python"), "load")
check(lib.rlhost_apply_override(host, b"grpo.num_prompts_per_step=2"), "override")
chunks, fn = collect()
check(lib.rlhost_resolve_config(host, fn, None), "resolve")
resolved = b"".join(chunks).decode()
assert "train_global_batch_size: 16" in resolved, resolved

# Errors come back as statuses with a code and one-line message.
bad = lib.rlhost_apply_override(host, b"grpo.nope=1")
assert bad and bad.contents.code == 3 and b"grpo.nope" in bad.contents.message, "expected INVALID_ARGUMENT"
bad.contents.destroy(ctypes.cast(bad, ctypes.c_void_p))
missing = lib.rlhost_load_plugin(host, b"/nonexistent/libnope.so")
assert missing and missing.contents.code == 5, "expected NOT_FOUND"
missing.contents.destroy(ctypes.cast(missing, ctypes.c_void_p))

chunks, fn = collect()
check(lib.rlhost_list_plugins(host, fn, None), "list")
listing = json.loads(b"".join(chunks))
assert isinstance(listing, list)
assert any(p.get("path") == "/nonexistent/libnope.so" for p in listing), listing

lib.rlhost_destroy(host)
print("librlhost embedded from Python: ok")
