"""loom.torch.OnebitAdam, ZeroOneAdam, OnebitLamb: DeepSpeed's constructors (names, order,
defaults), what each argument becomes (refused, ignored with a warning, or a plugin
parameter), and training on one rank bit for bit as loom.torch.Optimizer over the same
plugin with the equivalent parameters, and as the manifest the DeepSpeed importer writes
for the same config."""
import inspect
import os
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")

import loom  # noqa: E402
import loom.torch  # noqa: E402
from loom import _torch_onebit  # noqa: E402
from loom.deepspeed._optimizer import comm_plugin_installed  # noqa: E402

from conftest import PACKAGE_DIR, ROOT  # noqa: E402

# DeepSpeed's constructors, read from deepspeed/runtime/fp16/onebit/{adam,zoadam,lamb}.py at
# deepspeedai/DeepSpeed edaa7221 (August 2026, the last version before their removal in
# #8490): every argument after params, in order, with its default.
DEEPSPEED = {
    "OnebitAdam": [
        ("deepspeed", None), ("lr", 1e-3), ("freeze_step", 100000), ("bias_correction", True),
        ("betas", (0.9, 0.999)), ("eps", 1e-8), ("eps_inside_sqrt", False),
        ("weight_decay", 0.), ("max_grad_norm", 0.), ("amsgrad", False), ("cuda_aware", False),
        ("comm_backend_name", "nccl")],
    "ZeroOneAdam": [
        ("deepspeed", None), ("lr", 1e-3), ("bias_correction", True), ("betas", (0.9, 0.999)),
        ("eps", 1e-8), ("eps_inside_sqrt", False), ("weight_decay", 0.),
        ("max_grad_norm", 0.), ("var_freeze_step", 100000), ("var_update_scaler", 16),
        ("local_step_scaler", 32678), ("local_step_clipper", 16), ("amsgrad", False),
        ("cuda_aware", False), ("comm_backend_name", "nccl")],
    "OnebitLamb": [
        ("deepspeed", None), ("lr", 1e-3), ("freeze_step", 100000), ("bias_correction", True),
        ("betas", (0.9, 0.999)), ("eps", 1e-8), ("eps_inside_sqrt", False),
        ("weight_decay", 0.), ("max_grad_norm", 0.), ("max_coeff", 10.0), ("min_coeff", 0.01),
        ("amsgrad", False), ("cuda_aware", False), ("comm_backend_name", "nccl"),
        ("coeff_beta", 0.9), ("factor_max", 4.0), ("factor_min", 0.5),
        ("factor_threshold", 0.1)],
}
PLUGIN = {"OnebitAdam": "onebit_adam", "ZeroOneAdam": "zero_one_adam",
          "OnebitLamb": "onebit_lamb"}
DS_TYPE = {"OnebitAdam": "OneBitAdam", "ZeroOneAdam": "ZeroOneAdam",
           "OnebitLamb": "OneBitLamb"}
NAMES = sorted(DEEPSPEED)
MPI_INSTALLED = comm_plugin_installed("mpi")


def cls(name):
    return getattr(loom.torch, name)


def param(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter(torch.randn(n, generator=g))


@pytest.fixture(autouse=True)
def no_ucx_skip():
    try:
        loom.describe_plugins("ucx")
    except loom.LoomError:
        pytest.skip("the ucx plugin is not built")


# ---------------------------------------------------------------- constructors

@pytest.mark.parametrize("name", NAMES)
def test_signature_is_deepspeeds(name):
    sig = inspect.signature(cls(name).__init__)
    ps = list(sig.parameters.values())[1:]  # after self
    positional = [p for p in ps if p.kind is p.POSITIONAL_OR_KEYWORD]
    P = inspect.Parameter
    assert positional[0].name == "params" and positional[0].default is P.empty
    assert [(p.name, p.default) for p in positional[1:]] == DEEPSPEED[name]
    # Loom's own arguments come after DeepSpeed's, keyword-only: no call of DeepSpeed's
    # form can reach them
    assert [(p.name, p.kind) for p in ps if p not in positional] == [
        ("plugin_path", P.KEYWORD_ONLY), ("log_level", P.KEYWORD_ONLY),
        ("bootstrap", P.KEYWORD_ONLY)] + (
            [("shard_state", P.KEYWORD_ONLY)] if name != "ZeroOneAdam" else []) + [
            ("bucket_mb", P.KEYWORD_ONLY), ("overlap_backward", P.KEYWORD_ONLY)]
    assert cls(name).__module__ == "loom.torch" and name in loom.torch.__all__
    assert issubclass(cls(name), loom.torch.Optimizer)
    assert issubclass(cls(name), torch.optim.Optimizer)


def test_every_deepspeed_argument_says_what_it_becomes():
    args = {a for spec in DEEPSPEED.values() for a, _ in spec} | {"params"}
    assert set(_torch_onebit.ARGUMENTS) == args
    with open(os.path.join(ROOT, "docs", "python.md"), encoding="utf-8") as f:
        doc = f.read()
    section = doc[doc.index("## Migrating from DeepSpeed's 1-bit optimizers"):]
    section = section[:section.index("\n## ", 1)]
    for a in args:
        assert f"`{a}`" in section, a


@pytest.mark.parametrize("name", NAMES)
def test_every_argument_by_name_and_by_position(name):
    spec = DEEPSPEED[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # DeepSpeed's defaults warn of nothing
        by_name = cls(name)([param()], **dict(spec), log_level="error")
        by_position = cls(name)([param()], *[v for _, v in spec], log_level="error")
        plain = cls(name)([param()], log_level="error")
    for opt in (by_name, by_position, plain):
        assert opt.instance.plugin == PLUGIN[name]
        assert opt.comm_backend_name == "nccl" and opt.comm_plugin == "ucx"  # host tensors
        assert opt.param_groups[0]["lr"] == 1e-3 and opt.param_groups[0]["weight_decay"] == 0
        opt.close()


@pytest.mark.parametrize("name", NAMES)
def test_the_plugin_gets_deepspeeds_values(name):
    """The session's manifest: the plugin's parameters as DeepSpeed's arguments give them,
    bias_correction false (DeepSpeed never corrected), the transport and the codec."""
    captured = {}
    real = loom.Session.from_string

    def spy(text, *a, **k):
        captured["text"] = text
        return real(text, *a, **k)

    args = {"OnebitAdam": {"freeze_step": 7},
            "ZeroOneAdam": {"var_freeze_step": 7, "var_update_scaler": 3,
                            "local_step_scaler": 5, "local_step_clipper": 4},
            "OnebitLamb": {"freeze_step": 7, "max_coeff": 0.3, "min_coeff": 0.02,
                           "coeff_beta": 0.8, "factor_max": 2.0, "factor_min": 0.4,
                           "factor_threshold": 0.2}}[name]
    loom.Session.from_string = staticmethod(spy)
    try:
        opt = cls(name)([param()], betas=(0.8, 0.99), eps=1e-6, bias_correction=True,
                        log_level="error", **args)
    finally:
        loom.Session.from_string = real
    text = captured["text"]
    assert '[comm.world]\nplugin = "ucx"' in text and '[codec.onebit]\nplugin = "onebit"' in text
    assert f'plugin = "{PLUGIN[name]}"' in text and 'comm = "world"' in text
    assert "betas = [0.8, 0.99]" in text and "eps = 1e-06" in text
    assert "bias_correction = false" in text
    for k, v in args.items():
        assert f"{k} = {v}" in text, k
    assert ("shard_state = false" in text) == (name != "ZeroOneAdam")
    opt.close()


@pytest.mark.parametrize("name", ["OnebitAdam", "OnebitLamb"])
def test_takes_shard_state(name):
    """Loom's keyword: ZeRO-1 for the 1-bit Adam and 1-bit LAMB state, in the plugin's
    manifest; a non-bool is refused by name."""
    captured = {}
    real = loom.Session.from_string

    def spy(text, *a, **k):
        captured["text"] = text
        return real(text, *a, **k)

    loom.Session.from_string = staticmethod(spy)
    try:
        opt = cls(name)([param()], log_level="error", shard_state=True)
    finally:
        loom.Session.from_string = real
    assert "shard_state = true" in captured["text"]
    opt.close()
    with pytest.raises(loom.InvalidArgumentError, match="shard_state"):
        cls(name)([param()], log_level="error", shard_state="yes")


@pytest.mark.parametrize("name", NAMES)
def test_takes_bucket_mb_and_hooks_the_backward(name):
    """bucket_mb goes to the manifest and turns the gradient hooks on (overlap_backward);
    on one rank the step then announces every gradient during the backward and gives the
    bits of the same buckets stepped without the hooks."""
    def run(overlap):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 4))
        phase = {"ZeroOneAdam": {"var_freeze_step": 3}}.get(name, {"freeze_step": 3})
        opt = cls(name)(model.parameters(), lr=1e-2, log_level="error", bucket_mb=0.0002,
                        overlap_backward=overlap, **phase)
        assert bool(opt._hooks) == overlap
        for t in range(6):
            x = torch.randn(5, 8, generator=torch.Generator().manual_seed(t))
            model.zero_grad()
            model(x).square().mean().backward()
            assert (opt._pending is not None) == overlap
            opt.step()
            assert opt._pending is None
        out = [p.detach().clone() for p in model.parameters()]
        opt.close()
        return out
    hooked, plain = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(hooked, plain))
    with pytest.raises(loom.InvalidArgumentError, match="bucket_mb"):
        cls(name)([param()], log_level="error", bucket_mb=-1)
    # Past the plugin's range: the plugin's own refusal, so the value reached its manifest.
    with pytest.raises(loom.InvalidArgumentError, match="bucket_mb"):
        cls(name)([param()], log_level="error", bucket_mb=2e6)


# ---------------------------------------------------------------- refusals and warnings

@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kwargs,words", [
    ({"amsgrad": True}, "amsgrad=True: the 1-bit optimizers have no AMSGrad variant"),
    ({"max_grad_norm": 1.0}, "max_grad_norm=1.0: the optimizer does not clip"),
    ({"max_grad_norm": "1"}, "max_grad_norm must be a finite number"),
    ({"comm_backend_name": "hccl"}, "comm_backend_name='hccl' is DeepSpeed's backend for "
                                    "Ascend NPUs"),
    ({"comm_backend_name": "gloo"}, "comm_backend_name='gloo' is not one of DeepSpeed's"),
    ({"betas": (0.9,)}, "betas must be a pair of numbers"),
    ({"eps": float("nan")}, "eps must be a finite number"),
    ({"weight_decay": -0.1}, "weight_decay must be >= 0"),
    ({"bias_correction": 1}, "bias_correction must be True or False"),
])
def test_refusals_name_the_argument(name, kwargs, words):
    with pytest.raises(ValueError) as e:
        cls(name)([param()], **kwargs)
    assert isinstance(e.value, loom.InvalidArgumentError)
    assert str(e.value).startswith(f"loom.torch.{name}: ") and words in str(e.value)


@pytest.mark.parametrize("name", NAMES)
def test_a_plugin_parameter_out_of_range_is_the_plugins_error(name):
    key = "var_freeze_step" if name == "ZeroOneAdam" else "freeze_step"
    with pytest.raises(loom.InvalidArgumentError, match=key):
        cls(name)([param()], **{key: -1})


@pytest.mark.parametrize("name", ["ZeroOneAdam", "OnebitLamb"])
def test_non_freeze_is_onebit_adams_only(name):
    with pytest.raises(loom.InvalidArgumentError, match="group 1 sets non_freeze, which only "
                                                        "OnebitAdam has"):
        cls(name)([{"params": [param()]}, {"params": [param()], "non_freeze": True}])
    opt = loom.torch.OnebitAdam([{"params": [param()]}, {"params": [param()],
                                                        "non_freeze": True}], log_level="error")
    assert opt.param_groups[1]["non_freeze"] is True
    opt.close()


@pytest.mark.skipif(MPI_INSTALLED, reason="Loom's mpi plugin is installed here")
@pytest.mark.parametrize("name", NAMES)
def test_mpi_without_the_mpi_plugin_is_a_clear_error(name):
    with pytest.raises(loom.NotFoundError) as e:
        cls(name)([param()], comm_backend_name="mpi")
    msg = str(e.value)
    assert msg.startswith(f"loom.torch.{name}: comm_backend_name='mpi' runs over Loom's 'mpi' "
                          "transport plugin, which is not installed: unknown plugin 'mpi'")
    assert "comm_backend_name='nccl'" in msg


def test_mpi_maps_to_the_mpi_plugin_by_name(monkeypatch):
    """With an 'mpi' transport on the search path, comm_backend_name='mpi' is it (the
    transport's own behaviour is its tests'; here its name)."""
    monkeypatch.setattr(_torch_onebit, "describe_plugins", lambda name, path=None: {
        "plugins": [{"name": name, "kinds": [{"kind": "loom.comm/1", "params": []}]}]})
    assert _torch_onebit._comm_plugin("x", "mpi", [param()], None) == "mpi"
    monkeypatch.setattr(_torch_onebit, "describe_plugins", lambda name, path=None: {
        "plugins": [{"name": name, "kinds": [{"kind": "loom.codec/1", "params": []}]}]})
    with pytest.raises(loom.NotFoundError, match="not a loom.comm/1 transport"):
        _torch_onebit._comm_plugin("x", "mpi", [param()], None)


def test_the_transport_follows_the_parameters():
    for backend in ("nccl", "compressed"):
        assert _torch_onebit._comm_plugin("x", backend, [param()], None) == "ucx"
    if torch.cuda.is_available():
        cuda = torch.zeros(3, device="cuda")
        assert _torch_onebit._comm_plugin("x", "nccl", [cuda], None) == "nccl"
        with pytest.raises(loom.InvalidArgumentError, match="on cpu and cuda"):
            _torch_onebit._comm_plugin("x", "nccl", [cuda, param()], None)


@pytest.mark.parametrize("name", NAMES)
def test_engine_only_arguments_warn_and_do_nothing(name):
    class Engine:
        enable_backward_allreduce = True

    engine = Engine()
    with pytest.warns(UserWarning) as record:
        opt = cls(name)([param()], engine, cuda_aware=True, eps_inside_sqrt=True,
                        log_level="error")
    got = [str(w.message) for w in record]
    assert any(m.startswith(f"loom.torch.{name}: the deepspeed engine argument is not used")
               for m in got)
    assert any("cuda_aware=True has no effect" in m for m in got)
    assert any("eps_inside_sqrt=True has no effect" in m for m in got)
    assert all(w.filename == __file__ for w in record)  # they point at the caller's line
    assert engine.enable_backward_allreduce is True and opt.deepspeed is engine  # untouched
    opt.close()


def test_onebit_lamb_leaves_out_empty_parameters_as_deepspeed():
    a, b = param(), torch.nn.Parameter(torch.empty(0))
    opt = loom.torch.OnebitLamb([a, b], log_level="error")
    assert opt.param_groups[0]["params"] == [a]
    opt.close()
    opt = loom.torch.OnebitLamb([{"params": [a]}, {"params": [b], "lr": 0.5}],
                                log_level="error")
    assert len(opt.param_groups) == 1
    opt.close()


# ---------------------------------------------------------------- training, bit for bit

SETTINGS = {
    # the DeepSpeed arguments of the run, and the same as the plugin's parameters
    "OnebitAdam": ({"freeze_step": 4}, {"freeze_step": 4}),
    "ZeroOneAdam": ({"var_freeze_step": 6, "var_update_scaler": 2, "local_step_scaler": 3,
                     "local_step_clipper": 4},
                    {"var_freeze_step": 6, "var_update_scaler": 2, "local_step_scaler": 3,
                     "local_step_clipper": 4}),
    "OnebitLamb": ({"freeze_step": 4, "max_coeff": 0.5, "coeff_beta": 0.5, "factor_max": 2.0},
                   {"freeze_step": 4, "max_coeff": 0.5, "coeff_beta": 0.5, "factor_max": 2.0}),
}


def model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def groups(m):
    """Two groups: weights with the default lr and decay, biases with their own."""
    return [{"params": [m[0].weight, m[2].weight]},
            {"params": [m[0].bias, m[2].bias], "lr": 5e-3, "weight_decay": 0.0}]


def train(m, opt, steps=16):
    g = torch.Generator().manual_seed(11)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    for _ in range(steps):
        x, y = torch.randn(8, 7, generator=g), torch.randn(8, 3, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        sched.step()
    return [p.detach().clone() for p in m.parameters()]


@pytest.mark.parametrize("name", NAMES)
def test_one_rank_matches_the_plain_optimizer_bit_for_bit(name):
    ds_args, plugin_params = SETTINGS[name]
    common = {"lr": 1e-2, "betas": (0.85, 0.995), "eps": 1e-7, "weight_decay": 0.01}

    m1 = model(3)
    opt1 = cls(name)(groups(m1), **common, **ds_args, log_level="error")
    got = train(m1, opt1)

    m2 = model(3)
    opt2 = loom.torch.Optimizer(groups(m2), plugin=PLUGIN[name], lr=common["lr"],
                                weight_decay=common["weight_decay"], betas=common["betas"],
                                eps=common["eps"], bias_correction=False, log_level="error",
                                **plugin_params)
    want = train(m2, opt2)

    # and the manifest the importer writes for the same DeepSpeed config
    conv = loom.from_deepspeed({"optimizer": {"type": DS_TYPE[name], "params": {
        **common, "betas": list(common["betas"]), **ds_args}}})
    m3 = model(3)
    with loom.Session.from_string(conv.manifest, "converted.toml", log_level="error") as s:
        opt3 = loom.torch.Optimizer(groups(m3), s.optimizer(), lr=common["lr"],
                                    weight_decay=common["weight_decay"])
        from_config = train(m3, opt3)
        state3 = opt3.instance.export_state()

    start = [p.detach() for p in model(3).parameters()]
    assert all(not torch.equal(a, b) for a, b in zip(got, start))  # it trained
    for a, b, c in zip(got, want, from_config):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert opt1.instance.export_state() == opt2.instance.export_state() == state3
    opt1.close()
    opt2.close()


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_resumes_bit_for_bit(name):
    ds_args, _ = SETTINGS[name]
    m1 = model(5)
    opt1 = cls(name)(groups(m1), lr=1e-2, **ds_args, log_level="error")
    train(m1, opt1, steps=5)
    sd = opt1.state_dict()
    m2 = model(5)
    m2.load_state_dict(m1.state_dict())
    opt2 = cls(name)(groups(m2), lr=1e-2, **ds_args, log_level="error")
    opt2.load_state_dict(sd)
    a, b = train(m1, opt1, steps=7), train(m2, opt2, steps=7)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    opt1.close()
    opt2.close()


# ---------------------------------------------------------------- import

def test_either_module_may_be_imported_first():
    code = ("import loom._torch_onebit as m, loom.torch as t; "
            "from loom.torch import *; "
            "assert OnebitAdam is m.OnebitAdam is t.OnebitAdam; "
            "assert ZeroOneAdam and OnebitLamb; print('ok')")
    env = dict(os.environ, PYTHONPATH=PACKAGE_DIR)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    with pytest.raises(AttributeError, match="no attribute 'OneBitAdam'"):
        loom.torch.OneBitAdam  # noqa: B018 (DeepSpeed's config spelling is not a class)
