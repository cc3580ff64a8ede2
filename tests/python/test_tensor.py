"""Tensors through DLPack: zero-copy, never consumed, and refused (never copied) when the
dtype, layout or device is wrong."""
import sys

import pytest

import loom
from loom import _abi
from loom._lib import capsule_pointer
from loom.tensor import borrow

np = pytest.importorskip("numpy")

PROBE = '[optimizer.main]\nplugin = "probe"\ntag = "py"\nweight_decay = 0.5\n'


def f32(x):
    return float(np.float32(x))


def test_numpy_is_borrowed_in_place():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = borrow(a, "a")
    t = _abi.DLManagedTensor.from_address(b.pointer).dl_tensor
    assert t.data + t.byte_offset == a.ctypes.data  # the array's own memory
    assert (b.dtype, b.device, b.shape, b.numel) == ("float32", ("cpu", 0), (3, 4), 12)


def test_the_capsule_is_not_consumed_and_is_released():
    a = np.ones(5, dtype=np.float32)
    before = sys.getrefcount(a)
    b = borrow(a, "a")
    assert capsule_pointer(b.capsule, b"dltensor") == b.pointer  # still unconsumed
    del b
    assert sys.getrefcount(a) == before  # the exporter's deleter ran, nothing leaked


def test_step_updates_numpy_arrays_in_place(plugin_dir):
    p = np.array([1.0, 2.0, -4.0], dtype=np.float32)
    g = np.array([0.5, -0.5, 1.0], dtype=np.float32)
    address = p.ctypes.data
    with loom.Session.from_string(PROBE, plugin_path=plugin_dir) as s:
        opt = s.optimizer()
        expected = p.astype(np.float64)
        for _ in range(2):
            assert opt.step([{"params": [p], "grads": [g]}], 0.1) is False
            expected = [f32(pv - 0.1 * (gv + 0.5 * pv)) for pv, gv in zip(expected, g)]
    assert p.ctypes.data == address
    assert p.tolist() == pytest.approx(expected, rel=1e-6)


def test_size_one_dimensions_take_any_stride():
    a = np.ones(6, dtype=np.float32)[:, None]  # shape (6, 1), stride 0 on the last axis
    assert borrow(a, "a").shape == (6, 1)


@pytest.mark.parametrize("make", [
    lambda: np.ones(10, dtype=np.float32)[::2],
    lambda: np.ones((4, 5), dtype=np.float32).T,
])
def test_non_contiguous_is_refused(make):
    with pytest.raises(loom.InvalidArgumentError, match=r"w: not contiguous .*strides"):
        borrow(make(), "w")


def test_wrong_dtype_is_refused_not_converted():
    with pytest.raises(loom.InvalidArgumentError,
                       match=r"w: dtype float64 is not accepted here \(accepted: float32\)"):
        borrow(np.ones(3), "w")
    with pytest.raises(loom.InvalidArgumentError, match="dtype int32"):
        borrow(np.ones(3, dtype=np.int32), "w", dtypes=("float32", "bfloat16"))


def test_objects_without_dlpack():
    with pytest.raises(loom.InvalidArgumentError, match=r"w: a builtins.list has no __dlpack__"):
        borrow([1.0, 2.0], "w")


def test_a_consumed_capsule_is_refused():
    torch = pytest.importorskip("torch")
    from torch.utils import dlpack

    cap = torch.ones(3).__dlpack__()
    dlpack.from_dlpack(cap)  # consumes it (renamed used_dltensor)

    class Stale:
        def __dlpack__(self, stream=None):
            return cap

    with pytest.raises(loom.InvalidArgumentError, match="used_dltensor"):
        borrow(Stale(), "w")


def test_torch_tensors_are_borrowed_in_place():
    torch = pytest.importorskip("torch")
    t = torch.arange(7, dtype=torch.float32)
    b = borrow(t, "t")
    dl = _abi.DLManagedTensor.from_address(b.pointer).dl_tensor
    assert dl.data + dl.byte_offset == t.data_ptr()
    with pytest.raises(loom.InvalidArgumentError, match=r"t: not contiguous"):
        borrow(torch.ones(3, 4).t(), "t")
    with pytest.raises(loom.InvalidArgumentError, match=r"t: dtype float64"):
        borrow(torch.ones(3, dtype=torch.float64), "t")
    with pytest.raises(loom.InvalidArgumentError, match=r"t: cannot be exported through DLPack"):
        borrow(torch.ones(3, requires_grad=True), "t")  # torch refuses; use .detach()


def test_step_argument_errors_change_nothing(plugin_dir):
    p = np.ones(4, dtype=np.float32)
    with loom.Session.from_string(PROBE, plugin_path=plugin_dir) as s:
        opt = s.optimizer()
        with pytest.raises(loom.InvalidArgumentError, match=r"groups\[0\]: 1 params but 2 grads"):
            opt.step([{"params": [p], "grads": [p, p]}], 0.1)
        with pytest.raises(loom.InvalidArgumentError, match=r"groups\[0\]\.grads\[0\]: dtype float64"):
            opt.step([{"params": [p], "grads": [np.ones(4)]}], 0.1)
    with loom.Session.from_string('[optimizer.main]\nplugin = "adam"\n') as s:
        with pytest.raises(loom.InvalidArgumentError) as e:
            s.optimizer().step([{"params": [p], "grads": [np.ones(5, dtype=np.float32)]}], 0.1)
        assert "optimizer.main" in str(e.value)  # the plugin's own check, with its name
    assert p.tolist() == [1.0] * 4


def test_an_array_listed_twice_in_one_step_is_refused_unchanged():
    # The host checks it for every plugin (adam here): an array listed twice, or two views
    # sharing memory, would be updated twice in one step.
    p = np.ones(6, dtype=np.float32)
    q = np.ones(3, dtype=np.float32)
    g = np.ones(6, dtype=np.float32)
    with loom.Session.from_string('[optimizer.main]\nplugin = "adam"\n') as s:
        opt = s.optimizer()
        with pytest.raises(loom.InvalidArgumentError,
                           match=r"groups\[0\]\.tensors\[0\]\.param and groups\[1\]\.tensors\[1\]"
                                 r"\.param are the same array \(24 bytes\)"):
            opt.step([{"params": [p], "grads": [g]},
                      {"params": [q, p], "grads": [g[:3], g]}], 0.1)
        with pytest.raises(loom.InvalidArgumentError, match=r"overlap \(4 bytes in common\)"):
            opt.step([{"params": [p[:3], p[2:]], "grads": [g[:3], g[:4]]}], 0.1)
        assert p.tolist() == [1.0] * 6 and q.tolist() == [1.0] * 3
        # Disjoint slices of one buffer are two arrays.
        opt.step([{"params": [p[:3], p[3:]], "grads": [g[:3], g[3:]]}], 0.1)
        assert p.tolist() != [1.0] * 6


def test_torch_optimizer_with_a_parameter_listed_twice_is_refused():
    torch = pytest.importorskip("torch")
    import loom.torch
    w = torch.nn.Parameter(torch.ones(4))
    with pytest.warns(UserWarning, match="duplicate parameters"):  # torch only warns
        opt = loom.torch.Optimizer([w, w], plugin="adam", lr=0.1)
    w.grad = torch.ones(4)
    with pytest.raises(loom.InvalidArgumentError, match=r"tensors\[0\]\.param and "
                                                        r"groups\[0\]\.tensors\[1\]\.param are "
                                                        r"the same array"):
        opt.step()
    assert w.detach().tolist() == [1.0] * 4


@pytest.mark.skipif("torch" not in sys.modules and not __import__("importlib").util.find_spec("torch"),
                    reason="torch is not installed")
def test_cuda_tensors_when_a_gpu_is_there():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    t = torch.ones(5, device="cuda")
    b = borrow(t, "t")
    assert b.device == ("cuda", t.device.index or 0)
    with pytest.raises(loom.InvalidArgumentError, match="tensors on cuda are not accepted"):
        borrow(t, "t", devices=("cpu",))
