"""ctypes bindings of rlhost/host.h (see the package docstring)."""
import ctypes
import ctypes.util
import json
import os
import threading
import weakref

# rlh_code values (abi/include/rlhost/core.h); fixed numbers, never renumbered.
codes = {
    0: "OK", 1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED",
    5: "NOT_FOUND", 6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED",
    9: "FAILED_PRECONDITION", 10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED",
    13: "INTERNAL", 14: "UNAVAILABLE", 15: "DATA_LOSS", 16: "UNAUTHENTICATED", 100: "ABI_MISMATCH",
}
CANCELLED, INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION, UNIMPLEMENTED, ABI_MISMATCH = 1, 3, 5, 9, 12, 100


class Error(Exception):
    """A failed librlhost call: `message` (one line naming what was wrong) and `code` (an RLH_E_*
    number; `code_name` spells it)."""

    def __init__(self, message, code):
        super().__init__(message)
        self.message = message
        self.code = code
        self.code_name = codes.get(code, str(code))

    def __str__(self):
        return self.message


class _Status(ctypes.Structure):
    pass


_DESTROY = ctypes.CFUNCTYPE(None, ctypes.POINTER(_Status))
_Status._fields_ = [
    ("struct_size", ctypes.c_size_t),
    ("code", ctypes.c_int32),
    ("reserved0", ctypes.c_int32),
    ("message", ctypes.c_char_p),
    ("message_len", ctypes.c_size_t),
    ("destroy", _DESTROY),
]

_WRITE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_METRIC = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_double, ctypes.c_int64)

_lib = None
_lib_lock = threading.Lock()


def load_library(path=None):
    """Loads librlhost once (path, $RLHOST_LIB, or the loader's search) and declares its API."""
    global _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        candidates = [path] if path else []
        if os.environ.get("RLHOST_LIB"):
            candidates.append(os.environ["RLHOST_LIB"])
        candidates += ["librlhost.so.0.2", "librlhost.so.0.1", "librlhost.so", ctypes.util.find_library("rlhost")]
        errors = []
        for c in candidates:
            if not c:
                continue
            try:
                lib = ctypes.CDLL(c)
                break
            except OSError as e:
                errors.append(f"{c}: {e}")
        else:
            raise Error("librlhost not found (set RLHOST_LIB to its path): " + "; ".join(errors),
                        NOT_FOUND)
        sp = ctypes.POINTER(_Status)
        h = ctypes.c_void_p
        decl = {
            "rlhost_create": ([ctypes.POINTER(h)], sp),
            "rlhost_destroy": ([h], None),
            "rlhost_add_plugin_dir": ([h, ctypes.c_char_p], sp),
            "rlhost_load_plugin": ([h, ctypes.c_char_p], sp),
            "rlhost_list_plugins": ([h, _WRITE, ctypes.c_void_p], sp),
            "rlhost_load_config": ([h, ctypes.c_char_p], sp),
            "rlhost_load_config_text": ([h, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p], sp),
            "rlhost_apply_override": ([h, ctypes.c_char_p], sp),
            "rlhost_resolve_config": ([h, _WRITE, ctypes.c_void_p], sp),
            "rlhost_check_config": ([h, _WRITE, ctypes.c_void_p], sp),
            "rlhost_run": ([h], sp),
            "rlhost_cancel": ([h], None),
            "rlhost_read_metrics": ([h, _WRITE, ctypes.c_void_p], sp),
            "rlhost_set_metric_callback": ([h, _METRIC, ctypes.c_void_p], sp),
            "rlhost_set_log_level": ([h, ctypes.c_int32], None),
            "rlhost_abi_version": ([ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32)], None),
        }
        for name, (args, res) in decl.items():
            try:
                f = getattr(lib, name)
            except AttributeError:
                raise Error(f"librlhost has no {name} (ABI older than 0.2?)", ABI_MISMATCH) from None
            f.argtypes = args
            f.restype = res
        # ABI 0.4: components with DLPack tensors (rlhost.dlpack, rlhost.components). Struct and
        # tensor pointers pass as void* (byref() or pointer objects); a librlhost without them
        # still runs jobs, and these calls raise ABI_MISMATCH.
        vp, out = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
        decl04 = {
            "rlhost_tokenizer_open": ([h, ctypes.c_char_p, out], sp),
            "rlhost_tokenizer_close": ([vp], None),
            "rlhost_tokenize": ([vp, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint64, out], sp),
            "rlhost_detokenize": ([vp, vp, ctypes.c_uint64, _WRITE, vp], sp),
            "rlhost_model_open": ([h, vp, out], sp),
            "rlhost_model_close": ([vp], None),
            "rlhost_logprobs": ([vp, vp, out], sp),
            "rlhost_generator_open": ([h, vp, out], sp),
            "rlhost_generator_close": ([vp], None),
            "rlhost_generate": ([vp, vp, vp], sp),
            "rlhost_tensor_share": ([vp, out], sp),
            "rlhost_tensor_to_legacy": ([vp, out], sp),
        }
        for name, (args, res) in decl04.items():
            f = getattr(lib, name, None)
            if f is not None:
                f.argtypes = args
                f.restype = res
        _lib = lib
        return lib


def require(lib, name):
    """librlhost's function `name`, or Error(ABI_MISMATCH) when this librlhost predates it."""
    f = getattr(lib, name, None)
    if f is None:
        raise Error(f"librlhost has no {name}: tensors need ABI 0.4 (this one is {abi_version()})", ABI_MISMATCH)
    return f


def abi_version():
    lib = load_library()
    major, minor = ctypes.c_uint32(), ctypes.c_uint32()
    lib.rlhost_abi_version(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


def _check(status):
    """Raises Error for a non-NULL status, destroying it."""
    if not status:
        return
    s = status.contents
    msg = ctypes.string_at(s.message, s.message_len).decode("utf-8", "replace") if s.message else ""
    code = s.code
    s.destroy(status)
    raise Error(msg, code)


class _Text:
    """Collects what an rlh_write_fn callback writes."""

    def __init__(self):
        self.parts = []
        self.fn = _WRITE(lambda user, data, n: self.parts.append(ctypes.string_at(data, n)))

    def text(self):
        return b"".join(self.parts).decode("utf-8", "replace")


def _to_yaml(obj):
    # JSON is YAML 1.2 (flow style): a dict goes to librlhost's YAML loader as JSON text.
    return json.dumps(obj, allow_nan=False)


class Host:
    """One librlhost host: plugins, a configuration, a job. Calls are from one thread at a time,
    except cancel(), which any thread (or a metrics callback) may call."""

    def __init__(self, library=None, log_level=None):
        self._lib = load_library(library)
        self._h = ctypes.c_void_p()
        _check(self._lib.rlhost_create(ctypes.byref(self._h)))
        self._callback = None
        self._callback_error = None
        self._children = weakref.WeakSet()  # open tokenizers, models, generators
        if log_level is not None:
            self.set_log_level(log_level)

    # -- lifetime --------------------------------------------------------------------------
    def close(self):
        """Destroys the host, and with it every tokenizer, model and generator still open."""
        if self._h:
            for c in list(self._children):
                c._forget()
            self._lib.rlhost_destroy(self._h)
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

    def _handle(self):
        if not self._h:
            raise Error("the host is closed", FAILED_PRECONDITION)
        return self._h

    # -- plugins ---------------------------------------------------------------------------
    def add_plugin_dir(self, folder):
        _check(self._lib.rlhost_add_plugin_dir(self._handle(), os.fsencode(folder)))

    def load_plugin(self, name_or_path):
        _check(self._lib.rlhost_load_plugin(self._handle(), os.fsencode(name_or_path)))

    def load_plugins(self, names):
        for n in names:
            self.load_plugin(n)

    def plugins(self):
        """Every plugin found and loaded, as librlhost describes them (a list of dicts)."""
        t = _Text()
        _check(self._lib.rlhost_list_plugins(self._handle(), t.fn, None))
        return json.loads(t.text())

    # -- configuration ---------------------------------------------------------------------
    def load_config(self, source, origin=None):
        """A YAML file path, YAML text (a str containing a newline), or a dict."""
        if isinstance(source, dict):
            text = _to_yaml(source).encode()
            _check(self._lib.rlhost_load_config_text(self._handle(), text, len(text),
                                                     (origin or "dict").encode()))
        elif isinstance(source, str) and "\n" in source:
            text = source.encode()
            _check(self._lib.rlhost_load_config_text(self._handle(), text, len(text),
                                                     (origin or "yaml text").encode()))
        else:
            _check(self._lib.rlhost_load_config(self._handle(), os.fsencode(source)))

    def override(self, *overrides):
        """Command-line style overrides: "a.b=v", "++a.b=v", "+a.b=v", "~a.b"."""
        for o in overrides:
            _check(self._lib.rlhost_apply_override(self._handle(), o.encode()))

    def set(self, key, value, add=True):
        """Sets one key to a Python value (JSON-encoded, so strings stay strings)."""
        self.override(("++" if add else "") + f"{key}={json.dumps(value)}")

    def resolved_config(self):
        """The resolved configuration as YAML text."""
        t = _Text()
        _check(self._lib.rlhost_resolve_config(self._handle(), t.fn, None))
        return t.text()

    def check_config(self):
        """The check a run makes at start: {"accepted": [...], "unused": [...], "refused": [...]};
        raises Error (code UNIMPLEMENTED) naming the first refused setting."""
        t = _Text()
        _check(self._lib.rlhost_check_config(self._handle(), t.fn, None))
        return json.loads(t.text())

    # -- the job ---------------------------------------------------------------------------
    def run(self, on_metric=None):
        """Runs the job to completion. `on_metric(name, value, step)` is called for every metric
        as it is recorded (from the job's thread); it may call cancel(). An exception it raises
        cancels the job and is re-raised here."""
        h = self._handle()
        self._callback_error = None
        if on_metric is not None:
            def trampoline(user, name, value, step):
                try:
                    on_metric(name.decode("utf-8", "replace"), value, step)
                except BaseException as e:  # noqa: BLE001 (handed back to run's caller)
                    if self._callback_error is None:
                        self._callback_error = e
                    self._lib.rlhost_cancel(h)
            self._callback = _METRIC(trampoline)
        else:
            self._callback = ctypes.cast(None, _METRIC)
        _check(self._lib.rlhost_set_metric_callback(h, self._callback, None))
        try:
            _check(self._lib.rlhost_run(h))
        except Error:
            if self._callback_error is not None:
                raise self._callback_error
            raise
        finally:
            self._lib.rlhost_set_metric_callback(h, ctypes.cast(None, _METRIC), None)
        if self._callback_error is not None:
            raise self._callback_error

    def cancel(self):
        """Stops a running job (any thread); run() then raises Error with code CANCELLED."""
        if self._h:
            self._lib.rlhost_cancel(self._h)

    def metrics(self):
        """Every metric recorded so far: a list of {"name", "value", "step"}."""
        t = _Text()
        _check(self._lib.rlhost_read_metrics(self._handle(), t.fn, None))
        return [json.loads(line) for line in t.text().splitlines() if line]

    # -- components with tensors (ABI 0.4; rlhost.components) -----------------------------
    def _load_optional(self, names):
        for n in names:
            try:
                self.load_plugin(n)
            except Error:
                pass

    def tokenizer(self, path, load_plugins=True):
        """A Tokenizer for a tokenizer.json, a model folder or a hub id (loads tokenizer_hf)."""
        from . import components
        if load_plugins:
            self.load_plugin("tokenizer_hf")
        return components.open_tokenizer(self, path)

    def model(self, path, backend=None, device="cpu", precision="float32", config=None, load_plugins=True):
        """A Model for logprobs, as `rlhost logprobs` loads it: the backend (dtensor, or megatron
        with a cuda device) gets {"device", "precision"} and `config` (a dict: more of the
        policy section) as its config section. Loads model_llama, the backend and kernels_cpu."""
        from . import components
        name = backend or ("megatron" if str(device).startswith("cuda") else "dtensor")
        section = {"device": device, "precision": precision}
        section.update(config or {})
        if load_plugins:
            self.load_plugins(["model_llama", name])
            self._load_optional(["kernels_cpu"])
        return components.open_model(self, path, name, section)

    def generator(self, path, generator=None, config=None, load_plugins=True):
        """A Generator, as `rlhost generate` makes it: `generator` names the component (default
        the best loaded), `config` (a dict) is its section. Loads model_llama, generator and,
        for the tokenizer's EOS ids and stop strings, tokenizer_hf."""
        from . import components
        if load_plugins:
            self.load_plugins(["model_llama", "generator"])
            self._load_optional(["tokenizer_hf"])
        return components.open_generator(self, path, generator, config)

    def set_log_level(self, level):
        """trace, debug, info, warning or error (or the RLH_LOG_* number)."""
        names = {"trace": 0, "debug": 1, "info": 2, "warning": 3, "warn": 3, "error": 4}
        self._lib.rlhost_set_log_level(self._handle(), names[level] if isinstance(level, str) else int(level))
