"""Loads and inspects each case of a crafted-archive corpus, and runs what
loaded; reports per case and step the error type and message, whether the
planted payload's marker file exists, the CPU time and the peak memory.

argv: marker file, cases (JSON file: name, path, load options), CPU seconds a
case may use before the kernel stops the process (RLIMIT_CPU, SIGXCPU), and
the address space in MiB the cases may add to what the interpreter maps once
torch and torch_opaque are imported (RLIMIT_AS; 0: no limit).

Note [Memory measured from the imported interpreter]: what importing torch
costs depends on the build: torch 2.13's CPU build maps ~0.6 GiB and holds
~220 MiB resident, the CUDA builds of 2.14 and 2.15 map ~3 GiB and hold
~510 MiB. So both bounds are taken from the interpreter as it is once
imported, not as absolute sizes: the address-space limit is set after the
imports, that much above the size mapped then, and each step reports
``<step>_peak_rise_mib``, how far its peak resident size rose above the
resident size at its start (VmHWM reset, then read; where it cannot be reset,
the process's lifetime peak, which can only read higher).

One line per case on stdout, ``CASE <json>``, preceded by ``START <name>``
(flushed), so that the test can tell which case a crash happened in and go on
with the others in a fresh interpreter.

Steps: ``load`` (torch_opaque.load), ``inspect`` (inspect_file), and ``run``
when the load succeeded: the loaded program's module() called on inputs of
the sizes its user inputs declare; ``run_mutated`` says whether the call
changed them (none of the corpus' programs modifies its inputs), and
``state_kept`` whether a second call, with grad mode on, left the caller's
grad mode, RNG state and its inputs' ``requires_grad`` as they were. A marker
found is reported and removed, so that each case is judged alone."""

import json, os, resource, sys, time

marker, cases, case_cpu = sys.argv[1], json.load(open(sys.argv[2])), float(sys.argv[3])
as_headroom = int(sys.argv[4]) << 20
import torch
import torch_opaque
from torch_opaque.cli.inspect import inspect_file
from torch_opaque.errors import TorchOpaqueError


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM, the peak resident size
        return True
    except OSError:
        return False


def status_mib(field: str) -> float:
    """A size of /proc/self/status (VmHWM, VmRSS, VmSize), in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_mib(resettable: bool) -> float:
    if resettable:
        return status_mib("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def limit_cpu() -> None:
    """The kernel stops this process once the current case used `case_cpu`
    seconds (a hang cannot stall the whole corpus)."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    spent = used.ru_utime + used.ru_stime
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = int(spent + case_cpu) + 1
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def example_inputs(ep) -> list:
    """Tensors of the sizes the program's user inputs declare (a symbolic size
    at its hint)."""
    names = set(ep.graph_signature.user_inputs)
    out = []
    for n in ep.graph.nodes:
        if n.op != "placeholder" or n.name not in names:
            continue
        v = n.meta["val"]
        shape = []
        for s in v.shape:
            if not isinstance(s, int):
                s = s.node.hint if s.node.hint is not None else 5
            shape.append(int(s))
        if v.dtype.is_floating_point:
            out.append(torch.randn(shape, dtype=v.dtype))
        else:
            out.append(torch.zeros(shape, dtype=v.dtype))
    return out


def run(ep, r: dict) -> None:
    inputs = example_inputs(ep)
    before = [t.clone() for t in inputs]
    try:
        with torch.no_grad():
            ep.module()(*inputs)
    finally:
        r["run_mutated"] = any(not torch.equal(a, b) for a, b in zip(inputs, before))
    # once more with grad mode on: the caller's grad mode, RNG and tensors' flags stay
    rng, flags = torch.get_rng_state(), [t.requires_grad for t in inputs]
    ep.module()(*inputs)
    r["state_kept"] = (torch.is_grad_enabled() and torch.equal(rng, torch.get_rng_state())
                       and flags == [t.requires_grad for t in inputs])


if as_headroom:
    limit = int(status_mib("VmSize") * (1 << 20)) + as_headroom
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
resettable = reset_peak()
for c in cases:
    print("START " + json.dumps(c["name"]), flush=True)
    limit_cpu()
    r = {}
    loaded = None
    for what in ("load", "inspect", "run"):
        if what == "run" and loaded is None:
            continue
        reset_peak()
        start_mib = status_mib("VmRSS")
        t = time.process_time()
        try:
            if what == "load":
                loaded = torch_opaque.load(c["path"], **c["options"])
            elif what == "inspect":
                inspect_file(c["path"])
            else:
                run(loaded, r)
            r[what] = ["ok", "", True]
        except Exception as e:
            r[what] = [type(e).__name__, str(e), isinstance(e, TorchOpaqueError)]
        r[what + "_cpu_s"] = time.process_time() - t
        r[what + "_marker"] = os.path.exists(marker)
        if r[what + "_marker"]:
            os.remove(marker)  # so that the next steps and cases are told apart
        r[what + "_peak_rise_mib"] = peak_mib(resettable) - start_mib
    loaded = None
    print("CASE " + json.dumps({"name": c["name"], "result": r}), flush=True)
