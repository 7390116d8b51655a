"""DLPack tensors in and out of librlhost, with ctypes only.

Out: rlhost.Tensor owns a tensor librlhost made (DLManagedTensorVersioned) and exports it through
__dlpack__: a "dltensor_versioned" capsule when the consumer asks for DLPack 1.x (max_version),
else the legacy "dltensor" capsule that numpy < 2.1 and torch < 2.3 read. Each export is another
owner of the same memory (rlhost_tensor_share), so the Tensor stays usable.

In: an rlhost.Tensor, a DLPack capsule of either kind, any object with __dlpack__ (numpy arrays,
torch tensors), or a list of ints (nested for two dimensions). Capsules are consumed as the
protocol says: renamed "used_..." and their deleter called once librlhost has read them.
"""
import ctypes

from .host import INVALID_ARGUMENT, Error, _check, load_library

# ---- DLPack's structs (abi/include/rlhost/tensor.h lays them out the same way) ------------------


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32), ("dtype", _DType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _Managed(ctypes.Structure):  # DLManagedTensorVersioned = rlh_managed_tensor
    pass


_MANAGED_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_Managed))
_Managed._fields_ = [("version", _Version), ("manager_ctx", ctypes.c_void_p), ("deleter", _MANAGED_DELETER),
                     ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


class _Legacy(ctypes.Structure):  # DLManagedTensor = rlhost_legacy_tensor
    pass


_LEGACY_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_Legacy))
_Legacy._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _LEGACY_DELETER)]

CPU, CUDA, CUDA_HOST = 1, 2, 3
_DEVICE_NAMES = {1: "CPU", 2: "CUDA", 3: "CUDA host", 4: "OpenCL", 7: "Vulkan", 8: "Metal", 10: "ROCm",
                 13: "CUDA managed", 14: "oneAPI"}
_DTYPES = {(0, 8): "int8", (0, 16): "int16", (0, 32): "int32", (0, 64): "int64", (1, 8): "uint8",
           (1, 16): "uint16", (1, 32): "uint32", (1, 64): "uint64", (2, 16): "float16", (2, 32): "float32",
           (2, 64): "float64", (4, 16): "bfloat16", (6, 8): "bool"}
_CTYPES = {"int32": ctypes.c_int32, "int64": ctypes.c_int64, "float32": ctypes.c_float, "uint8": ctypes.c_uint8,
           "bool": ctypes.c_uint8}

# ---- capsules ------------------------------------------------------------------------------------
# Capsule names must outlive their capsules: module constants, also bound into the destructor.
_V_NAME, _L_NAME = b"dltensor_versioned", b"dltensor"
_V_USED, _L_USED = b"used_dltensor_versioned", b"used_dltensor"


def _pyapi(name, argtypes, restype):
    f = ctypes.pythonapi[name]  # a fresh function object: its own argtypes
    f.argtypes = argtypes
    f.restype = restype
    return f


_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_capsule_new = _pyapi("PyCapsule_New", [ctypes.c_void_p, ctypes.c_char_p, _DESTRUCTOR], ctypes.py_object)
_capsule_get = _pyapi("PyCapsule_GetPointer", [ctypes.py_object, ctypes.c_char_p], ctypes.c_void_p)
_capsule_set_name = _pyapi("PyCapsule_SetName", [ctypes.py_object, ctypes.c_char_p], ctypes.c_int)
_capsule_name = _pyapi("PyCapsule_GetName", [ctypes.py_object], ctypes.c_char_p)
_is_capsule = _pyapi("PyCapsule_IsValid", [ctypes.py_object, ctypes.c_char_p], ctypes.c_int)


def _make_destructor():
    # Runs when a capsule we made is freed. A consumer that took the tensor renamed the capsule
    # ("used_...") and owns it; otherwise it was never consumed and its deleter is ours to call.
    # Everything it needs is bound here, so it still works while the interpreter shuts down.
    is_valid = _pyapi("PyCapsule_IsValid", [ctypes.c_void_p, ctypes.c_char_p], ctypes.c_int)
    get = _pyapi("PyCapsule_GetPointer", [ctypes.c_void_p, ctypes.c_char_p], ctypes.c_void_p)

    def destroy(capsule, v_name=_V_NAME, l_name=_L_NAME, managed=_Managed, legacy=_Legacy,
                cast=ctypes.cast, pointer=ctypes.POINTER):
        if is_valid(capsule, v_name):
            m = cast(get(capsule, v_name), pointer(managed))
            if m.contents.deleter:
                m.contents.deleter(m)
        elif is_valid(capsule, l_name):
            m = cast(get(capsule, l_name), pointer(legacy))
            if m.contents.deleter:
                m.contents.deleter(m)

    fn = _DESTRUCTOR(destroy)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(fn))  # never freed: capsules may die at exit
    return fn


_capsule_destructor = _make_destructor()


def _fail(message):
    raise Error(message, INVALID_ARGUMENT)


def _dtype_name(dt):
    name = _DTYPES.get((dt.code, dt.bits))
    if name is None:
        name = f"code {dt.code}/{dt.bits} bits"
    return name if dt.lanes == 1 else f"{name}x{dt.lanes}"


def _device_name(device_type):
    return _DEVICE_NAMES.get(device_type, f"device type {device_type}")


# ---- out -----------------------------------------------------------------------------------------


class Tensor:
    """A tensor librlhost made: CPU memory, row-major. Hand it to numpy.from_dlpack,
    torch.utils.dlpack.from_dlpack (or torch.from_dlpack), or back to rlhost; tolist() reads it."""

    __slots__ = ("_m", "_lib", "__weakref__")

    def __init__(self, managed):
        self._lib = load_library()
        self._m = ctypes.cast(managed, ctypes.POINTER(_Managed))

    def __del__(self):
        try:
            m = self._m
            if m:
                self._m = type(m)()
                m.contents.deleter(m)
        except Exception:  # noqa: BLE001 (half-built object, or the interpreter is shutting down)
            pass

    def _t(self):
        if not self._m:
            _fail("the tensor was freed")
        return self._m.contents.dl_tensor

    @property
    def shape(self):
        t = self._t()
        return tuple(t.shape[i] for i in range(t.ndim))

    @property
    def ndim(self):
        return self._t().ndim

    @property
    def dtype(self):
        return _dtype_name(self._t().dtype)

    def __len__(self):
        s = self.shape
        return s[0] if s else 1

    def numel(self):
        n = 1
        for d in self.shape:
            n *= d
        return n

    def tolist(self):
        t = self._t()
        flat = ctypes.cast(t.data, ctypes.POINTER(_CTYPES[self.dtype]))[:self.numel()]
        if self.dtype == "bool":
            flat = [bool(x) for x in flat]
        shape = self.shape
        if len(shape) <= 1:
            return flat if shape else flat[0]
        cols = shape[-1]
        return [flat[r * cols:(r + 1) * cols] for r in range(shape[0])]

    def __repr__(self):
        return f"rlhost.Tensor(shape={self.shape}, dtype={self.dtype})"

    def __dlpack_device__(self):
        return (CPU, 0)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """The DLPack capsule: "dltensor_versioned" when max_version >= (1, 0) is given, else
        the legacy "dltensor". Shares this tensor's memory."""
        if stream is not None and stream != -1:
            raise BufferError("rlhost tensors are in CPU memory: stream must be None")
        if dl_device is not None and tuple(dl_device) != (CPU, 0):
            raise BufferError(f"rlhost tensors are in CPU memory, not on device {tuple(dl_device)}")
        if copy:
            raise BufferError("rlhost tensors are exported without copying (copy=True is not supported)")
        self._t()
        shared = ctypes.c_void_p()
        _check(self._lib.rlhost_tensor_share(ctypes.cast(self._m, ctypes.c_void_p), ctypes.byref(shared)))
        if max_version is not None and tuple(max_version)[0] >= 1:
            return _capsule_new(shared, _V_NAME, _capsule_destructor)
        legacy = ctypes.c_void_p()
        st = self._lib.rlhost_tensor_to_legacy(shared, ctypes.byref(legacy))
        if st:
            m = ctypes.cast(shared, ctypes.POINTER(_Managed))
            m.contents.deleter(m)
            _check(st)
        return _capsule_new(legacy, _L_NAME, _capsule_destructor)


# ---- in ------------------------------------------------------------------------------------------


class _Input:
    """A borrowed DLTensor for one librlhost call; release() gives back what was consumed."""

    def __init__(self, pointer, keep=None, deleter=None):
        self.pointer = pointer  # ctypes.POINTER(_DLTensor)
        self._keep = keep
        self._deleter = deleter

    def release(self):
        d, self._deleter = self._deleter, None
        if d is not None:
            d()


def _from_capsule(capsule, what):
    if _is_capsule(capsule, _V_NAME):
        m = ctypes.cast(_capsule_get(capsule, _V_NAME), ctypes.POINTER(_Managed))
        if m.contents.version.major != 1:
            _fail(f"{what}: DLPack major version {m.contents.version.major} is not supported (1.x)")
        _capsule_set_name(capsule, _V_USED)
        return _Input(ctypes.pointer(m.contents.dl_tensor), capsule,
                      (lambda: m.contents.deleter(m)) if m.contents.deleter else None)
    if _is_capsule(capsule, _L_NAME):
        m = ctypes.cast(_capsule_get(capsule, _L_NAME), ctypes.POINTER(_Legacy))
        _capsule_set_name(capsule, _L_USED)
        return _Input(ctypes.pointer(m.contents.dl_tensor), capsule,
                      (lambda: m.contents.deleter(m)) if m.contents.deleter else None)
    name = _capsule_name(capsule)
    if name in (_V_USED, _L_USED):
        _fail(f"{what}: the DLPack capsule was already consumed ('{name.decode()}'); "
              "a capsule can be read once, ask the producer for a new one")
    _fail(f"{what}: a capsule named {name!r}, not a DLPack tensor ('dltensor' or 'dltensor_versioned')")


def _from_list(values, what):
    rows = values if values and isinstance(values[0], (list, tuple)) else None
    if rows is not None:
        if any(not isinstance(r, (list, tuple)) or len(r) != len(rows[0]) for r in rows):
            _fail(f"{what}: rows of a nested list must all be lists of the same length")
        flat = [x for r in rows for x in r]
        shape = (len(rows), len(rows[0]))
    else:
        flat = list(values)
        shape = (len(flat),)
    for x in flat:
        if isinstance(x, bool) or not isinstance(x, int):
            _fail(f"{what}: {x!r} is not an integer")
        if not -(1 << 63) <= x < (1 << 63):
            _fail(f"{what}: {x} does not fit in int64")
    data = (ctypes.c_int64 * max(1, len(flat)))(*flat)
    shp = (ctypes.c_int64 * len(shape))(*shape)
    strides = (ctypes.c_int64 * len(shape))(*([shape[1], 1] if len(shape) == 2 else [1]))
    t = _DLTensor(ctypes.cast(data, ctypes.c_void_p), _Device(CPU, 0), len(shape), _DType(0, 64, 1),
                  ctypes.cast(shp, ctypes.POINTER(ctypes.c_int64)), ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64)), 0)
    return _Input(ctypes.pointer(t), (data, shp, strides, t))


def as_input(x, what):
    """Borrows x as a DLTensor: an rlhost.Tensor, a DLPack capsule, an object with __dlpack__ or a
    list of ints. Call release() on the result after the librlhost call."""
    if x is None:
        return None
    if isinstance(x, Tensor):
        x._t()
        return _Input(ctypes.pointer(x._m.contents.dl_tensor), x)
    if type(x).__name__ == "PyCapsule":
        return _from_capsule(x, what)
    if hasattr(x, "__dlpack__"):
        if hasattr(x, "__dlpack_device__"):
            device_type, device_id = x.__dlpack_device__()
            if int(device_type) not in (CPU, CUDA_HOST):
                _fail(f"{what}: a tensor on {_device_name(int(device_type))}:{device_id}; rlhost reads it from CPU "
                      "memory (copy it to the CPU first)")
        try:
            try:
                capsule = x.__dlpack__(max_version=(1, 3))
            except TypeError:  # a producer older than DLPack 1.0's protocol (numpy < 2.1, torch < 2.3)
                capsule = x.__dlpack__()
        except (BufferError, RuntimeError, ValueError, TypeError) as e:
            _fail(f"{what}: {type(x).__name__} cannot export it through DLPack: " + str(e).splitlines()[0])
        return _from_capsule(capsule, what)
    if isinstance(x, (list, tuple)):
        return _from_list(x, what)
    _fail(f"{what}: expected a DLPack tensor (numpy array, torch tensor, rlhost.Tensor or capsule) or a list of "
          f"ints, got {type(x).__name__}")
