"""AOTInductor deployment of a model that calls torch_opaque C++ ops (examples/aoti).

The whole pipeline runs in a temporary directory: package_model.py exports the
model and packages it with torch._inductor.aoti_compile_and_package (in a
subprocess), while examples/aoti is configured with CMake (-G Ninja, against
the installed torch_opaque package, torch_opaque.cmake_prefix_path, and
libtorch) and built;
then the C++ runner loads the .pt2 with AOTIModelPackageLoader, without
Python, and compares with the eager outputs. Packaging and building run side
by side; together they take one to two minutes on a slow machine.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch.utils

import torch_opaque
from support.build_tree import EXAMPLE_OPS_LIB, missing
from support.processes import run_python

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "aoti"
LIB = EXAMPLE_OPS_LIB
INSTALL = pathlib.Path(torch_opaque.cmake_prefix_path)
TIMEOUT_S = 1800  # per step: generous, the machine may be slow and busy


def _check(proc: subprocess.CompletedProcess, what: str) -> None:
    assert proc.returncode == 0, (
        f"{what} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    )


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """Packages the model and builds run_package, side by side."""
    assert LIB.exists(), missing(LIB)
    assert (INSTALL / "lib" / "cmake" / "torch_opaque").is_dir(), (
        f"{INSTALL} has no torch_opaque CMake package: install torch_opaque (scripts/dev.sh build)"
    )
    for tool in ("cmake", "ninja", "c++"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")

    work = tmp_path_factory.mktemp("aoti")
    pkg, build = work / "pkg", work / "build"
    # Files, not pipes: the packaging process must never block on a full pipe
    # while the C++ build runs.
    log = work / "package_model.log"
    with open(log, "w") as log_file:
        package = subprocess.Popen(
            [sys.executable, str(EXAMPLE / "package_model.py"), str(pkg), "--lib", str(LIB)],
            cwd=work, stdout=log_file, stderr=subprocess.STDOUT, text=True,
        )
    try:
        prefix = f"{INSTALL};{torch.utils.cmake_prefix_path}"
        configure = subprocess.run(
            ["cmake", "-S", str(EXAMPLE), "-B", str(build), "-G", "Ninja",
             f"-DCMAKE_PREFIX_PATH={prefix}", f"-DEXAMPLE_OPS_LIBRARY={LIB}"],
            capture_output=True, text=True, timeout=TIMEOUT_S,
        )
        _check(configure, "cmake configure")
        _check(subprocess.run(["cmake", "--build", str(build)], capture_output=True,
                              text=True, timeout=TIMEOUT_S), "cmake --build")
        package.wait(timeout=TIMEOUT_S)
    finally:
        if package.poll() is None:
            package.kill()
            package.wait()
    out = log.read_text()
    _check(subprocess.CompletedProcess(package.args, package.returncode, out, ""),
           "package_model.py")
    assert "python aoti_load_package: OK" in out
    return pkg, build / "run_package"


def test_package_calls_the_ops_through_the_proxy_executor(pipeline):
    pkg, _ = pipeline
    with zipfile.ZipFile(pkg / "model.pt2") as z:
        names = z.namelist()
        wrapper = [n for n in names if n.endswith(".wrapper.cpp")]
        nodes = [n for n in names if n.endswith(".wrapper.json")]
        assert len(wrapper) == 1 and len(nodes) == 1, names
        cpp = z.read(wrapper[0]).decode()
        extern_nodes = z.read(nodes[0]).decode()
    # One opaque call each (not decomposed into aten.sin / aten.max; a Tensor[]
    # argument and a Tensor[] return included), made at
    # run time by the proxy executor from the serialized extern kernel nodes.
    assert cpp.count("aoti_torch_proxy_executor_call_function(") == 4
    for op in ("scaled_sin", "top_value", "weighted_sum", "power_means"):
        assert extern_nodes.count(f'"target": "example::{op}"') == 1, op


def test_cpp_runner_matches_eager(pipeline):
    pkg, runner = pipeline
    samples = sorted(pkg.glob("inputs_*.pt"))
    assert len(samples) >= 2  # two batch sizes: the batch dimension is dynamic
    args = [str(pkg / "model.pt2")]
    for inputs in samples:
        args += [str(inputs), str(inputs.with_name(inputs.name.replace("inputs_", "expected_")))]
    # No LD_LIBRARY_PATH and no Python: the runner's RUNPATH finds libtorch
    # and the ops library.
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "PYTHONPATH")}
    proc = subprocess.run([str(runner), *args], capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=env)
    _check(proc, "run_package")
    assert "aoti package: OK" in proc.stdout
    assert "max abs diff:" in proc.stdout
    assert proc.stdout.count("output 2: Long[") == len(samples)


def test_cpp_runner_reports_a_mismatch(pipeline):
    pkg, runner = pipeline
    # Batch 4 inputs against batch 7 outputs: a shape mismatch, exit status 1.
    proc = subprocess.run(
        [str(runner), str(pkg / "model.pt2"), str(pkg / "inputs_0.pt"),
         str(pkg / "expected_1.pt")],
        capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "aoti package: MISMATCH" in proc.stdout


def test_loading_needs_the_ops_registered(pipeline):
    """The proxy executor resolves the ops when the package is loaded: a process
    that has not loaded the ops library cannot load it."""
    pkg, _ = pipeline
    code = textwrap.dedent(f"""
        import torch
        try:
            torch._inductor.aoti_load_package({str(pkg / "model.pt2")!r})
        except RuntimeError as e:
            print("ERROR:", e)
        else:
            print("LOADED")
    """)
    proc = run_python(code, timeout=TIMEOUT_S)
    _check(proc, "aoti_load_package without the ops library")
    assert "ERROR: Could not find schema for example::" in proc.stdout, proc.stdout
