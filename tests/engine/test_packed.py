"""Float32 Linears over MKL's packed weights (engine/packed.py): what a model loaded on CPU runs,
the same products as ``F.linear`` from 16 rows up, and a row's output independent of the rows
beside it at every row count."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from specbatch.engine import packed
from specbatch.engine.loading import load_model
from specbatch.engine.packed import PackedLinear, pack_linears
from tests.engine.test_int8_fused import qwen2

pytestmark = pytest.mark.skipif(packed.pack_check() is not None, reason=f"{packed.pack_check()}")


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
def test_packed_products_are_f_linears_from_16_rows_and_close_below(bias):
    lin = linear(bias=bias)
    ref = copy.deepcopy(lin)
    PackedLinear.of(lin)
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for rows in (1, 2, 5, 15, 16, 17, 40, 64):
            got, want = lin(x[:rows]), F.linear(x[:rows], ref.weight, ref.bias)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), rows
            if rows >= 16:
                assert torch.equal(got, want), rows


def test_a_rows_product_does_not_depend_on_the_rows_beside_it():
    lin = PackedLinear.of(linear(576, 384))
    x = torch.randn(48, 576, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        whole = lin(x)
        for rows in (1, 2, 3, 7, 16, 31):
            assert torch.equal(lin(x[:rows]), whole[:rows]), rows
        assert torch.equal(lin(x.reshape(6, 8, 576)), whole.reshape(6, 8, 384))    # (..., K) inputs
        # F.linear's own kernels move with the row count below 16 rows: what packing takes away
        ref = torch.nn.Linear(576, 384)
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


def test_where_mkls_packed_product_fails_its_check_linears_stay_plain(monkeypatch, tiny_models):
    monkeypatch.setattr(packed, "pack_check", lambda: "torch has no MKL here")
    lm = load_model(str(tiny_models / "llama-partial"))
    assert not any(isinstance(m, PackedLinear) for m in lm.model.modules())


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
