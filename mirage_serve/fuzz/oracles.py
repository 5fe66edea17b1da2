"""The differential checks: reference against reference, verifier against float64
ground truth, generated kernel against reference.

Tolerance of a generated kernel (:func:`kernel_tolerance`): the float64
reference is run three more times under :class:`NoisyAlgebra`, which perturbs
every operand of a sum or matmul, every operator result and every float
constant (scalars, eps: the kernel holds them in fp32) by a random relative
error of the compute precision, and every kernel tensor by one of its storage
precision (partial outputs are stored in float32, as codegen does). An element
passes if it is within 8x the largest perturbation seen, plus 2 storage units
of its value (the interpreter truncates fp32 -> bf16: up to one bf16 ulp), plus
the dtype's smallest normal number (at least 1e-30: an intermediate that
underflows, e.g. silu of -90, loses values that small). Ill-conditioned random programs (a
cancellation, a division by a small value) get wide bounds; well-conditioned
ones tight bounds.

Non-finite values: wherever the reference gives NaN the kernel must give NaN,
wherever it gives ±inf the same inf, and wherever it is finite a finite value
within the bound (``codegen-nonfinite`` findings otherwise).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mirage_serve.mugraph.graph import KernelGraph, MuGraphError
from mirage_serve.reference import TORCH_DTYPES, FloatAlgebra, apply_op, execute, run_block

STORE_UNIT = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11, "float64": 2.0**-53}
COMPUTE_UNIT = 8 * 2.0**-24  # fp32 compute, a few roundings per operator


@dataclass
class Finding:
    """A disagreement (or an explained deviation): which check, a grouping tag, details, graphs."""

    check: str
    tag: str
    detail: str
    graphs: dict[str, KernelGraph] = field(default_factory=dict)
    explained: str = ""  # non-empty: why this is not a bug
    data: dict = field(default_factory=dict)


class NoisyAlgebra(FloatAlgebra):
    """float64 with a random relative error of ``u`` on every operand of a reduction and
    every operator result (a model of rounding, not a bound)."""

    def __init__(self, u: float, gen: torch.Generator) -> None:
        super().__init__(torch.float64)
        self.u, self.gen = u, gen

    def _n(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point() or x.numel() == 0:
            return x
        return x * (1 + self.u * torch.randn(x.shape, generator=self.gen, dtype=torch.float64))

    def matmul(self, a, b, trans_b: bool = False):
        return self._n(super().matmul(self._n(a), b, trans_b))

    def binary(self, fn, a, b):
        return self._n(super().binary(fn, a, b))

    def _c(self, c: float | None) -> float | None:
        """A float constant as the kernel holds it: rounded to the compute precision."""
        return None if c is None else float(c) * (1 + self.u * float(torch.randn((), generator=self.gen, dtype=torch.float64)))

    def unary(self, fn, x, scalar=None):
        return self._n(super().unary(fn, x, self._c(scalar)))

    def sum(self, x, dim, keepdim=True):
        return self._n(super().sum(self._n(x), dim, keepdim))

    def scale_by_count(self, x, n):
        return self._n(super().scale_by_count(x, n))

    def rms_norm(self, x, w, eps):
        return self._n(super().rms_norm(self._n(x), w, self._c(eps)))


def storage_dtypes(graph: KernelGraph) -> list[str]:
    """Per kernel tensor: the dtype codegen stores it in (partial outputs float32)."""
    info = graph.info
    out = [i.dtype for i in info]
    for i, op in enumerate(graph.ops):
        if op.kind == "customized":
            start = graph.tensor_producers.index((i, 0))
            for j, bo in enumerate(op.block.outputs):
                if any(g > 1 and bo.output_map[gd] == -1 for gd, g in enumerate(op.block.grid)):
                    out[start + j] = "float32"
    return out


def run_noisy(graph: KernelGraph, inputs: Sequence[torch.Tensor], gen: torch.Generator) -> list[torch.Tensor]:
    """The graph in float64 under :class:`NoisyAlgebra`, each kernel tensor perturbed by its storage unit."""
    store = storage_dtypes(graph)

    def stored(x: torch.Tensor, t: int) -> torch.Tensor:
        return x * (1 + STORE_UNIT[store[t]] * torch.randn(x.shape, generator=gen, dtype=torch.float64))

    vals = kernel_values(graph, inputs, NoisyAlgebra(COMPUTE_UNIT, gen), stored)
    return [vals[t] for t in graph.outputs]


def kernel_values(graph: KernelGraph, inputs: Sequence[torch.Tensor], alg, stored=None) -> list[torch.Tensor]:
    """Every kernel tensor of ``graph`` in float64 under the algebra ``alg``; ``stored(x, t)``, when
    given, replaces each computed kernel tensor ``t`` (e.g. by a rounding of its storage dtype)."""
    info = graph.info
    vals: list[torch.Tensor] = []
    n_in = 0

    def keep(x: torch.Tensor, t: int) -> torch.Tensor:
        return x if stored is None else stored(x, t)

    for op in graph.ops:
        if op.kind == "input":
            vals.append(inputs[n_in].to(torch.float64))
            n_in += 1
        elif op.kind == "customized":
            first = len(vals)
            outs = run_block(op.block, [vals[t] for t in op.inputs], alg, [info[t] for t in op.inputs], list(info[first : first + op.num_outputs]))
            vals.extend(keep(o, first + j) for j, o in enumerate(outs))
        else:
            vals.append(keep(apply_op(alg, op, [vals[t] for t in op.inputs]), len(vals)))
    return vals


def kernel_tolerance(graph: KernelGraph, inputs: Sequence[torch.Tensor], exact: list[torch.Tensor], seed: int, draws: int = 3) -> list[torch.Tensor]:
    """Per output element, the deviation a correct kernel may show (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    spread = [torch.zeros_like(e) for e in exact]
    for _ in range(draws):
        for j, (n, e) in enumerate(zip(run_noisy(graph, inputs, gen), exact, strict=True)):
            d = (n - e).abs()
            spread[j] = torch.maximum(spread[j], torch.where(torch.isfinite(d), d, torch.zeros_like(d)))
    info = graph.info
    tols = []
    for j, (s, e) in enumerate(zip(spread, exact, strict=True)):
        dt = info[graph.outputs[j]].dtype
        floor = max(torch.finfo(TORCH_DTYPES[dt]).tiny, 1e-30)  # underflow of an intermediate (e.g. silu of -90) loses tiny values
        tols.append(8 * s + 2 * STORE_UNIT[dt] * e.abs().nan_to_num(0.0, 0.0, 0.0) + floor)
    return tols


def compare_outputs(got: Sequence[torch.Tensor], exact: Sequence[torch.Tensor], tols: Sequence[torch.Tensor], dtypes: Sequence[str]) -> tuple[str, str] | None:
    """(tag, detail) of the first disagreement between a kernel's outputs and the reference, or None."""
    if len(got) != len(exact):
        return "output-count", f"{len(got)} outputs, the reference {len(exact)}"
    for j, (g, e, tol) in enumerate(zip(got, exact, tols, strict=True)):
        g = g.detach().to("cpu", torch.float64)
        if tuple(g.shape) != tuple(e.shape):
            return "output-shape", f"output {j} has shape {list(g.shape)}, the reference {list(e.shape)}"
        big = torch.finfo(TORCH_DTYPES[dtypes[j]]).max
        e_nan, g_nan = torch.isnan(e), torch.isnan(g)
        e_inf, g_inf = torch.isinf(e) | (e.abs() > big), torch.isinf(g)
        if bool((e_nan & ~g_nan).any()):
            idx = _first(e_nan & ~g_nan)
            return "nan-dropped", f"output {j}: the reference is NaN at {idx} but the kernel gives {float(g[idx])}"
        if bool((~e_nan & ~e_inf & (g_nan | g_inf)).any()):
            idx = _first(~e_nan & ~e_inf & (g_nan | g_inf))
            return "spurious-nonfinite", f"output {j}: the kernel gives {float(g[idx])} at {idx} where the reference is {float(e[idx])}"
        inf_mismatch = torch.isinf(e) & (g != e)
        if bool(inf_mismatch.any()):
            idx = _first(inf_mismatch)
            return "inf-mismatch", f"output {j}: the reference is {float(e[idx])} at {idx}, the kernel {float(g[idx])}"
        fin = ~e_nan & ~e_inf
        err = torch.where(fin, (g - e).abs(), torch.zeros_like(e))
        bad = fin & (err > tol)
        if bool(bad.any()):
            idx = _first(bad)
            worst = float((err / tol.clamp_min(1e-300))[fin].max())
            rel = float(err.max() / e[fin].abs().max().clamp_min(1e-300)) if bool(fin.any()) else math.inf
            return "mismatch", (f"output {j}: {int(bad.sum())} of {e.numel()} elements outside the bound (worst {worst:.3g}x the bound; "
                                f"first at {idx}: kernel {float(g[idx]):.6g}, reference {float(e[idx]):.6g}, bound {float(tol[idx]):.3g}; "
                                f"max error / max |reference| = {rel:.3g})")
    return None


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in torch.nonzero(mask)[0])


# ----------------------------------------------------------------------------- inputs


def graph_inputs(graph: KernelGraph, seed: int, scale: float | None = None, dtype: str | None = None) -> tuple[list[torch.Tensor], float]:
    """Standard-normal inputs (scaled to keep exp and intermediates in range), rounded to their dtypes."""
    from mirage_serve.verify.float_check import choose_scale, float_inputs, graph_dtype

    if scale is None:
        scale = choose_scale(graph, seed, graph_dtype(graph) if dtype in (None, "float64") else dtype)
    return float_inputs(graph, seed, scale), scale


def inject_faults(inputs: list[torch.Tensor], seed: int, count: int = 2) -> tuple[list[torch.Tensor], list[str]]:
    """Copies of ``inputs`` with NaN, +inf or -inf written at random positions."""
    g = torch.Generator().manual_seed(seed)
    out = [x.clone() for x in inputs]
    what = []
    for _ in range(count):
        j = int(torch.randint(len(out), (1,), generator=g))
        flat = out[j].view(-1)
        k = int(torch.randint(flat.numel(), (1,), generator=g))
        v = (float("nan"), float("inf"), float("-inf"))[int(torch.randint(3, (1,), generator=g))]
        flat[k] = v
        what.append(f"input {j}[{k}] = {v}")
    return out, what


# ----------------------------------------------------------------------------- checks


def check_reference_agrees(graphs: dict[str, KernelGraph], seed: int) -> Finding | None:
    """Equivalent lowerings give the same float64 outputs (up to float64 rounding)."""
    names = list(graphs)
    base = graphs[names[0]]
    ins, _ = graph_inputs(base, seed, dtype="float64")
    ins = [x.to(torch.float64) for x in ins]
    try:
        ref = execute(base, ins)
    except (MuGraphError, RuntimeError) as e:
        return Finding("reference", "crash", f"{names[0]}: {type(e).__name__}: {e}", {names[0]: base}, data={"seed": seed})
    for name in names[1:]:
        try:
            out = execute(graphs[name], ins)
        except (MuGraphError, RuntimeError) as e:
            return Finding("reference", "crash", f"{name}: {type(e).__name__}: {e}", {name: graphs[name], names[0]: base}, data={"seed": seed})
        for j, (a, b) in enumerate(zip(out, ref, strict=True)):
            if a.shape != b.shape:
                return Finding("reference", "shape", f"{name} output {j}: {list(a.shape)} vs {list(b.shape)}", {name: graphs[name], names[0]: base}, data={"seed": seed})
            fin = torch.isfinite(b)
            if not torch.equal(torch.isnan(a), torch.isnan(b)):
                expl = ""
                if name == "rewrite" and bool((fin & ~torch.isfinite(a)).any()):
                    expl = "the rewrite overflows in float64 where the original does not (e.g. exp(a)·exp(-b) for exp(a - b))"
                return Finding("reference", "nan-pattern", f"{name} output {j}: NaN positions differ", {name: graphs[name], names[0]: base},
                               explained=expl, data={"seed": seed})
            if bool(fin.any()):
                err = float((a - b)[fin].abs().max() / b[fin].abs().max().clamp_min(1e-300))
                if err > 1e-8:
                    return Finding("reference", "mismatch", f"{name} output {j}: relative difference {err:.3g}", {name: graphs[name], names[0]: base}, data={"seed": seed})
    return None


def ground_truth(cand: KernelGraph, spec: KernelGraph, seed: int, draws: int = 3) -> tuple[str, float]:
    """"same" / "differs" / "unclear" (and the largest relative difference) from float64 runs on random inputs."""
    return ground_truth_why(cand, spec, seed, draws)[:2]


def ground_truth_why(cand: KernelGraph, spec: KernelGraph, seed: int, draws: int = 3) -> tuple[str, float, str]:
    """:func:`ground_truth` and why it differs: "signature", "values", "candidate not finite" /
    "spec not finite" (one side overflows or gives NaN where the other does not; the relative
    difference returned is then that of the elements finite in both), or ""."""
    from mirage_serve.verify.finite_field import signature_mismatch

    if signature_mismatch(cand, spec):
        return "differs", math.inf, "signature"
    worst, nonfinite = 0.0, ""
    for d in range(draws):
        ins, _ = graph_inputs(spec, seed + 7919 * d, scale=(1.0, 0.5, 0.25)[d % 3], dtype="float64")
        ins = [x.to(torch.float64) for x in ins]
        a, b = execute(cand, ins), execute(spec, ins)
        for x, y in zip(a, b, strict=True):
            fx, fy = torch.isfinite(x), torch.isfinite(y)
            if not torch.equal(fx, fy) or not torch.equal(torch.isnan(x), torch.isnan(y)):
                nonfinite = nonfinite or ("candidate not finite" if bool((fy & ~fx).any()) else "spec not finite")
            inf = torch.isinf(x) & torch.isinf(y)
            if bool((x[inf] != y[inf]).any()):
                return "differs", math.inf, "values"
            both = fx & fy
            if bool(both.any()):
                scale = float(y[both].abs().max())
                err = float((x - y)[both].abs().max())
                worst = max(worst, err / scale if scale > 0 else (math.inf if err > 0 else 0.0))
    if worst > 1e-6:
        return "differs", worst, "values"
    if nonfinite:
        return "differs", worst, nonfinite
    if worst <= 1e-11:
        return "same", worst, ""
    return "unclear", worst, ""


def codegen_reason_tag(reason: str) -> str:
    """A short grouping tag for why codegen rejects a graph."""
    r = reason.lower()
    for key, tag in (("concat", "concat"), ("same axis", "repeated-axis"), ("line up", "dims-do-not-line-up"),
                     ("no triton lowering", "no-lowering"), ("not valid", "invalid"), ("rank", "rank")):
        if key in r:
            return tag
    return r.split(":")[-1].strip()[:40]


@dataclass
class CodegenResult:
    outcome: str  # pass | rejected | finding | skipped
    tag: str = ""
    finding: Finding | None = None
    faults: list[str] = field(default_factory=list)
    rows: int | None = None  # fewer rows than the bucket, when tried


def check_codegen(graph: KernelGraph, seed: int, *, faults: int = 0, rows: int | None = None) -> CodegenResult:
    """Compile ``graph`` (Triton interpreter on CPU) and compare with the float64 reference.

    ``faults``: NaN/Inf values written into the inputs; ``rows``: run that many rows
    of a variable-batch graph (the reference runs the bucket and is sliced)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel is decorated, i.e. at compile time
    from mirage_serve.codegen import compile_graph, supports

    try:
        ok, why = supports(graph)
    except Exception as e:  # noqa: BLE001 - supports() must answer, not raise
        return CodegenResult("finding", "supports-crash", Finding("codegen", "supports-crash", f"supports() raised {type(e).__name__}: {e}", {"graph": graph}, data={"seed": seed}))
    if not ok:
        return CodegenResult("rejected", codegen_reason_tag(why))
    fault_desc: list[str] = []
    try:
        ins, scale = graph_inputs(graph, seed)
        if faults:
            ins, fault_desc = inject_faults(ins, seed, faults)
        exact = execute(graph, [x.to(torch.float64) for x in ins])
        tols = kernel_tolerance(graph, ins, exact, seed + 1)
    except (MuGraphError, RuntimeError) as e:  # the graph validated: the reference must run it
        return CodegenResult("finding", "reference-crash", Finding("reference", "crash", f"{type(e).__name__}: {e}", {"graph": graph}, data={"seed": seed}))
    if any(e.numel() and bool(torch.isfinite(e).all()) and float(e.abs().max()) > torch.finfo(TORCH_DTYPES[graph.info[t].dtype]).max / 4
           for e, t in zip(exact, graph.outputs)):
        return CodegenResult("skipped", "out of range")
    try:
        cg = compile_graph(graph)
        run_ins = ins
        if rows is not None:
            if not cg.variable_batch or rows >= cg.bucket:
                rows = None
            else:
                # rows are independent (codegen's row analysis): the bucket's reference, sliced
                run_ins = [x[:rows].clone() if i in cg.row_inputs else x for i, x in enumerate(ins)]
                dims = [cg.rows.dims[t] for t in graph.outputs]
                exact = [e if d is None else e.narrow(d, 0, rows) for e, d in zip(exact, dims, strict=True)]
                tols = [t if d is None else t.narrow(d, 0, rows) for t, d in zip(tols, dims, strict=True)]
        got = cg(*run_ins)
    except Exception as e:  # noqa: BLE001 - any failure of a supported graph is a finding
        return CodegenResult("finding", "crash", Finding("codegen", "crash", f"{type(e).__name__}: {e}", {"graph": graph}, data={"seed": seed}), fault_desc)
    dtypes = [graph.info[t].dtype for t in graph.outputs]
    bad = compare_outputs(got, exact, tols, dtypes)
    if bad is None:
        return CodegenResult("pass", faults=fault_desc, rows=rows)
    tag, detail = bad
    explained = ""
    if faults and tag in ("spurious-nonfinite", "inf-mismatch"):
        explained = storage_range_issue(graph, ins)
    if rows is not None and check_codegen(graph, seed, faults=faults).outcome == "pass":
        tag, detail = f"rows-{tag}", f"{detail}; with all {cg.bucket} rows of the bucket the kernel agrees"
    data = {"seed": seed, "scale": scale, "faults": faults, "rows": rows}
    finding = Finding("codegen", tag, detail + (f" (faults: {'; '.join(fault_desc)})" if fault_desc else ""), {"graph": graph}, explained=explained, data=data)
    return CodegenResult("explained" if explained else "finding", tag, finding, fault_desc, rows)


def storage_range_issue(graph: KernelGraph, inputs: Sequence[torch.Tensor]) -> str:
    """Why a kernel may legitimately turn an injected Inf into NaN, or a finite value into Inf: some kernel
    tensor's float64 value lies outside what its storage dtype holds (overflow to inf, or underflow
    to 0, after which 0·inf = NaN). Empty if every kernel tensor fits."""
    store = storage_dtypes(graph)
    vals = kernel_values(graph, inputs, FloatAlgebra(torch.float64))
    for t, v in enumerate(vals):
        if graph.ops[graph.tensor_producers[t][0]].kind == "input":
            continue
        fi = torch.finfo(TORCH_DTYPES[store[t]])
        a = v[torch.isfinite(v) & (v != 0)].abs()
        if a.numel() and (float(a.max()) > fi.max or float(a.min()) < fi.smallest_normal * fi.eps):
            return f"a kernel tensor's float64 values leave the range of its {store[t]} storage (overflow to inf or underflow to 0, then 0·inf = NaN) next to an injected Inf/NaN"
    return ""


@dataclass
class VerifierResult:
    verdict: str
    truth: str
    outcome: str  # agree | unknown | finding | explained
    tag: str = ""
    finding: Finding | None = None


UNINTERPRETED = ("sqrt", "rsqrt", "silu", "rms_last", "rms_norm")


def _uses(graph: KernelGraph, names: tuple[str, ...]) -> bool:
    for op in graph.ops:
        ops = [op] + (list(op.block.ops) if op.block is not None else [])
        for o in ops:
            if o.kind in names or o.attr("fn") in names:
                return True
    return False


def check_verifier(cand: KernelGraph, spec: KernelGraph, seed: int, *, expect: str | None = None, what: str = "") -> VerifierResult:
    """Verify ``cand`` against ``spec`` and compare the verdict with float64 ground truth.

    ``expect="same"``: the pair is equivalent by construction (a rewrite); the
    ground truth is still computed and must agree."""
    from mirage_serve.verify import verify_equivalent

    graphs = {"candidate": cand, "spec": spec}
    try:
        truth, worst, why = ground_truth_why(cand, spec, seed)
    except (MuGraphError, RuntimeError) as e:  # both graphs validated: the reference must run them
        return VerifierResult("-", "-", "finding", "reference-crash", Finding("reference", "crash", f"{what}: {type(e).__name__}: {e}", graphs, data={"seed": seed}))
    if expect == "same" and truth == "differs":
        expl = "the rewrite overflows in float64 where the original does not (e.g. exp(a)·exp(-b) for exp(a - b))" if why == "candidate not finite" else ""
        f = Finding("reference", "rewrite-not-equivalent", f"{what}: an equivalent rewrite differs in float64 ({why}, relative {worst:.3g})",
                    graphs, explained=expl, data={"seed": seed, "expect": expect})
        return VerifierResult("-", truth, "explained" if expl else "finding", "rewrite-not-equivalent", f)
    try:
        cert = verify_equivalent(cand, spec, trials=3, seed=seed)
    except Exception as e:  # noqa: BLE001 - the verifier must answer for every pair of valid graphs
        return VerifierResult("-", truth, "finding", "crash", Finding("verifier", "crash", f"{what}: {type(e).__name__}: {e}", graphs, data={"seed": seed}))
    v = cert.verdict
    if v == "unknown":
        return VerifierResult(v, truth, "unknown", _unknown_tag(cert.reason))
    if truth == "unclear":
        return VerifierResult(v, truth, "agree" if v == "not_equivalent" else "unclear", "float64 difference between 1e-11 and 1e-6")
    if v == "equivalent" and truth == "differs" and why.endswith("not finite") and worst <= 1e-9:
        f = Finding("verifier", "false-accept", f"{what}: verdict equivalent; float64 agrees wherever both are finite, but {why.split()[0]} "
                    f"overflows or gives NaN at a larger input scale", graphs,
                    explained="equal as real functions; one program overflows float64 at an input scale above the float check's "
                    "(e.g. e/e for 1 with e = exp(y²))", data={"seed": seed, "expect": expect})
        return VerifierResult(v, truth, "explained", "overflow-only", f)
    if v == "equivalent" and truth == "differs":
        return VerifierResult(v, truth, "finding", "false-accept",
                              Finding("verifier", "false-accept", f"{what}: verdict equivalent, but float64 outputs differ ({why}, relative {worst:.3g}); {cert.reason}",
                                      graphs, data={"seed": seed, "expect": expect}))
    if v == "not_equivalent" and truth == "same":
        expl = ""
        if "float check fails" in cert.reason:
            expl = "the float check's fixed tolerance on an ill-conditioned program (the finite-field trials agree)"
        elif _uses(cand, UNINTERPRETED) or _uses(spec, UNINTERPRETED):
            expl = "sqrt/silu are uninterpreted functions in the finite-field model: identities about them are not proved"
        f = Finding("verifier", "false-reject", f"{what}: verdict not_equivalent, but float64 outputs agree (relative {worst:.3g}); {cert.reason}",
                    graphs, explained=expl, data={"seed": seed, "expect": expect})
        return VerifierResult(v, truth, "explained" if expl else "finding", "false-reject", f)
    return VerifierResult(v, truth, "agree")


def _unknown_tag(reason: str) -> str:
    r = reason
    for key, tag in (("depends on the values max returns", "max-dependent"), ("exp of", "exp-of-exp"), ("divided by zero", "zero-denominators"),
                     ("not finite", "non-finite-spec"), ("outside the finite-field model", "outside-model")):
        if key in r:
            return tag
    return r[:40]
