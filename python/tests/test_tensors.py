"""DLPack tensors in and out of the rlhost package (ABI 0.4) against this build (ctest python_package).

Environment as test_rlhost.py, plus RLHOST_BIN (the rlhost executable) to compare with
`rlhost logprobs` and `rlhost generate`. numpy and torch are Debian's (python3-numpy 1.24,
python3-torch 1.13: legacy "dltensor" capsules only); the tests that need them skip without them."""
import ctypes
import gc
import json
import os
import subprocess

import pytest

import rlhost

SRC = os.environ["RLH_SOURCE_DIR"]
FIXTURES = os.environ.get("RLHOST_FIXTURES", os.path.join(SRC, "tests", "fixtures"))
LLAMA = os.path.join(FIXTURES, "llama-tiny")  # no tokenizer: ids in, ids out


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "model"
    subprocess.run([os.environ["RLH_TINY_MODEL"], str(out), "--alphabet", "0123456789+-*=", "--seed", "1"],
                   check=True, capture_output=True)
    return str(out)


@pytest.fixture
def host():
    with rlhost.Host(log_level="error") as h:
        yield h


def cli(*args):
    r = subprocess.run([os.environ["RLHOST_BIN"], *args], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout


def capsule_name(capsule):
    f = ctypes.pythonapi.PyCapsule_GetName
    f.argtypes, f.restype = [ctypes.py_object], ctypes.c_char_p
    return f(capsule).decode()


def one_line_error(excinfo, *parts):
    e = excinfo.value
    assert isinstance(e, rlhost.Error)
    assert "\n" not in e.message, e.message
    for p in parts:
        assert p in e.message, e.message
    return e


# ---- token ids ---------------------------------------------------------------------------------

def test_ids_round_trip_through_capsules_and_lists(host, tiny_model):
    tok = host.tokenizer(tiny_model)
    ids = tok.encode("12+3=15")
    assert ids.dtype == "int64" and ids.shape == (7,)
    values = ids.tolist()
    assert tok.decode(ids) == "12+3=15"
    # Both capsule kinds, read by rlhost itself; each export shares the memory and the Tensor stays.
    v = ids.__dlpack__(max_version=(1, 0))
    legacy = ids.__dlpack__()
    assert capsule_name(v) == "dltensor_versioned" and capsule_name(legacy) == "dltensor"
    assert tok.decode(v) == tok.decode(legacy) == tok.decode(values) == "12+3=15"
    assert capsule_name(v) == "used_dltensor_versioned" and capsule_name(legacy) == "used_dltensor"
    assert ids.tolist() == values
    # Capsules nobody consumes are freed by their destructor (ours), the Tensor unaffected.
    for _ in range(3):
        ids.__dlpack__()
        ids.__dlpack__(max_version=(1, 2))
    gc.collect()
    assert ids.tolist() == values
    del v, legacy, ids  # the memory outlives every owner but the last (ASan checks the C side)


def test_ids_round_trip_numpy_and_torch(host, tiny_model):
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    tok = host.tokenizer(tiny_model)
    ids = tok.encode("7*8=56")
    a = np.from_dlpack(ids)
    t = torch.utils.dlpack.from_dlpack(ids)
    assert a.dtype == np.int64 and t.dtype == torch.int64
    assert a.tolist() == t.tolist() == ids.tolist()
    # Shared, not copied: the three views are the same memory.
    assert a.ctypes.data == t.data_ptr()
    del ids
    assert a.tolist() == t.tolist()  # still alive through the consumers' ownership
    # Back into rlhost: torch's and numpy's own capsules, int64 and int32, strided.
    assert tok.decode(t) == "7*8=56"
    assert tok.decode(t.to(torch.int32)) == "7*8=56"
    assert tok.decode(np.array(a, dtype=np.int32)) == "7*8=56"
    assert tok.decode(torch.utils.dlpack.to_dlpack(t)) == "7*8=56"
    assert tok.decode(t[::2]) == tok.decode(t.tolist()[::2])
    if not a.flags.writeable:  # numpy 1.24 imports read-only and cannot export such an array again
        with pytest.raises(rlhost.Error) as e:
            tok.decode(a)
        one_line_error(e, "ids", "cannot export")


# ---- logprobs ----------------------------------------------------------------------------------

def cli_logprobs(ids, temperature=1.0):
    out = json.loads(cli("logprobs", "--model", LLAMA, "--ids", ",".join(map(str, ids)), "--json",
                         "--temperature", str(temperature)))
    return out["token_logprobs"]


def test_logprobs_equal_rlhost_logprobs(host):
    ids = [5, 17, 42, 9, 300, 2, 77, 123]
    model = host.model(LLAMA)
    for temperature in (1.0, 0.7):
        lp = model.logprobs(ids, temperature=temperature).tolist()
        assert lp[0] == 0.0
        assert lp[1:] == cli_logprobs(ids, temperature)  # bit for bit: the same computation


def test_logprobs_of_a_padded_batch_from_numpy_and_torch(host):
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    rows = [[5, 17, 42, 9, 300, 2], [7, 8, 9], [100, 200, 300, 400]]
    T = max(map(len, rows))
    padded = np.zeros((3, T), dtype=np.int64)
    for r, row in enumerate(rows):
        padded[r, :len(row)] = row
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int32)
    model = host.model(LLAMA)
    lp = model.logprobs(padded, lengths=lengths)
    assert lp.shape == (3, T) and lp.dtype == "float32"
    out = torch.utils.dlpack.from_dlpack(lp)
    for r, row in enumerate(rows):
        want = cli_logprobs(row)
        got = out[r].tolist()
        assert got[0] == 0.0 and all(x == 0.0 for x in got[len(row):])
        # Packed with other rows the engine may round the last bit differently.
        assert got[1:len(row)] == pytest.approx(want, abs=1e-5)


# ---- generate ----------------------------------------------------------------------------------

def test_generate_equals_rlhost_generate(host):
    np = pytest.importorskip("numpy")
    lines = cli("generate", "--model", LLAMA, "--prompt-ids", "5,17,42", "--prompt-ids", "7,8", "--n", "2",
                "--seed", "4", "--temperature", "0.8", "--top-k", "50", "--max-new-tokens", "6", "--json")
    want = [json.loads(line) for line in lines.splitlines() if line]
    assert len(want) == 4
    gen = host.generator(LLAMA)
    out = gen.generate(np.array([[5, 17, 42], [7, 8, 0]]), lengths=[3, 2], n=2, seed=4, temperature=0.8, top_k=50,
                       max_new_tokens=6)
    ids, lps = np.from_dlpack(out.ids), np.from_dlpack(out.logprobs)
    lengths, truncated = out.lengths.tolist(), out.truncated.tolist()
    assert ids.shape[0] == 4 and ids.shape == lps.shape and lps.dtype == np.float32
    for w in want:
        row = w["prompt_index"] * 2 + w["sample_index"]
        n = lengths[row]
        assert n == len(w["ids"])
        assert ids[row, :n].tolist() == w["ids"]
        assert lps[row, :n].tolist() == np.array(w["logprobs"], dtype=np.float32).tolist()
        assert (ids[row, n:] == 0).all() and (lps[row, n:] == 0).all()
        assert truncated[row] == w["truncated"]


def test_generate_stops_at_the_models_eos_unless_ignored(host, tmp_path):
    # llama-tiny greedy from [5, 17, 42] goes 11, 120, 144, ...: a copy whose
    # generation_config.json names 120 as EOS stops there, as `rlhost generate` does.
    for f in ("config.json", "model.safetensors"):
        os.symlink(os.path.join(LLAMA, f), tmp_path / f)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [120]}))
    free = host.generator(LLAMA).generate([5, 17, 42], temperature=0, max_new_tokens=6)
    assert free.ids.tolist()[0][3:5] == [11, 120] and free.lengths.tolist() == [9]
    gen = host.generator(str(tmp_path))
    stopped = gen.generate([5, 17, 42], temperature=0, max_new_tokens=6)
    assert stopped.ids.tolist() == [[5, 17, 42, 11, 120]] and stopped.truncated.tolist() == [False]
    want = json.loads(cli("generate", "--model", str(tmp_path), "--prompt-ids", "5,17,42", "--temperature", "0",
                          "--max-new-tokens", "6", "--json"))
    assert want["ids"] == stopped.ids.tolist()[0]
    ignored = gen.generate([5, 17, 42], temperature=0, max_new_tokens=6, ignore_eos=True)
    assert ignored.ids.tolist() == free.ids.tolist() and ignored.truncated.tolist() == [True]


# ---- bad input ---------------------------------------------------------------------------------

class FakeDevice:
    """Claims to live on a GPU (what a CUDA torch tensor says without a GPU here)."""

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, **kw):
        raise AssertionError("must not be exported")


def legacy_capsule(values, device_type=1, code=0, bits=64, ndim=1):
    """A legacy capsule made by hand (ctypes), to reach librlhost's own checks."""
    from rlhost import dlpack as d
    data = (ctypes.c_int64 * len(values))(*values)
    shape = (ctypes.c_int64 * 3)(len(values), 1, 1)
    strides = (ctypes.c_int64 * 3)(1, 1, 1)
    m = d._Legacy()
    m.dl_tensor = d._DLTensor(ctypes.cast(data, ctypes.c_void_p), d._Device(device_type, 0), ndim,
                              d._DType(code, bits, 1), shape, strides, 0)
    capsule = d._capsule_new(ctypes.addressof(m), b"dltensor", ctypes.cast(None, d._DESTRUCTOR))
    legacy_capsule.keep.append((data, shape, strides, m))  # no deleter: we own the memory
    return capsule


legacy_capsule.keep = []


def test_bad_tensors_are_one_line_errors(host, tiny_model):
    tok = host.tokenizer(tiny_model)
    model = host.model(LLAMA)
    with pytest.raises(rlhost.Error) as e:
        tok.decode(FakeDevice())
    assert one_line_error(e, "ids", "CUDA", "CPU").code == rlhost.INVALID_ARGUMENT
    with pytest.raises(rlhost.Error) as e:
        tok.decode(legacy_capsule([4, 5], device_type=2))
    one_line_error(e, "ids", "device type 2", "CUDA")
    with pytest.raises(rlhost.Error) as e:
        model.logprobs(legacy_capsule([4, 5], code=2, bits=32))
    one_line_error(e, "ids", "dtype float32", "int32 or int64")
    with pytest.raises(rlhost.Error) as e:
        model.logprobs(legacy_capsule([4, 5], ndim=3))
    one_line_error(e, "ids", "rank 3")
    with pytest.raises(rlhost.Error) as e:
        model.logprobs([[1, 2], [3]])
    one_line_error(e, "ids", "same length")
    with pytest.raises(rlhost.Error) as e:
        model.logprobs([[1, 2, 3], [4, 5, 6]], lengths=[3, 4])
    one_line_error(e, "lengths[1] = 4", "1..3")
    with pytest.raises(rlhost.Error) as e:
        model.logprobs([1, 2, 3], temperature=0)
    one_line_error(e, "temperature")
    with pytest.raises(rlhost.Error) as e:
        model.logprobs([1, -2, 3])
    one_line_error(e, "ids[1] = -2")
    with pytest.raises(rlhost.Error) as e:
        model.logprobs("1,2,3")
    one_line_error(e, "ids", "str")
    ids = tok.encode("1+1=2")
    capsule = ids.__dlpack__()
    tok.decode(capsule)
    with pytest.raises(rlhost.Error) as e:
        tok.decode(capsule)
    one_line_error(e, "already consumed", "used_dltensor")
    gen = host.generator(LLAMA)
    with pytest.raises(rlhost.Error) as e:
        gen.generate([5, 17], n=0)
    one_line_error(e, "samples_per_prompt")


def test_bad_dtype_and_shape_from_numpy_and_torch(host):
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    model = host.model(LLAMA)
    with pytest.raises(rlhost.Error) as e:
        model.logprobs(np.array([1.0, 2.0], dtype=np.float32))
    one_line_error(e, "dtype float32")
    with pytest.raises(rlhost.Error) as e:
        model.logprobs(torch.zeros((2, 2, 2), dtype=torch.int64))
    one_line_error(e, "rank 3")
    with pytest.raises(rlhost.Error) as e:
        model.logprobs(torch.tensor([1, 2]), lengths=torch.tensor([2.0]))
    one_line_error(e, "lengths", "dtype float32")


def test_closed_handles_and_hosts(tiny_model):
    h = rlhost.Host(log_level="error")
    tok = h.tokenizer(tiny_model)
    model = h.model(LLAMA)
    model.close()
    with pytest.raises(rlhost.Error) as e:
        model.logprobs([1, 2])
    one_line_error(e, "closed")
    ids = tok.encode("1")
    h.close()  # closes the tokenizer too
    with pytest.raises(rlhost.Error) as e:
        tok.encode("1")
    one_line_error(e, "closed")
    assert ids.tolist()  # tensors are independent of their host
    tok.close()  # no-op
