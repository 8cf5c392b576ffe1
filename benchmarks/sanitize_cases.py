"""Drive the Numba CUDA kernel through all of its features on small arrays.

``benchmarks/sanitize.sh`` runs this script under ``compute-sanitizer``
(memcheck, racecheck): every kernel specialisation (float32 and float64, each
head-size bucket, no mask / boolean / floating masks), partial query blocks
and key tiles, causal masking with both alignments (fully masked rows
included), grouped-query attention, broadcast masks and batches, strided
inputs, a single key, and torch CUDA tensors where torch has CUDA. Each result
is also checked against a float64 NumPy reference, so a run that the
sanitizer finds clean is also a correct one.

CuPy's memory pool is switched off: out-of-bounds accesses inside a pooled
block would be invisible to memcheck.

Usage::

    python benchmarks/sanitize_cases.py [-k SUBSTRING] [--list] [--simulator]

``--simulator`` runs shrunken cases on NumPy arrays with Numba's CUDA
simulator (no GPU needed; a dry run of this script). Exit status: 0 when every
case matches the reference, 1 otherwise, 0 with a message when no GPU is usable.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np

TOLERANCE = {"float16": 2e-3, "float32": 1e-5, "float64": 1e-12}


@dataclass(frozen=True)
class Case:
    """One kernel call: query (B…, H, Tq, E), key/value (B…, Hkv, Tk, E|Ev)."""

    name: str
    batch: tuple[int, ...] = (2,)
    h: int = 2
    hkv: int = 2
    tq: int = 37
    tk: int = 45
    e: int = 16
    ev: int = 16
    dtype: str = "float32"
    mask: str = "none"                  # none | bool | float
    mask_shape: str = "full"            # full | keys | rows_keys | batch_keys
    causal: str | None = None           # None | top_left | bottom_right
    strided: bool = False
    library: str = "cupy"               # cupy | torch


def cases() -> list[Case]:
    out = []
    # every specialisation: dtype × head-size bucket × mask kind
    for dtype in ("float32", "float64"):
        for e, ev in ((1, 3), (8, 8), (9, 16), (32, 20), (64, 64), (100, 128), (256, 200)):
            for mask in ("none", "bool", "float"):
                out.append(Case(f"{dtype}-E{e}-Ev{ev}-{mask}", e=e, ev=ev, dtype=dtype,
                                mask=mask))
    # tiles: exact multiples, one past, one short, a single row and key
    for tq, tk in ((64, 64), (65, 129), (63, 1), (1, 200), (130, 7)):
        for causal in (None, "top_left", "bottom_right"):
            out.append(Case(f"tiles-Tq{tq}-Tk{tk}-{causal}", tq=tq, tk=tk, causal=causal,
                            mask="bool"))
    out += [
        Case("gqa-8-on-2-causal", h=8, hkv=2, causal="bottom_right", mask="float",
             mask_shape="rows_keys"),
        Case("mqa-4-on-1", h=4, hkv=1, mask="bool", mask_shape="batch_keys"),
        Case("key-mask-broadcast", mask="bool", mask_shape="keys"),
        Case("more-queries-than-keys", tq=70, tk=20, causal="bottom_right", mask="float"),
        Case("no-batch-dims", batch=(), mask="bool"),
        Case("two-batch-dims", batch=(2, 3), mask="float", mask_shape="batch_keys"),
        Case("strided-inputs", strided=True, mask="bool", causal="top_left"),
        Case("float16-inputs", dtype="float16", causal="top_left"),
        Case("float64-big-head-gqa", dtype="float64", e=256, ev=256, h=4, hkv=2,
             causal="top_left"),
        Case("torch-tensors", library="torch", mask="bool", causal="bottom_right"),
    ]
    return out


def shrink(case: Case) -> Case:
    """A simulator-sized version of ``case`` (the simulator runs a Python thread per row)."""
    def small(n: int, cap: int) -> int:
        return max(1, min(n, cap)) if n else 0

    return Case(**{**case.__dict__, "tq": small(case.tq, 9), "tk": small(case.tk, 11),
                   "e": small(case.e, 20), "ev": small(case.ev, 20),
                   "batch": case.batch[:1], "h": small(case.h, 4), "hkv": small(case.hkv, 2)})


# --------------------------------------------------------------------------- #
# Inputs and the float64 reference
# --------------------------------------------------------------------------- #

def host_inputs(case: Case, rng: np.random.Generator):
    shape_q = (*case.batch, case.h, case.tq, case.e)
    shape_k = (*case.batch, case.hkv, case.tk, case.e)
    shape_v = (*case.batch, case.hkv, case.tk, case.ev)
    q, k, v = (rng.standard_normal(s).astype(case.dtype) for s in (shape_q, shape_k, shape_v))
    full = (*case.batch, case.h, case.tq, case.tk)
    mask_shape = {
        "full": full,
        "keys": (case.tk,),
        "rows_keys": (case.tq, case.tk),
        "batch_keys": (*case.batch, 1, 1, case.tk),
    }[case.mask_shape]
    mask = None
    if case.mask == "bool":
        mask = rng.random(mask_shape) < 0.75
    elif case.mask == "float":
        mask = rng.standard_normal(mask_shape).astype(case.dtype)
        mask[rng.random(mask_shape) < 0.2] = -np.inf
    return q, k, v, mask


def reference(case: Case, q, k, v, mask):
    """(out, lse) in float64 from the materialised scores."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    g = case.h // case.hkv
    k, v = np.repeat(k, g, axis=-3), np.repeat(v, g, axis=-3)
    s = (q @ np.swapaxes(k, -1, -2)) / math.sqrt(case.e)             # (B…, H, Tq, Tk)
    if mask is not None:
        s = np.where(mask, s, -np.inf) if mask.dtype == bool else s + mask.astype(np.float64)
    if case.causal is not None:
        offset = 0 if case.causal == "top_left" else case.tk - case.tq
        visible = np.arange(case.tk)[None, :] <= np.arange(case.tq)[:, None] + offset
        s = np.where(visible, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    m = np.where(np.isneginf(m), 0.0, m)
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True)
    w = np.where(l > 0, p / np.where(l > 0, l, 1.0), 0.0)
    lse = np.where(l > 0, m + np.log(np.where(l > 0, l, 1.0)), -np.inf)[..., 0]
    return w @ v, lse


def rel_error(got: np.ndarray, ref: np.ndarray) -> float:
    den = np.linalg.norm(ref)
    num = np.linalg.norm(np.asarray(got, dtype=np.float64) - ref)
    return float(num / den) if den > 0 else float(num)


# --------------------------------------------------------------------------- #
# Running a case
# --------------------------------------------------------------------------- #

class Device:
    """Moves arrays between the host and the library under test."""

    def __init__(self, simulator: bool) -> None:
        self.simulator = simulator
        if not simulator:
            import cupy

            cupy.cuda.set_allocator(None)              # no pool: memcheck sees every buffer
            cupy.cuda.set_pinned_memory_allocator(None)
            self.cupy = cupy

    def put(self, a: np.ndarray | None, library: str, strided: bool = False) -> Any:
        """``a`` on the device; ``strided``: laid out (…, F, T) and viewed as (…, T, F)."""
        if a is None:
            return None
        if self.simulator:
            return np.swapaxes(np.ascontiguousarray(np.swapaxes(a, -1, -2)), -1, -2) \
                if strided else a
        if library == "torch":
            import torch

            t = torch.from_numpy(np.ascontiguousarray(a)).cuda()
            return t.transpose(-1, -2).contiguous().transpose(-1, -2) if strided else t
        x = self.cupy.asarray(a)
        if strided:
            x = self.cupy.ascontiguousarray(x.swapaxes(-1, -2)).swapaxes(-1, -2)
        return x

    def get(self, x: Any) -> np.ndarray:
        if self.simulator:
            return np.asarray(x)
        if type(x).__module__.startswith("torch"):
            return x.detach().cpu().numpy()
        return self.cupy.asnumpy(x)

    def synchronize(self) -> None:
        if not self.simulator:
            self.cupy.cuda.runtime.deviceSynchronize()


def run_case(case: Case, device: Device, rng: np.random.Generator) -> str | None:
    """None when the kernel's result matches the reference, else what went wrong."""
    import polyattn

    q, k, v, mask = host_inputs(case, rng)
    args = [device.put(a, case.library, case.strided) for a in (q, k, v)]
    m = device.put(mask, case.library)
    out, lse = polyattn.scaled_dot_product_attention(
        *args, attn_mask=m, is_causal=case.causal is not None,
        causal_alignment=case.causal or "top_left", enable_gqa=case.h != case.hkv,
        return_lse=True, implementation="numba_cuda")
    device.synchronize()
    ref, ref_lse = reference(case, q, k, v, mask)
    got, got_lse = device.get(out), device.get(lse)
    if got.shape != ref.shape or got_lse.shape != ref_lse.shape:
        return f"shapes {got.shape}, {got_lse.shape}; expected {ref.shape}, {ref_lse.shape}"
    if np.isnan(got).any() or np.isnan(got_lse).any():
        return "NaN in the result"
    inf = np.isneginf(ref_lse)
    if not np.array_equal(np.isneginf(got_lse), inf):
        return "lse is -inf on other rows than the reference"
    tol = TOLERANCE[case.dtype]
    err = rel_error(got, ref)
    lse_err = rel_error(np.where(inf, 0, got_lse), np.where(inf, 0, ref_lse))
    if err > tol or lse_err > max(tol, TOLERANCE["float32"]):
        return f"relative error out {err:.3g}, lse {lse_err:.3g} (tolerance {tol})"
    return None


def gpu_problem() -> str | None:
    """None when CuPy, a CUDA GPU and numba-cuda are usable, else why not."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA GPU"
    except Exception as exc:  # CUDA errors come in many types
        return f"CuPy/CUDA is not usable ({exc})"
    try:
        import numba.cuda  # noqa: F401
    except ImportError as exc:
        return f"numba-cuda is not installed ({exc})"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", dest="select", default="",
                        help="run only the cases whose name contains this")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--simulator", action="store_true",
                        help="shrunken cases on NumPy arrays with the CUDA simulator")
    args = parser.parse_args(argv)

    selected = [c for c in cases() if args.select in c.name]
    if not selected:
        print(f"no case name contains {args.select!r}", file=sys.stderr)
        return 2
    if args.list:
        print("\n".join(c.name for c in selected))
        return 0
    if args.simulator:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"        # before numba is imported
        selected = [shrink(c) for c in selected if c.library == "cupy"]
        from polyattn.backends.cuda import rows as numba_cuda

        numba_cuda.BLOCK_Q = 4
    else:
        problem = gpu_problem()
        if problem is not None:
            print(f"no GPU: skipping ({problem})")
            return 0
        try:
            import torch

            has_torch_cuda = torch.cuda.is_available()
        except ImportError:
            has_torch_cuda = False
        if not has_torch_cuda:
            selected = [c for c in selected if c.library != "torch"]

    device = Device(args.simulator)
    rng = np.random.default_rng(0)
    failures = 0
    for case in selected:
        try:
            problem = run_case(case, device, rng)
        except Exception:
            problem = "raised:\n" + traceback.format_exc()
        failures += problem is not None
        print(f"{'ok  ' if problem is None else 'FAIL'} {case.name}"
              + ("" if problem is None else f": {problem}"), flush=True)
    print(f"{len(selected) - failures} of {len(selected)} cases match the reference")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
