"""The wheel as a user gets it, checked from a clean copy of the sources.

1. Copies the files git tracks (and new files it does not ignore) from the
   working tree into WORK/src: no build outputs, no .venv.
2. `pip wheel --no-build-isolation` there, with the running interpreter (which
   must have torch and scikit-build-core: scripts/dev.sh's .venv does).
3. Checks the wheel: platform tag, `torch==X.Y.*` of the build torch among its
   requirements, the compiled files, headers and CMake package inside
   torch_opaque/, RUNPATHs relative to $ORIGIN only.
4. Makes a new venv holding only torch (the build's torch release, so pip
   installs the same file) and installs the wheel into it offline.
5. Runs examples/seed_demo.py there (torch.export, training through
   ep.module()), from outside the sources.
6. Configures and builds examples/cpp against the installed package with only
   `torch_opaque.cmake_prefix_path` as CMAKE_PREFIX_PATH, and runs its program
   without LD_LIBRARY_PATH.

    python tests/packaging/wheel_roundtrip.py --work build/wheel_roundtrip

CTest runs it (wheel_from_clean_copy, label `slow`): it compiles everything once
more, several minutes on two cores.
"""

from __future__ import annotations

import argparse
import email.parser
import importlib.metadata
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[2]


def step(msg: str) -> None:
    print(f"\n== {msg}", flush=True)


def run(cmd, **kw) -> subprocess.CompletedProcess:
    print("$", " ".join(str(c) for c in cmd), flush=True)
    proc = subprocess.run([str(c) for c in cmd], text=True, capture_output=True, **kw)
    if proc.returncode != 0:
        sys.exit(
            f"FAILED ({proc.returncode}): {' '.join(str(c) for c in cmd)}\n"
            f"--- stdout\n{proc.stdout[-8000:]}\n--- stderr\n{proc.stderr[-8000:]}"
        )
    return proc


def check(cond: bool, msg: str) -> None:
    if not cond:
        sys.exit(f"FAILED: {msg}")
    print(f"ok: {msg}", flush=True)


def clean_copy(dest: pathlib.Path) -> None:
    listed = run(["git", "-C", ROOT, "ls-files", "-z", "--cached", "--others", "--exclude-standard"])
    n = 0
    for rel in filter(None, listed.stdout.split("\0")):
        src = ROOT / rel
        if src.is_file():  # a tracked file deleted from the working tree is skipped
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
            n += 1
    print(f"copied {n} files", flush=True)


def readelf_runpaths(path: pathlib.Path) -> list[str]:
    out = run(["readelf", "-d", path]).stdout
    return [p for m in re.finditer(r"\((?:RUNPATH|RPATH)\).*\[(.*)\]", out) for p in m.group(1).split(":")]


def check_wheel(whl: pathlib.Path, torch_version: str, unpacked: pathlib.Path) -> None:
    tag = whl.name[:-4].split("-")[-3:]
    check(tag[2] != "any" and tag[1] != "none", f"platform-tagged wheel ({'-'.join(tag)})")
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        z.extractall(unpacked)
    meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
    meta = email.parser.Parser().parse(open(unpacked / meta_name, encoding="utf-8"))
    requires = meta.get_all("Requires-Dist") or []
    major_minor = ".".join(torch_version.split("+")[0].split(".")[:2])
    check(f"torch=={major_minor}.*" in [r.replace(" ", "") for r in requires],
          f"Requires-Dist pins torch=={major_minor}.* (built against {torch_version}): {requires}")
    check(any(r.startswith("onnx-ir") for r in requires), "onnx-ir declared (extra onnx)")
    check(meta["Version"] == version_in_sources(), f"version {meta['Version']} from torch_opaque/__init__.py")

    expected = [
        "torch_opaque/lib/libtorch_opaque.so",
        "torch_opaque/include/torch_opaque/op.h",
        "torch_opaque/lib/cmake/torch_opaque/torch_opaqueConfig.cmake",
        "torch_opaque/lib/cmake/torch_opaque/torch_opaqueConfigVersion.cmake",
        "torch_opaque/lib/cmake/torch_opaque/torch_opaqueFindTorch.cmake",
        "torch_opaque/lib/cmake/torch_opaque/torch_opaqueTargets.cmake",
        "torch_opaque/__init__.py",
    ]
    for name in expected:
        check(name in names, f"wheel has {name}")
    ext = [n for n in names if re.fullmatch(r"torch_opaque/_C\.[^/]*\.so", n)]
    check(len(ext) == 1, f"wheel has torch_opaque/_C (found {ext})")
    stray = [n for n in names if n.endswith(".so") and n not in ext + ["torch_opaque/lib/libtorch_opaque.so"]]
    check(not stray, f"no other shared libraries in the wheel ({stray})")
    check(not any(n.startswith(("tests/", "build/", "csrc/")) for n in names), "no sources or build files")

    for name in ext + ["torch_opaque/lib/libtorch_opaque.so"]:
        paths = readelf_runpaths(unpacked / name)
        check(bool(paths) and all(p.startswith("$ORIGIN") for p in paths),
              f"{name} RUNPATH is $ORIGIN-relative: {paths}")


def version_in_sources() -> str:
    text = (ROOT / "torch_opaque" / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, type=pathlib.Path, help="scratch folder (emptied first)")
    args = ap.parse_args()
    work = args.work.resolve()
    if work.exists():
        shutil.rmtree(work)
    src, dist, venv, unpacked, consumer = (work / d for d in ("src", "dist", "venv", "unpacked", "consumer"))
    src.mkdir(parents=True)
    t0 = time.monotonic()

    try:
        torch_version = importlib.metadata.version("torch")
        importlib.metadata.version("scikit-build-core")
    except importlib.metadata.PackageNotFoundError as e:
        sys.exit(f"FAILED: {sys.executable} needs torch and scikit-build-core "
                 f"(scripts/dev.sh build installs them): {e}")

    step("clean copy of the sources")
    clean_copy(src)

    step(f"pip wheel --no-build-isolation (torch {torch_version})")
    t = time.monotonic()
    env = dict(os.environ)
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
    run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
         "--disable-pip-version-check", "-w", dist, src], env=env)
    print(f"wheel built in {time.monotonic() - t:.0f} s", flush=True)
    wheels = sorted(dist.glob("torch_opaque-*.whl"))
    check(len(wheels) == 1, f"one wheel ({[w.name for w in wheels]})")
    whl = wheels[0]
    print(f"{whl.name}: {whl.stat().st_size / 1e6:.1f} MB", flush=True)
    check_wheel(whl, torch_version, unpacked)

    step("new venv with only torch, then the wheel (offline)")
    run([sys.executable, "-m", "venv", venv])
    py = venv / "bin" / "python"
    t = time.monotonic()
    run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", f"torch=={torch_version}"])
    print(f"torch installed in {time.monotonic() - t:.0f} s", flush=True)
    run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index", whl])
    freeze = run([py, "-m", "pip", "list", "--format=freeze"]).stdout
    check("torch-opaque==" in freeze.replace("_", "-").lower(), "torch-opaque installed next to torch")

    step("the seed example, outside the sources")
    clean_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_LIBRARY_PATH")}
    where = run([py, "-c", "import torch_opaque, sys; print(torch_opaque.__file__); "
                 "print(torch_opaque.cmake_prefix_path)"], cwd=work, env=clean_env).stdout.split()
    check(where[0].startswith(str(venv)), f"torch_opaque imported from the venv ({where[0]})")
    prefix = where[1]
    demo = run([py, src / "examples" / "seed_demo.py"], cwd=work, env=clean_env).stdout
    exported = demo.partition("== torch.export.export")[2].partition("== training")[0]
    check("torch.ops.opaque.Foo." in exported and "aten.sin" not in exported,
          "seed demo: the torch.export graph calls torch.ops.opaque.Foo (no inlined sin)")
    check("gradients equal the eager model's: True" in demo,
          "seed demo: training through ep.module() matches eager gradients")
    print(demo[-1500:], flush=True)

    step("examples/cpp against the installed package (find_package(torch_opaque))")
    run(["cmake", "-S", src / "examples" / "cpp", "-B", consumer, "-G", "Ninja",
         f"-DCMAKE_PREFIX_PATH={prefix}"], env=clean_env)
    run(["cmake", "--build", consumer], env=env)
    out = run([consumer / "example_main"], env=clean_env).stdout
    print(out[-800:], flush=True)

    print(f"\nwheel_roundtrip: OK in {time.monotonic() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
