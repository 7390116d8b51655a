"""Components with DLPack tensors: a tokenizer, a model scoring logprobs, a generator (rlhost/host.h,
ABI 0.4). Made by Host.tokenizer(), Host.model() and Host.generator(); tensors in are anything
rlhost.dlpack.as_input takes, tensors out are rlhost.Tensor."""
import ctypes
import json
import os

from .dlpack import Tensor, as_input
from .host import INVALID_ARGUMENT, Error, _check, _Text, require

_ENCODE_ADD_SPECIAL_TOKENS = 1
_DECODE_SKIP_SPECIAL_TOKENS = 1
_GENERATE_IGNORE_EOS = 1


class _ModelArgs(ctypes.Structure):  # rlhost_model_args / rlhost_generator_args
    _fields_ = [("struct_size", ctypes.c_size_t), ("path", ctypes.c_char_p), ("component", ctypes.c_char_p),
                ("config_json", ctypes.c_char_p), ("config_len", ctypes.c_size_t)]


class _LogprobsArgs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("ids", ctypes.c_void_p), ("lengths", ctypes.c_void_p),
                ("temperature", ctypes.c_double)]


class _Sampling(ctypes.Structure):  # rlh_sampling (rlhost/generator.h)
    _fields_ = [("struct_size", ctypes.c_size_t), ("temperature", ctypes.c_double), ("top_k", ctypes.c_int32),
                ("reserved0", ctypes.c_uint32), ("top_p", ctypes.c_double), ("min_p", ctypes.c_double),
                ("max_new_tokens", ctypes.c_int64), ("seed", ctypes.c_uint64), ("step", ctypes.c_int64),
                ("stop_token_ids", ctypes.POINTER(ctypes.c_int32)), ("num_stop_token_ids", ctypes.c_size_t),
                ("stop_strings", ctypes.POINTER(ctypes.c_char_p)), ("num_stop_strings", ctypes.c_size_t)]


class _GenerateArgs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("prompt_ids", ctypes.c_void_p),
                ("prompt_lengths", ctypes.c_void_p), ("samples_per_prompt", ctypes.c_int64),
                ("sampling", ctypes.POINTER(_Sampling)), ("flags", ctypes.c_uint64)]


class _Generation(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("ids", ctypes.c_void_p), ("logprobs", ctypes.c_void_p),
                ("lengths", ctypes.c_void_p), ("truncated", ctypes.c_void_p)]


def _config(config, what):
    if config is None:
        return b""
    if isinstance(config, str):
        return config.encode()
    if not isinstance(config, dict):
        raise Error(f"{what}: expected a dict or JSON text, got {type(config).__name__}", INVALID_ARGUMENT)
    return json.dumps(config, allow_nan=False).encode()


class _Handle:
    """A librlhost handle of a Host; closed with close(), `with`, or when the Host closes."""

    _close_name = None

    def __init__(self, host, handle):
        self._host = host
        self._lib = host._lib
        self._h = handle
        host._children.add(self)

    def _handle(self):
        if not self._h or not self._host._h:
            raise Error(f"the {type(self).__name__.lower()} is closed", INVALID_ARGUMENT)
        return self._h

    def close(self):
        if self._h and self._host._h:  # a closed host closed it already
            getattr(self._lib, self._close_name)(self._h)
        self._h = ctypes.c_void_p()

    def _forget(self):  # the host is closing and closes every handle itself
        self._h = ctypes.c_void_p()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Tokenizer(_Handle):
    """A tokenizer (tokenizer_hf): encode() gives int64 ids, decode() takes any int tensor."""

    _close_name = "rlhost_tokenizer_close"

    def encode(self, text, add_special_tokens=True):
        data = text.encode("utf-8")
        out = ctypes.c_void_p()
        _check(require(self._lib, "rlhost_tokenize")(self._handle(), data, len(data),
                                                      _ENCODE_ADD_SPECIAL_TOKENS if add_special_tokens else 0,
                                                      ctypes.byref(out)))
        return Tensor(out)

    def decode(self, ids, skip_special_tokens=False):
        arg = as_input(ids, "ids")
        try:
            t = _Text()
            _check(require(self._lib, "rlhost_detokenize")(self._handle(), ctypes.cast(arg.pointer, ctypes.c_void_p),
                                                           _DECODE_SKIP_SPECIAL_TOKENS if skip_special_tokens else 0,
                                                           t.fn, None))
            return t.text()
        finally:
            arg.release()


class Model(_Handle):
    """A model loaded frozen into a backend (dtensor by default) for log-probabilities."""

    _close_name = "rlhost_model_close"

    def logprobs(self, ids, lengths=None, temperature=1.0):
        """float32 of ids' shape ([T] or [B, T]): out[b, t] = log p(ids[b, t] | ids[b, <t]), 0 at t = 0
        and past lengths[b] (NeMo-RL's get_logprobs layout)."""
        a_ids = as_input(ids, "ids")
        try:
            a_len = as_input(lengths, "lengths")
            try:
                args = _LogprobsArgs(ctypes.sizeof(_LogprobsArgs), ctypes.cast(a_ids.pointer, ctypes.c_void_p),
                                     ctypes.cast(a_len.pointer, ctypes.c_void_p) if a_len else None,
                                     float(temperature))
                out = ctypes.c_void_p()
                _check(require(self._lib, "rlhost_logprobs")(self._handle(), ctypes.byref(args), ctypes.byref(out)))
                return Tensor(out)
            finally:
                if a_len:
                    a_len.release()
        finally:
            a_ids.release()


class Generation:
    """What Generator.generate returns; rows are prompt-major (row = prompt * n + sample).
    ids: int64 [N, L], prompt then new tokens, 0 after lengths; logprobs: float32 [N, L], 0 on the
    prompt and after lengths; lengths: int64 [N]; truncated: bool [N] (hit max_new_tokens)."""

    __slots__ = ("ids", "logprobs", "lengths", "truncated")

    def __init__(self, ids, logprobs, lengths, truncated):
        self.ids, self.logprobs, self.lengths, self.truncated = ids, logprobs, lengths, truncated

    def __repr__(self):
        return f"rlhost.Generation(ids={self.ids!r}, rows={len(self.lengths)})"


class Generator(_Handle):
    """A generator (the native CPU generator by default) with the model's weights."""

    _close_name = "rlhost_generator_close"

    def generate(self, prompt_ids, lengths=None, n=1, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
                 max_new_tokens=64, seed=0, stop_token_ids=(), stop_strings=(), ignore_eos=False):
        """Samples n continuations of each prompt ([T] or [B, T] ids, lengths [B] for padded rows),
        as `rlhost generate` does: the model's EOS ids stop a sample unless ignore_eos."""
        if int(seed) < 0:
            raise Error(f"seed must be a non-negative integer, got {seed}", INVALID_ARGUMENT)
        stops = [int(i) for i in stop_token_ids]
        if any(not 0 <= i < (1 << 31) for i in stops):
            raise Error(f"stop_token_ids: {stops} are not all token ids", INVALID_ARGUMENT)
        stop_arr = (ctypes.c_int32 * max(1, len(stops)))(*stops)
        enc = [s.encode("utf-8") for s in stop_strings]
        str_arr = (ctypes.c_char_p * max(1, len(enc)))(*enc)
        sp = _Sampling(ctypes.sizeof(_Sampling), float(temperature), int(top_k), 0, float(top_p), float(min_p),
                       int(max_new_tokens), int(seed), 0, stop_arr, len(stops), str_arr, len(enc))
        a_ids = as_input(prompt_ids, "prompt_ids")
        try:
            a_len = as_input(lengths, "prompt_lengths")
            try:
                args = _GenerateArgs(ctypes.sizeof(_GenerateArgs), ctypes.cast(a_ids.pointer, ctypes.c_void_p),
                                     ctypes.cast(a_len.pointer, ctypes.c_void_p) if a_len else None, int(n),
                                     ctypes.pointer(sp), _GENERATE_IGNORE_EOS if ignore_eos else 0)
                out = _Generation(ctypes.sizeof(_Generation))
                _check(require(self._lib, "rlhost_generate")(self._handle(), ctypes.byref(args), ctypes.byref(out)))
                return Generation(Tensor(out.ids), Tensor(out.logprobs), Tensor(out.lengths), Tensor(out.truncated))
            finally:
                if a_len:
                    a_len.release()
        finally:
            a_ids.release()


def _open(host, fn_name, args_or_path, cls):
    out = ctypes.c_void_p()
    _check(require(host._lib, fn_name)(host._handle(), args_or_path, ctypes.byref(out)))
    return cls(host, out)


def open_tokenizer(host, path):
    return _open(host, "rlhost_tokenizer_open", os.fsencode(path), Tokenizer)


def open_model(host, path, component, config):
    cfg = _config(config, "config")
    args = _ModelArgs(ctypes.sizeof(_ModelArgs), os.fsencode(path), component.encode() if component else None,
                      cfg or None, len(cfg))
    return _open(host, "rlhost_model_open", ctypes.byref(args), Model)


def open_generator(host, path, component, config):
    cfg = _config(config, "config")
    args = _ModelArgs(ctypes.sizeof(_ModelArgs), os.fsencode(path), component.encode() if component else None,
                      cfg or None, len(cfg))
    return _open(host, "rlhost_generator_open", ctypes.byref(args), Generator)
