"""Ahead-of-time compilation of generated kernels to PTX for a CUDA target (no GPU needed).

Triton's interpreter mode (``TRITON_INTERPRET=1``, used for CPU tests) changes how
triton itself is set up at import, so when it is on we compile in a child
process with it off. This file doubles as that child's script: it imports only
triton and reads ``{"kernels": [{"name", "text", "signature"}], "arch", "warp_size",
"num_warps", "num_stages"}`` as JSON on stdin, writing the PTX list as JSON on stdout.
"""

from __future__ import annotations

import json
import linecache
import os
import subprocess
import sys


def _compile_all(req: dict) -> list[str]:
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    out = []
    for k in req["kernels"]:
        filename = f"<mirage_serve-aot-{k['name']}-{abs(hash(k['text']))}>"
        linecache.cache[filename] = (len(k["text"]), None, k["text"].splitlines(True), filename)
        scope = {"triton": triton, "tl": tl}
        exec(compile(k["text"], filename, "exec"), scope)  # our own generated source
        sig = dict(k["signature"])
        # as the JIT specializes: device allocations are 16-byte aligned (lets loads vectorize)
        attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t.startswith("*")}
        src = ASTSource(fn=scope[k["name"]], signature=sig, constexprs={}, attrs=attrs)
        compiled = triton.compile(
            src,
            target=GPUTarget("cuda", req["arch"], req["warp_size"]),
            options={"num_warps": req["num_warps"], "num_stages": req["num_stages"], **({"launch_pdl": True} if req.get("launch_pdl") else {})},
        )
        out.append(compiled.asm["ptx"])
    return out


def compile_to_ptx(sources, arch: int = 90, warp_size: int = 32, num_warps: int = 4, num_stages: int = 2, launch_pdl: bool = False) -> list[str]:
    """PTX text of each :class:`~mirage_serve.codegen.triton_gen.KernelSource` for ``sm_<arch>``."""
    req = {
        "kernels": [{"name": s.name, "text": s.text, "signature": s.signature} for s in sources],
        "arch": arch,
        "warp_size": warp_size,
        "num_warps": num_warps,
        "num_stages": num_stages,
        "launch_pdl": launch_pdl,
    }
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return _compile_all(req)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__], input=json.dumps(req), capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"ahead-of-time Triton compilation failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)


if __name__ == "__main__":
    json.dump(_compile_all(json.load(sys.stdin)), sys.stdout)
