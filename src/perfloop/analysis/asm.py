"""Look inside a kernel at no device cost: PTX, SASS, registers, shared memory,
spills, and the occupancy they allow.

Triton kernels are compiled ahead of time for a GPU target (no GPU needed:
Triton carries ptxas and cuobjdump); CUDA C++ kernels are compiled with nvcc.
Each Triton module describes the launch it makes at the benchmark shape in
`asm_specs(dtype)`, including the 16-byte alignment the runtime would detect --
without it Triton cannot prove a load is aligned and emits 4-byte loads.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from perfloop.device import occupancy

TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


class AsmError(RuntimeError):
    """The kernel cannot be inspected here; the message says what is needed."""


def vector_widths(ptx: str) -> dict[str, int]:
    """Counts of global accesses by width in bytes, e.g. {'ld 16B': 2, 'st 16B': 2}: loads and
    stores, and the asynchronous copies into shared memory that pipelined loops use
    ('cp.async 16B'; a 4-byte one gathers an operand element by element). TMA copies move
    whole tiles: counted as 'tma'."""
    out: dict[str, int] = {}
    for m in re.finditer(r"\b(ld|st)\.global(?:\.[a-z0-9_:]+)*?(?:\.v(\d))?\.(?:b|f|u|s)(\d+)\b", ptx):
        op, vec, bits = m.group(1), int(m.group(2) or 1), int(m.group(3))
        key = f"{op} {vec * bits // 8}B"
        out[key] = out.get(key, 0) + 1
    for m in re.finditer(
        r"\bcp\.async\.c[ag]\.shared\.global\S*\s+\[[^\]]*\],\s*\[[^\]]*\],\s*(0x[0-9a-f]+|\d+)", ptx
    ):
        key = f"cp.async {int(m.group(1), 0)}B"
        out[key] = out.get(key, 0) + 1
    tma = len(re.findall(r"\bcp\.async\.bulk\.tensor\.", ptx))
    if tma:
        out["tma"] = tma
    return out


def _tool(name: str) -> str | None:
    try:
        import triton

        p = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
        if p.exists():
            return str(p)
    except ImportError:
        pass
    return shutil.which(name)


def _resources(cubin: bytes) -> dict:
    """REG/SHARED/LOCAL per function from cuobjdump -res-usage, and the SASS."""
    tool = _tool("cuobjdump")
    if tool is None:
        return {}
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "k.cubin"
        f.write_bytes(cubin)
        res = subprocess.run([tool, "-res-usage", str(f)], capture_output=True, text=True, timeout=60)
        sass = subprocess.run([tool, "-sass", str(f)], capture_output=True, text=True, timeout=60)
    info = {"sass": sass.stdout}
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res.stdout)
    if m:
        info.update(registers=int(m[1]), stack_bytes=int(m[2]), smem_bytes=int(m[3]), spill_stores=int(m[4]))
    return info


def compile_spec(spec: dict, arch: str = "sm_90"):
    """Triton's compile of one launch spec for `arch`, on any machine (no GPU needed): the
    CompiledKernel (its asm["ptx"], asm["cubin"], metadata). spec: kernel, signature,
    constexprs, "aligned" (the indices of arguments known divisible by 16, pointers by 16
    bytes), num_warps, num_stages."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    fn = spec["kernel"]
    while not hasattr(fn, "arg_names"):  # an autotuned kernel wraps the jit function
        fn = fn.fn
    attrs = {(i,): [["tt.divisibility", 16]] for i in spec.get("aligned", [])}
    src = ASTSource(fn=fn, signature=spec["signature"], constexprs=spec["constexprs"], attrs=attrs)
    return triton.compile(
        src,
        target=GPUTarget("cuda", int(arch.removeprefix("sm_").rstrip("a")), 32),
        options={"num_warps": spec.get("num_warps", 4), "num_stages": spec.get("num_stages", 3)},
    )


def _triton_report(op, variant, dtype, arch: str) -> dict:
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        raise AsmError(f"{op.name}/{variant}: needs Triton to compile its kernels ({exc})") from exc
    impl = op.variant(variant).loader.partition(":")[0]
    try:  # the op's folder declares the launches to compile, beside its kernels
        module = importlib.import_module(impl.rpartition(".")[0] + ".asm_specs")
    except ModuleNotFoundError:
        raise AsmError(
            f"{op.name}: its folder declares no asm_specs.py (asm_specs(dtype)) to compile"
        ) from None
    kernels, ptx_all, sass_all, notes = [], [], [], []
    for spec in module.asm_specs(TRITON_TYPES[dtype]):
        try:
            k = compile_spec(spec, arch)
        except Exception as exc:  # compiler errors come in many types
            raise AsmError(f"{op.name}/{variant}: Triton could not compile for {arch}: {exc}") from exc
        threads = spec["num_warps"] * 32
        info = {"name": k.metadata.name, "threads": threads, "smem_bytes": k.metadata.shared}
        res = _resources(k.asm["cubin"])
        sass_all.append(res.pop("sass", ""))
        info.update(res)
        # cuobjdump counts static shared memory; Triton's is dynamic: take the larger
        info["smem_bytes"] = max(k.metadata.shared, res.get("smem_bytes", 0))
        ptx = k.asm["ptx"]
        ptx_all.append(ptx)
        info["memory_ops"] = vector_widths(ptx)
        if "registers" in info:
            info["occupancy"], info["limited_by"] = occupancy(info["registers"], threads, info["smem_bytes"])
        if spec.get("elements_per_thread"):
            info["elements_per_thread"] = spec["elements_per_thread"]
        kernels.append(info)
        notes += _notes(info, spec)
    return {
        "kernels": kernels,
        "ptx": "\n".join(ptx_all),
        "sass": "\n".join(sass_all),
        "notes": notes,
    }


def _notes(info: dict, spec: dict) -> list[str]:
    n = info["name"]
    mem = info.get("memory_ops", {})
    notes = []
    wide = sum(v for k, v in mem.items() if k.endswith(" 16B"))
    narrow = {k: v for k, v in mem.items() if not k.endswith(" 16B") and k != "tma"}
    if wide:
        notes.append(
            f"{n}: {wide} 16-byte global accesses (ld/st .v4/.v8, cp.async 16): the widest, as wanted"
        )
    if mem.get("tma"):
        notes.append(f"{n}: {mem['tma']} TMA tile copies (cp.async.bulk.tensor): no per-thread addresses")
    if narrow:
        notes.append(
            f"{n}: narrower global accesses {narrow}: each moves less per instruction; check "
            "alignment (pointers and sizes divisible by 16) and contiguity"
        )
    if spec.get("elements_per_thread"):
        notes.append(f"{n}: {spec['elements_per_thread']} elements per thread")
    if info.get("spill_stores"):
        notes.append(f"{n}: {info['spill_stores']} bytes of local memory (spills): registers ran out")
    if info.get("occupancy") is not None and info["occupancy"] < 0.25:
        notes.append(f"{n}: occupancy {info['occupancy']:.0%}, limited by {info['limited_by']}")
    return notes


def _cuda_report(op, variant, dtype, arch: str) -> dict:
    from perfloop.ops.cuda_build import nvcc_path, parse_ptxas

    nvcc = nvcc_path()
    if nvcc is None:
        raise AsmError(f"{op.name}/{variant}: needs nvcc (the CUDA toolkit) to compile kernel.cu")
    module = importlib.import_module(op.variant(variant).loader.partition(":")[0])
    cu = Path(module.KERNEL)
    gencode = f"-gencode=arch=compute_{arch[3:]},code={arch}"
    with tempfile.TemporaryDirectory() as d:
        cubin, ptx = Path(d) / "k.cubin", Path(d) / "k.ptx"
        p = subprocess.run(
            [nvcc, "-cubin", "-O3", gencode, "-Xptxas", "-v", str(cu), "-o", str(cubin)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if p.returncode != 0:
            raise AsmError(f"nvcc failed:\n{p.stderr[-3000:]}")
        subprocess.run(
            [nvcc, "-ptx", "-O3", f"-arch=compute_{arch[3:]}", str(cu), "-o", str(ptx)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        ptx_text = ptx.read_text() if ptx.exists() else ""
        sass = _resources(cubin.read_bytes()).get("sass", "")
    threads = getattr(module, "THREADS_PER_BLOCK", 256)
    kernels, notes = [], []
    parsed = parse_ptxas(p.stderr)
    names = _demangle(list(parsed))
    ctype = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}[dtype]
    for name, info in parsed.items():
        pretty = names.get(name, name)
        if "registers" not in info or (name != pretty and f"<{ctype}" not in pretty):
            continue  # another dtype's instantiation
        short = pretty.replace("(anonymous namespace)::", "").removeprefix("void ").split("(")[0]
        k = {"name": short, "threads": threads, **info}
        k["occupancy"], k["limited_by"] = occupancy(k["registers"], threads, k.get("smem_bytes", 0))
        kernels.append(k)
        notes += _notes(k, {})
    widths = vector_widths(ptx_text)
    notes.append(f"global memory instructions in the PTX, by width: {widths}")
    return {"kernels": kernels, "ptx": ptx_text, "sass": sass, "notes": notes}


def _demangle(names: list[str]) -> dict[str, str]:
    tool = shutil.which("cu++filt") or shutil.which("c++filt")
    if tool is None or not names:
        return {}
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True, timeout=30)
    return dict(zip(names, out.stdout.splitlines(), strict=False))


def inspect_variant(op, variant: str, dtype=torch.float32, arch: str = "sm_90") -> dict:
    """Compile a variant's kernels for `arch` and report what the lecture teaches to check."""
    if not re.fullmatch(r"sm_\d{2,3}a?", arch):
        raise AsmError(f"--arch: {arch!r} is not a GPU target like sm_90 or sm_80")
    v = op.variant(variant)
    if "triton" in v.needs:
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            return _in_fresh_process(op.name, variant, dtype, arch)
        return _triton_report(op, variant, dtype, arch)
    if "nvcc" in v.needs:
        return _cuda_report(op, variant, dtype, arch)
    raise AsmError(
        f"{op.name}/{variant} is PyTorch code: its kernels come from ATen, cuBLAS or Inductor, "
        f"so there is no source of ours to compile; use `perfloop profile {op.name} --variant "
        f"{variant}` to see which kernels it launches"
    )


def _in_fresh_process(op: str, variant: str, dtype, arch: str) -> dict:
    # Triton's own library functions (tl.max, tl.cdiv...) were made interpreted when
    # Triton loaded under TRITON_INTERPRET=1; only a fresh process can compile them.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    name = TRITON_TYPES[dtype]
    proc = subprocess.run(
        [sys.executable, "-m", "perfloop.analysis.asm", op, variant, name, arch],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if proc.returncode != 0:
        raise AsmError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "asm failed")
    return json.loads(proc.stdout)


if __name__ == "__main__":
    from perfloop import ops
    from perfloop.ops.base import parse_dtype

    o, v, d, a = sys.argv[1:5]
    try:
        print(json.dumps(inspect_variant(ops.get(o), v, parse_dtype(d), a)))
    except AsmError as exc:
        sys.exit(str(exc))
