"""When a wrapped Function's op is registered: at decoration when its schema is
known from annotations (Note [Registered at decoration]), else at its first call."""

import textwrap

import torch

import torch_opaque
from support.processes import run_python

MODULE = textwrap.dedent(
    """
    import torch, torch_opaque

    @torch_opaque.op(name="RegHinted")
    class Hinted(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor, k: float) -> torch.Tensor:
            ctx.save_for_backward(x)
            ctx.k = k
            return x.sin() * k

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * x.cos() * ctx.k, None

    class Net(torch.nn.Module):
        def forward(self, x):
            return Hinted.apply(x, 2.0)
    """
)


def run(code, cwd):
    proc = run_python(code, cwd=cwd, env={"PYTHONPATH": str(cwd), "PATH": "/usr/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_hinted_function_is_registered_when_decorated():
    @torch_opaque.op(name="RegAtDecoration")
    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    schema = torch.ops.opaque.RegAtDecoration.default._schema  # no call yet
    assert str(schema) == "opaque::RegAtDecoration(Tensor x) -> Tensor"


def test_unhinted_function_is_registered_by_its_first_call():
    @torch_opaque.op(name="RegAtFirstCall")
    class G(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    assert not torch._C._jit_get_schemas_for_operator("opaque::RegAtFirstCall")
    G.apply(torch.ones(2))
    assert torch._C._jit_get_schemas_for_operator("opaque::RegAtFirstCall")


def test_torch_export_load_after_importing_the_module_in_a_fresh_process(tmp_path):
    (tmp_path / "regmod.py").write_text(MODULE)
    run(
        """
        import torch, regmod
        ep = torch.export.export(regmod.Net(), (torch.randn(3),))
        torch.export.save(ep, "plain.pt2")
        """,
        tmp_path,
    )
    out = run(
        """
        import torch, regmod                      # no call of Hinted before loading
        ep = torch.export.load("plain.pt2")
        x = torch.randn(3)
        assert torch.allclose(ep.module()(x), x.sin() * 2)
        print([str(n.target) for n in ep.graph.nodes if n.op == "call_function"])
        """,
        tmp_path,
    )
    assert "opaque.RegHinted.default" in out
