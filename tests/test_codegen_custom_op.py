"""The registered torch.library operator: idempotent, checked inputs, fake impl, torch.compile."""

from __future__ import annotations

import pytest
import torch
from handwritten import fused_rmsnorm_linear, split_kv_attention
from torch._subclasses.fake_tensor import FakeTensorMode

from mirage_serve.codegen import CodegenError, CodegenParams, register_custom_op
from mirage_serve.reference import execute, random_inputs


def test_register_is_idempotent_and_matches_reference():
    g = fused_rmsnorm_linear(4, 64, 48, n_blocks=6, loop=4)
    op = register_custom_op(g)
    assert register_custom_op(g) is op
    assert register_custom_op(g, CodegenParams(num_warps=8)) is not op
    ins = random_inputs(g, torch.Generator().manual_seed(0))
    (y,) = op(*ins)
    assert torch.allclose(y.double(), execute(g, ins)[0], atol=1e-4)
    (y3,) = op(ins[0][:3].clone(), *ins[1:])
    assert torch.allclose(y3, y[:3], atol=1e-6)


def test_input_checks_say_what_is_wrong():
    g = fused_rmsnorm_linear(4, 64, 48, n_blocks=6, loop=4)
    op = register_custom_op(g)
    x, gn, w = random_inputs(g, torch.Generator().manual_seed(0))
    with pytest.raises(CodegenError, match="rows"):
        op(torch.cat([x, x]), gn, w)
    with pytest.raises(CodegenError, match="dtype"):
        op(x.double(), gn, w)
    with pytest.raises(CodegenError, match="contiguous"):
        op(x, gn, w.t().contiguous().t())
    with pytest.raises(CodegenError, match="takes 3"):
        op(x, gn)


def test_fake_impl_gives_shapes_for_actual_batch():
    g = split_kv_attention(2, 8, 2, 16, 32, splits=2, loop=2)
    op = register_custom_op(g)
    with FakeTensorMode():
        q, k, v = torch.empty(2, 4, 16), torch.empty(2, 32, 16), torch.empty(2, 32, 16)
        (o,) = op(q, k, v)
        assert o.shape == (2, 4, 16) and o.dtype == torch.float32


def test_opcheck_and_torch_compile():
    g = fused_rmsnorm_linear(4, 32, 16, n_blocks=2, loop=2)
    op = register_custom_op(g)
    ins = random_inputs(g, torch.Generator().manual_seed(1))
    torch.library.opcheck(op.op, tuple(ins), test_utils=("test_schema", "test_faketensor"))
    compiled = torch.compile(lambda *t: op(*t)[0] * 2.0, backend="aot_eager", fullgraph=True)
    assert torch.allclose(compiled(*ins), op(*ins)[0] * 2.0)
