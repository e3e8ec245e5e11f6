"""``python -m torch_opaque inspect``: golden tables for .pt2 and .onnx files, and
graph pictures. The command runs in a fresh interpreter (sys.executable).
Crafted files (escaping, live links): test_inspect_escaping.py."""

import json
import shutil
import sys
import textwrap

import pytest
import torch

import torch_opaque
from opaque_fixtures import archops
from support.processes import run_python

HAVE_DOT = shutil.which("dot") is not None


def inspect(path, *extra, cwd):
    proc = run_python(module="torch_opaque", args=["inspect", path, *extra], cwd=cwd, timeout=300)
    return proc


def golden(text: str, path) -> str:
    return (
        textwrap.dedent(text)
        .strip("\n")
        .replace("<FILE>", str(path))
        .replace("<TORCH>", torch.__version__)
        + "\n"
    )


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("inspect")
    ep = archops.export_net()
    torch_opaque.save(ep, d / "net.pt2")
    torch.export.save(ep, d / "plain.pt2")
    small = torch.export.export(archops.Small(), (torch.randn(3),))
    torch_opaque.save(small, d / "small_sc.pt2", self_contained=True)
    make_onnx(d / "model.onnx")
    return d


def make_onnx(path):
    """A model with standard nodes, a custom-domain op with a function body (called
    twice) and one without."""
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    aux = helper.make_tensor_value_info("aux", TensorProto.FLOAT, [2, 3])
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("ScaledSin", ["r"], ["s1"], domain="torch_opaque.test", name="sin1"),
        helper.make_node("ScaledSin", ["s1"], ["s2"], domain="torch_opaque.test", name="sin2"),
        helper.make_node("Abs", ["s2"], ["a"], domain="ai.onnx", name="abs"),
        helper.make_node("Normalizer", ["a"], ["n"], domain="ai.onnx.ml", name="norm", norm="MAX"),
        helper.make_node("Mystery", ["n", "r"], ["y", "aux"], domain="com.example", name="mystery"),
    ]
    graph = helper.make_graph(nodes, "opaque_demo", [x], [y, aux])
    body = helper.make_function(
        "torch_opaque.test",
        "ScaledSin",
        ["x"],
        ["y"],
        [helper.make_node("Sin", ["x"], ["s"]), helper.make_node("Add", ["s", "s"], ["y"])],
        opset_imports=[helper.make_opsetid("", 18)],
    )
    opsets = [("", 18), ("ai.onnx.ml", 3), ("torch_opaque.test", 1), ("com.example", 1)]
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid(d, v) for d, v in opsets],
        functions=[body],
        ir_version=10,
    )
    onnx.save(model, str(path))


def test_pt2_table(files, tmp_path):
    path = files / "net.pt2"
    proc = inspect(path, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == golden(
        """
        <FILE>: torch_opaque archive (saved with torch <TORCH>), 3 opaque op(s)
        op                                  schema                                                                    calls  decomposition  defined by
        ----------------------------------  ------------------------------------------------------------------------  -----  -------------  ---------------------------------
        opaque::ArchCube.Tensor             opaque::ArchCube.Tensor(Tensor x) -> Tensor                               1      no             opaque_fixtures.archops.Cube
        opaque::ArchMulAdd.Tensor_Tensor    opaque::ArchMulAdd.Tensor_Tensor(Tensor a, Tensor b) -> (Tensor, Tensor)  1      no             opaque_fixtures.archops.MulAdd
        opaque::ArchScaledSin.Tensor_float  opaque::ArchScaledSin.Tensor_float(Tensor x, float scale) -> Tensor       1      no             opaque_fixtures.archops.ScaledSin

        all operators called (6 distinct; aten, prims and higher-order included)
        operator                                     calls  passed as argument
        -------------------------------------------  -----  ------------------
        torch.ops.aten.add.Tensor                    3      0
        torch.ops.aten.linear.default                2      0
        torch.ops.aten.slice.Tensor                  2      0
        torch.ops.opaque.ArchCube.Tensor             1      0
        torch.ops.opaque.ArchMulAdd.Tensor_Tensor    1      0
        torch.ops.opaque.ArchScaledSin.Tensor_float  1      0
        """,
        path,
    )


def test_pt2_table_self_contained(files, tmp_path):
    path = files / "small_sc.pt2"
    proc = inspect(path, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == golden(
        """
        <FILE>: torch_opaque archive, self-contained (saved with torch <TORCH>), 2 opaque op(s)
        op                                  schema                                                               calls  decomposition  defined by
        ----------------------------------  -------------------------------------------------------------------  -----  -------------  ---------------------------------
        opaque::ArchCube.Tensor             opaque::ArchCube.Tensor(Tensor x) -> Tensor                          1      yes (stored)   opaque_fixtures.archops.Cube
        opaque::ArchScaledSin.Tensor_float  opaque::ArchScaledSin.Tensor_float(Tensor x, float scale) -> Tensor  1      yes (stored)   opaque_fixtures.archops.ScaledSin

        all operators called (3 distinct; aten, prims and higher-order included)
        operator                                     calls  passed as argument
        -------------------------------------------  -----  ------------------
        torch.ops.aten.add.Tensor                    1      0
        torch.ops.opaque.ArchCube.Tensor             1      0
        torch.ops.opaque.ArchScaledSin.Tensor_float  1      0
        """,
        path,
    )


def test_plain_torch_export_table(files, tmp_path):
    path = files / "plain.pt2"
    proc = inspect(path, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == golden(
        """
        <FILE>: plain torch.export archive (no torch_opaque manifest; schemas inferred from the serialized calls), 3 custom op(s)
        op                                  schema                                                                    calls  decomposition  defined by
        ----------------------------------  ------------------------------------------------------------------------  -----  -------------  ----------
        opaque::ArchCube.Tensor             opaque::ArchCube.Tensor(Tensor x) -> Tensor                               1      no             ?
        opaque::ArchMulAdd.Tensor_Tensor    opaque::ArchMulAdd.Tensor_Tensor(Tensor a, Tensor b) -> (Tensor, Tensor)  1      no             ?
        opaque::ArchScaledSin.Tensor_float  opaque::ArchScaledSin.Tensor_float(Tensor x, float scale) -> Tensor       1      no             ?

        all operators called (6 distinct; aten, prims and higher-order included)
        operator                                     calls  passed as argument
        -------------------------------------------  -----  ------------------
        torch.ops.aten.add.Tensor                    3      0
        torch.ops.aten.linear.default                2      0
        torch.ops.aten.slice.Tensor                  2      0
        torch.ops.opaque.ArchCube.Tensor             1      0
        torch.ops.opaque.ArchMulAdd.Tensor_Tensor    1      0
        torch.ops.opaque.ArchScaledSin.Tensor_float  1      0
        """,
        path,
    )


def test_onnx_table(files, tmp_path):
    path = files / "model.onnx"
    proc = inspect(path, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == golden(
        """
        <FILE>: ONNX model (ir_version 10; opsets ai.onnx 18, ai.onnx.ml 3, com.example 1, torch_opaque.test 1), 2 custom op(s)
        op         domain             inputs  outputs  calls  function body
        ---------  -----------------  ------  -------  -----  -------------
        Mystery    com.example        2       2        1      no
        ScaledSin  torch_opaque.test  1       1        2      yes
        """,
        path,
    )


def test_inspect_imports_no_user_module(files, tmp_path):
    code = textwrap.dedent(
        f"""
        import json, sys
        from torch_opaque import cli
        for f in ({str(files / 'net.pt2')!r}, {str(files / 'plain.pt2')!r},
                  {str(files / 'small_sc.pt2')!r}):
            assert cli.main(["inspect", f, "--graph", f + ".dot"]) == 0
        print(json.dumps([m for m in sys.modules if m.startswith("opaque_fixtures")]))
        """
    )
    proc = run_python(code, cwd=tmp_path, with_fixtures=True, timeout=300)  # importable, yet not imported
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


@pytest.mark.parametrize("ext", [".svg", ".png", ".html", ".dot"])
@pytest.mark.parametrize("source", ["net.pt2", "plain.pt2", "model.onnx"])
def test_graph_picture(files, tmp_path, source, ext, capsys):
    """In this process (the command itself is exercised above)."""
    from torch_opaque import cli

    if ext != ".dot" and not HAVE_DOT:
        pytest.skip("needs Graphviz's 'dot' program (Debian package graphviz)")
    out = tmp_path / ("graph" + ext)
    assert cli.main(["inspect", str(files / source), "--graph", str(out)]) == 0
    assert capsys.readouterr().out.endswith(f"graph written to {out}\n")
    data = out.read_bytes()
    assert len(data) > 200
    label = "ScaledSin"
    if ext == ".png":
        assert data.startswith(b"\x89PNG\r\n\x1a\n")
        return
    text = data.decode()
    assert label in text
    if ext == ".dot":
        # the custom ops are highlighted
        highlighted = [l for l in text.splitlines() if "ScaledSin" in l]
        assert highlighted and all("#ffb347" in l for l in highlighted)
    elif ext == ".svg":
        assert "<svg" in text and "#ffb347" in text
    else:
        assert text.startswith("<!DOCTYPE html>") and "<svg" in text and "calls" in text


def test_errors(files, tmp_path, capsys):
    from torch_opaque import cli

    bad = tmp_path / "bad.pt2"
    bad.write_bytes((files / "net.pt2").read_bytes()[:1000])
    assert cli.main(["inspect", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("python -m torch_opaque inspect: error: ")
    assert str(bad) in err and "truncated" in err
    assert cli.main(["inspect", str(tmp_path / "missing.pt2")]) == 1
    assert "no such file" in capsys.readouterr().err
    assert cli.main(["inspect", str(files / "net.pt2"), "--graph", str(tmp_path / "x.bmp")]) == 1
    assert "unknown picture type" in capsys.readouterr().err
    bad_onnx = tmp_path / "bad.onnx"
    bad_onnx.write_bytes(b"\x08\x07garbage")
    assert cli.main(["inspect", str(bad_onnx)]) == 1
    assert "cannot read ONNX model" in capsys.readouterr().err


def test_size_limit_option(files, capsys):
    from torch_opaque import cli

    assert cli.main(["inspect", str(files / "net.pt2"), "--max-size", "1000"]) == 1
    err = capsys.readouterr().err
    assert "inflates to" in err and "more than the manifest limit of 1000 bytes" in err
    assert cli.main(["inspect", str(files / "net.pt2"), "--max-size", str(1 << 20)]) == 0
    assert "opaque::ArchCube" in capsys.readouterr().out


def test_every_tag_of_torchs_serialized_argument_has_a_type_name():
    """The inferred schemas of undescribed ops name argument types from torch's
    own serialized Argument union, so a tag torch adds cannot print as '?'
    unnoticed."""
    import dataclasses

    from torch._export.serde import schema
    from torch_opaque.cli.inspect import _arg_types

    tags = {f.name for f in dataclasses.fields(schema.Argument) if f.name.startswith("as_")}
    types = _arg_types()
    assert set(types) == tags
    assert "?" not in types.values(), types
    assert types["as_sym_ints"] == "SymInt[]" and types["as_optional_tensor"] == "Tensor?"
