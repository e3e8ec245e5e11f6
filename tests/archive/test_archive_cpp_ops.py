"""Self-contained archives of programs calling ops defined in C++
(examples/cpp): their kernels traced to ATen, loaded in a fresh process that
has not loaded the ops library."""

import json
import zipfile

import pytest
import torch

import torch_opaque
from support.processes import last_json, run_python, run_script

pytestmark = pytest.mark.usefixtures("example_ops")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 5)

    def forward(self, x):
        y = torch.ops.example.scaled_sin(self.lin(x), 1.5)
        values, _ = torch.ops.example.top_value(y, 1)  # saves x's sizes (symbolic)
        return values.unsqueeze(1) * y


def _export(model, x):
    return torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("cpp_archives")
    torch.manual_seed(0)
    net = Net()
    torch_opaque.save(_export(net, torch.randn(6, 4)), d / "cpp_sc.pt2", self_contained=True)
    x = torch.randn(9, 4)
    xg = x.clone().requires_grad_()
    y = net(xg)
    y.sum().backward()
    ref = {"x": x, "y": y.detach(), "x_grad": xg.grad,
           "param_grads": {n: p.grad for n, p in net.named_parameters()}}
    torch.save(ref, d / "ref.pt")
    return d


def test_cpp_ops_load_run_and_train_without_their_library(saved, tmp_path):
    out = last_json(run_script("load_run_train.py", [saved / "cpp_sc.pt2", saved / "ref.pt", "{}"],
                               tmp_path, with_fixtures=False))
    assert out["ops"] == ["example::scaled_sin", "example::top_value"]
    # the child never loaded libexample_ops: both ops run their stored programs
    assert out["overloads"] and all(o.startswith("default_stored_") for o in out["overloads"])


def test_cpp_ops_manifest_holds_traced_programs_with_a_symbolic_batch(saved):
    with zipfile.ZipFile(saved / "cpp_sc.pt2") as zf:
        (name,) = [n for n in zf.namelist() if n.endswith("/extra/torch_opaque.json")]
        manifest = json.loads(zf.read(name))
    ops = {op["qualified_name"]: op for op in manifest["ops"]}
    assert ops["example::scaled_sin"]["defined_in"] == "c++"
    (ov,) = ops["example::top_value"]["overloads"]
    (variant,) = ov["variants"]
    assert variant["args"][0]["shape"] == [None, 5]
    assert variant["n_state_ints"] >= 1  # x.sym_sizes() in saved_data: the batch size
    assert variant["grads"] == [0]


def test_cpp_ops_allow_list_archive_still_needs_the_library(saved, tmp_path):
    """Without self_contained the archive names the op, and a process without
    the library is told to load it."""
    torch_opaque.save(_export(Net(), torch.randn(6, 4)), tmp_path / "plain.pt2")
    proc = run_python(f"""
        import torch_opaque
        try:
            torch_opaque.load({str(tmp_path / "plain.pt2")!r})
        except Exception as e:
            print(type(e).__name__, str(e))
    """)
    assert "example::scaled_sin" in proc.stdout and "load the library" in proc.stdout, proc.stdout + proc.stderr


class Looped(torch.nn.Module):
    def forward(self, x):
        return torch.ops.example.square_loop(torch.ops.example.scaled_sin(x, 2.0))


def test_a_kernel_that_is_not_made_of_aten_ops_is_refused_by_name(tmp_path):
    x = torch.randn(3, 4)
    ep = _export(Looped(), x)
    torch.testing.assert_close(ep.module()(x), Looped()(x))  # the op itself runs
    with pytest.raises(torch_opaque.ArchiveError) as err:
        torch_opaque.save(ep, tmp_path / "loop.pt2", self_contained=True)
    msg = str(err.value)
    assert msg.startswith("torch_opaque.save(self_contained=True): cannot trace "
                          "example::square_loop.default (defined in C++)"), msg
    assert "torch.export of the forward failed" in msg  # the loop, not the backward
    assert "data_ptr" in msg and "torch_opaque.load_library" in msg
    assert not (tmp_path / "loop.pt2").exists()
    torch_opaque.save(ep, tmp_path / "loop.pt2")  # the allow-list archive is fine


def test_a_tensor_list_cpp_op_is_refused_by_name(tmp_path):
    class M(torch.nn.Module):
        def forward(self, a, b, w):
            return torch.ops.example.weighted_sum([a, b], w)

    ep = torch.export.export(M(), (torch.randn(3), torch.randn(3), torch.tensor([0.5, 2.0])))
    with pytest.raises(torch_opaque.ArchiveError, match=r"example::weighted_sum\.default "
                       r"\(defined in C\+\+\) has a Tensor\[\] argument 'xs'"):
        torch_opaque.save(ep, tmp_path / "list.pt2", self_contained=True)


def test_cpp_ops_training_step_self_contained_without_their_library(tmp_path):
    """export_training with C++ ops, saved self-contained: a process without the
    library computes eager's loss and gradients (at two batch sizes) through
    the stored C++ backwards, and trains."""
    torch.manual_seed(0)
    net = Net()

    def loss(y):
        return y.pow(2).mean()

    step = torch_opaque.export_training(net, (torch.randn(6, 4),), loss=loss,
                                        dynamic_shapes=({0: torch.export.Dim("batch", min=2)},))
    torch_opaque.save(step, tmp_path / "step_sc.pt2", self_contained=True)
    xs, want = [torch.randn(7, 4), torch.randn(3, 4)], []
    for x in xs:
        net.zero_grad()
        value = loss(net(x))
        value.backward()
        want.append([value.detach()] + [p.grad.clone() for p in net.parameters()])
    names = torch_opaque.training_outputs(step)
    torch.save({"xs": xs, "want": want, "names": names}, tmp_path / "ref.pt")
    out = last_json(run_script("load_training_step.py", [tmp_path / "step_sc.pt2",
                                                         tmp_path / "ref.pt", "{}"],
                               tmp_path, with_fixtures=False))
    assert sorted(t.split(".")[1] for t in out["bwd_overloads"]) == ["scaled_sin_bwd",
                                                                     "top_value_bwd"]
    assert all(".default_stored_" in t for t in out["bwd_overloads"]), out
