"""Float32 Linears over packed weights (engine/packed.py): what a model loaded on CPU runs, products
close to ``F.linear``'s (MKL's bitwise from 16 rows up), and a row's output independent of the rows
beside it at every row count. Each test runs under every kernel that passes its check here."""

from __future__ import annotations

import copy
import platform

import pytest
import torch
import torch.nn.functional as F

from specbatch.engine import packed
from specbatch.engine.loading import load_model
from specbatch.engine.packed import KERNELS, PackedLinear, kernel_check, pack_linears
from tests.engine.test_int8_fused import qwen2

PASSING = [k for k in KERNELS if kernel_check(k) is None]
CHOOSE = packed.kernel.__wrapped__        # the choice itself, uncached (fixtures replace packed.kernel)
pytestmark = pytest.mark.skipif(not PASSING, reason="no packed kernel passes its check here")


@pytest.fixture(autouse=True, params=[k.name for k in PASSING])
def each_kernel(request, monkeypatch):
    """This test under one kernel: the one ``packed.kernel()`` gives for the whole process."""
    k = next(k for k in PASSING if k.name == request.param)
    monkeypatch.setattr(packed, "kernel", lambda linears="auto": k)
    return k


def linear(k: int = 96, n: int = 160, bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(k, n, bias=bias).eval()


def test_a_model_loaded_on_cpu_in_float32_has_packed_linears_and_a_plain_state_dict(tiny_models):
    lm = load_model(str(tiny_models / "llama-partial"))
    linears = [m for m in lm.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is PackedLinear for m in linears)
    plain = load_model(str(tiny_models / "llama-partial"), dtype="bfloat16")
    assert not any(isinstance(m, PackedLinear) for m in plain.model.modules())   # MKL's op is float32's
    assert lm.model.state_dict().keys() == plain.model.state_dict().keys()


@pytest.mark.parametrize("bias", [True, False])
def test_packed_products_are_close_to_f_linears_and_mkls_are_f_linears_from_16_rows(bias, each_kernel):
    lin = linear(bias=bias)
    ref = copy.deepcopy(lin)
    PackedLinear.of(lin)
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for rows in (1, 2, 5, 15, 16, 17, 40, 64):
            got, want = lin(x[:rows]), F.linear(x[:rows], ref.weight, ref.bias)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), rows
            if rows >= 16 and each_kernel.name == "mkl":
                assert torch.equal(got, want), rows


@pytest.mark.parametrize("k", [576, 1536])     # 1536: the MLP's down projection, where oneDNN's 1-row kernel differs
def test_a_rows_product_does_not_depend_on_the_rows_beside_it(k):
    lin = PackedLinear.of(linear(k, 384))
    x = torch.randn(48, k, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        whole = lin(x)
        for rows in (1, 2, 3, 7, 16, 31):
            assert torch.equal(lin(x[:rows]), whole[:rows]), rows
        assert torch.equal(lin(x[9:10]), whole[9:10])                               # a row alone
        assert torch.equal(lin(x.reshape(6, 8, k)), whole.reshape(6, 8, 384))       # (..., K) inputs
        assert torch.equal(lin(x[None, 4:5]), whole[None, 4:5])                     # (1, 1, K)
        # F.linear's own kernels move with the row count below 16 rows: what packing takes away
        ref = torch.nn.Linear(k, 384)
        ref.load_state_dict(lin.state_dict())
        moved = [rows for rows in (1, 2, 3, 7) if not torch.equal(ref(x[:rows]), ref(x)[:rows])]
    assert moved, "F.linear was batch-invariant here too: the test shows nothing"


def test_a_weight_written_or_replaced_after_packing_is_packed_again():
    lin = PackedLinear.of(linear())
    x = torch.randn(20, 96)
    with torch.inference_mode():
        lin(x)
    with torch.no_grad():
        lin.weight.mul_(2)                                    # in place: the weight's version moves
    with torch.inference_mode():
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
    lin.weight = torch.nn.Parameter(torch.randn(160, 96), requires_grad=False)
    with torch.inference_mode():
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))


def test_a_deep_copy_shares_the_packed_weight_and_decodes_the_same():
    model = qwen2()                       # biases on q/k/v
    ids = torch.randint(0, 300, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = model(input_ids=ids).logits
    params = [id(p) for p in model.parameters()]
    assert pack_linears(model) == 2 * 7 + 1
    assert [id(p) for p in model.parameters()] == params     # the same Parameters: tied ones stay tied
    twin = copy.deepcopy(model)           # (an int8 draft is quantized from such a copy)
    q, q2 = model.model.layers[0].self_attn.q_proj, twin.model.layers[0].self_attn.q_proj
    assert q2._packed is q._packed and q2.weight is not q.weight
    with torch.inference_mode():
        got, got2 = model(input_ids=ids).logits, twin(input_ids=ids).logits
    assert torch.equal(got, got2)
    assert torch.allclose(got, want, atol=1e-4)


def test_where_no_kernel_passes_its_check_linears_stay_plain(monkeypatch, tiny_models):
    monkeypatch.setattr(packed, "kernel", lambda linears="auto": None)
    lm = load_model(str(tiny_models / "llama-partial"))
    assert not any(isinstance(m, PackedLinear) for m in lm.model.modules())


def test_the_kernel_is_the_first_that_passes_unless_pinned():
    """Fixed by checks, never by timing: two workers of one job must round alike. The pin is the
    caller's (SPECBATCH_LINEARS, which config.py validates): the engine reads no environment."""
    real = CHOOSE
    assert real() is real("auto") is [k for k in packed.preferred() if k in PASSING][0]
    for k in PASSING:
        assert real(k.name) is k
    assert real("off") is None
    with pytest.raises(ValueError, match="linears='blas' is none of auto, onednn, mkl, off"):
        real("blas")


def test_the_choice_given_to_the_loader_is_the_kernel_its_linears_multiply_by(monkeypatch, tiny_models, each_kernel):
    """``Engine.load(linears=...)`` -> ``load_model`` -> ``pack_linears``: the commands pass
    SPECBATCH_LINEARS this way; a Linear that packs again (its weight changed) keeps the choice."""
    from specbatch.engine import Engine

    monkeypatch.setattr(packed, "kernel", CHOOSE)       # the real choice, by name (uncached)
    off = Engine.load(str(tiny_models / "llama-partial"), linears="off").target
    assert packed.packed_kernel(off.model) is None
    lm = Engine.load(str(tiny_models / "llama-partial"), linears=each_kernel.name).target
    assert packed.packed_kernel(lm.model) == each_kernel.name
    lin = next(m for m in lm.model.modules() if isinstance(m, PackedLinear) and m._group is None)
    with torch.no_grad():
        lin.weight.mul_(2)
    with torch.inference_mode():
        lin(torch.randn(3, lin.in_features))
    assert lin._packed.kernel is each_kernel


def test_the_kernels_are_tried_in_the_order_the_cpu_vendor_was_measured_to_favour(monkeypatch):
    """stop 50: on an Intel Xeon oneDNN's packed products ran the default job at 0.73x MKL's
    (and 0.76x F.linear's), while on an AMD EPYC oneDNN's ran it 1.5-1.6x MKL's."""
    assert [k.name for k in packed.preferred("GenuineIntel")] == ["mkl", "onednn"]
    assert [k.name for k in packed.preferred("AuthenticAMD")] == ["onednn", "mkl"]
    assert [k.name for k in packed.preferred("")] == ["onednn", "mkl"]
    assert packed.cpu_vendor() in ("GenuineIntel", "AuthenticAMD", "") or platform.machine() != "x86_64"
    for vendor in ("GenuineIntel", "AuthenticAMD"):
        monkeypatch.setattr(packed, "cpu_vendor", lambda v=vendor: v)
        assert CHOOSE() is [k for k in packed.preferred(vendor) if k in PASSING][0]


def test_a_kernel_that_rounds_a_row_by_its_neighbours_fails_its_check():
    """The check's negative control: a product whose rows depend on the row count."""
    def moving(x, p, w, b):
        y = F.linear(x, w, b)
        return y + (1e-6 * x.shape[0] if x.shape[0] < 40 else 0)

    bad = packed.Kernel("mkl", lambda w: w.clone(), moving)
    assert "rounds a row differently" in (kernel_check(bad) or "")
    def row_by_row(x, p, w, b):
        return torch.stack([F.linear(r[None], w, b)[0] for r in x])

    assert kernel_check(packed.Kernel("mkl", lambda w: w.clone(), row_by_row)) is None


def test_under_torch_compile_a_packed_linear_traces_as_f_linear():
    lin = PackedLinear.of(linear())
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, inputs: list) -> object:
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    x = torch.randn(4, 96)
    with torch.inference_mode():
        out = torch.compile(lin, backend=backend, fullgraph=True)(x)
    assert not any("mkl" in s for s in seen) and any("linear" in s for s in seen)
    assert torch.allclose(out, F.linear(x, lin.weight, lin.bias), atol=1e-5)


def test_where_autograd_records_a_packed_linear_has_f_linears_gradients():
    """MKL's op has no backward: its output would carry no gradient, silently."""
    lin = PackedLinear.of(linear())
    ref = torch.nn.Linear(96, 160)
    ref.load_state_dict(lin.state_dict())
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(3))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    lin(xa).square().sum().backward()
    ref(xb).square().sum().backward()
    assert xa.grad is not None and torch.equal(xa.grad, xb.grad)
    assert lin.weight.grad is not None and torch.equal(lin.weight.grad, ref.weight.grad)


@pytest.mark.parametrize("shape", [(1, 100), (2, 100), (2, 3, 100), (1, 90)])
def test_an_input_of_another_width_raises_as_under_f_linear(shape):
    lin = PackedLinear.of(linear())
    with torch.inference_mode(), pytest.raises(RuntimeError):
        lin(torch.randn(*shape))


def test_a_model_built_under_inference_mode_is_packed_without_error_and_multiplies_as_f_linear():
    """Its weights are inference tensors: no version counter to see an in-place write by."""
    with torch.inference_mode():
        model = qwen2()
        ids = torch.randint(0, 300, (3, 20), generator=torch.Generator().manual_seed(0))
        want = model(input_ids=ids).logits
        assert pack_linears(model) == 2 * 7 + 1
        assert torch.equal(model(input_ids=ids).logits, want)


def test_a_pickled_packed_linear_packs_again_where_it_is_loaded():
    import pickle

    lin = PackedLinear.of(linear())
    x = torch.randn(20, 96)
    again = pickle.loads(pickle.dumps(lin))       # (MKL's packed tensor has no storage to pickle)
    with torch.inference_mode():
        assert torch.equal(again(x), lin(x))
    assert again._packed is not lin._packed and again._packed.packs(again.weight)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not torch.backends.mkldnn.is_available(),
                    reason="oneDNN's kernels are checked on x86-64")
def test_onednn_passes_its_check_on_x86():
    """Else every test here would skip and Linears would silently stay unpacked."""
    assert kernel_check(KERNELS[0]) is None


def _ungrouped(model: torch.nn.Module) -> torch.nn.Module:
    """A copy whose grouped siblings multiply each by its own packed weight."""
    twin = copy.deepcopy(model)
    for m in twin.modules():
        if isinstance(m, PackedLinear):
            m._group = None
    return twin


@pytest.mark.parametrize("rows", [1, 2, 3, 17, 40])
def test_siblings_share_one_product_with_each_columns_own_bits(rows, each_kernel):
    """q/k/v and gate/up: one packed product over their concatenated weights, a view each; the
    logits are bitwise those of one product per Linear (biases on q/k/v: Qwen2)."""
    if packed.group_check(each_kernel) is not None:
        pytest.skip(packed.group_check(each_kernel))
    model = qwen2()
    pack_linears(model)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    shared = [attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj]
    assert all(m._group is not None for m in shared)
    assert attn.q_proj._group is attn.v_proj._group is not mlp.up_proj._group
    assert attn.o_proj._group is None and mlp.down_proj._group is None
    assert attn.q_proj._packed.tensor is None        # no packed copy of its own besides the group's
    alone = _ungrouped(model)
    ids = torch.randint(0, 300, (rows, 9), generator=torch.Generator().manual_seed(rows))
    calls = []
    original = each_kernel.product

    def counting(*a):
        calls.append(a[1].shape)
        return original(*a)

    with torch.inference_mode():
        want = alone(input_ids=ids).logits
        object.__setattr__(each_kernel, "product", counting)
        try:
            got = model(input_ids=ids).logits
        finally:
            object.__setattr__(each_kernel, "product", original)
    assert torch.equal(got, want)
    assert len(calls) == 2 * 4 + 1       # a layer: q/k/v, o, gate/up, down; and the head


def test_a_sibling_whose_weight_changed_leaves_the_group_and_the_others_stay():
    model = qwen2()
    pack_linears(model)
    attn = model.model.layers[0].self_attn
    if attn.q_proj._group is None:
        pytest.skip("this kernel's product over concatenated weights is not each weight's")
    x = torch.randn(5, 64)
    with torch.no_grad():
        attn.k_proj.weight.mul_(2)
    with torch.inference_mode():
        k_out, q_out = attn.k_proj(x), attn.q_proj(x)
    assert attn.k_proj._group is None and attn.q_proj._group is not None
    assert torch.allclose(k_out, F.linear(x, attn.k_proj.weight, attn.k_proj.bias), atol=1e-4)
    assert torch.allclose(q_out, F.linear(x, attn.q_proj.weight, attn.q_proj.bias), atol=1e-4)


def test_a_kernel_whose_concatenated_product_rounds_otherwise_shares_none(each_kernel):
    def off(x, p, w, b):
        y = each_kernel.product(x, p, w, b)
        return y + (y.shape[-1] > 160) * 1e-3      # a wider product rounds otherwise
    fake = packed.Kernel("fake", each_kernel.pack, off)
    assert "rounds unlike" in (packed.group_check(fake) or "")
