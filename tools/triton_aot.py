"""Every Triton kernel of the engine compiled ahead of time for a GPU that need not be here
(default sm90: the H200), at the launch shapes and dtypes Qwen3.5-35B-A3B gives them, then
put through ptxas for its register, spill and shared-memory figures. Triton compiles for a
named target without a device, and ptxas ships with it, so a kernel that would not compile
on the GPU (a type error, an unsupported op, shared memory past the limit) fails here, on
any machine, before a GPU run is spent finding out.

    python -m tools.triton_aot [--arch 90] [--out FILE]

Prints one row per kernel variant: shared bytes, registers per thread, spill bytes, compile
seconds. Exit status 1 if any variant fails to compile or needs more shared memory than
`--shared-limit` (227 KiB: what an sm90 block may have)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

SHARED_LIMIT = 227 * 1024
I32 = "i32"


@dataclass(frozen=True)
class Variant:
    """One compilation: the kernel (module path, name), the runtime arguments' Triton types
    in order, the constexprs, the launch options, and the integer arguments' values at the
    real model's sizes. A launch specialises on those values, and so does this compile: a 1
    becomes a constant (a unit stride: contiguous, vectorised loads), a multiple of 16 gets
    that divisibility, as every pointer does (torch allocates 16-byte aligned)."""

    name: str
    module: str
    kernel: str
    signature: dict[str, str]
    constexprs: dict[str, object]
    options: dict[str, int | bool]
    values: dict[str, int] = field(default_factory=dict)


def _moe_variants() -> list[Variant]:
    from target.kernels import moe_sorted, moe_triton

    hidden, inter = 2048, 512
    pair_gate_up = {"x_ptr": "*bf16", "w_ptr": "*bf16", "shared_ptr": "*bf16",
                    "ids_ptr": "*i64", "h_ptr": "*bf16", "top_k": I32, "inter": I32,
                    "hidden": I32, "stride_xt": I32, "stride_xh": I32, "stride_we": I32,
                    "stride_wn": I32, "stride_wh": I32, "stride_it": I32, "stride_ik": I32}
    pair_down = {"h_ptr": "*bf16", "w_ptr": "*bf16", "shared_ptr": "*bf16", "ids_ptr": "*i64",
                 "y_ptr": "*bf16", "top_k": I32, "hidden": I32, "inter": I32, "stride_we": I32,
                 "stride_wn": I32, "stride_wi": I32, "stride_it": I32, "stride_ik": I32}
    gu, dn = moe_triton.pair_blocks(hidden), moe_triton.pair_blocks(inter)
    experts = dict(top_k=8, inter=inter, hidden=hidden, stride_xt=hidden, stride_xh=1,
                   stride_it=8, stride_ik=1)
    out = [
        Variant("pairs gate_up", "target.kernels.moe_triton", "_gate_up_kernel", pair_gate_up,
                {"BLOCK_N": gu.block_n, "BLOCK_K": gu.block_k, "PREFETCH": gu.prefetch,
                 "SHARED": True},  # the engine's decode: the shared expert as a 9th slot
                {"num_warps": gu.num_warps},
                {**experts, "stride_we": 2 * inter * hidden, "stride_wn": hidden,
                 "stride_wh": 1}),
        Variant("pairs down", "target.kernels.moe_triton", "_down_kernel", pair_down,
                {"BLOCK_N": dn.block_n, "BLOCK_K": dn.block_k, "PREFETCH": dn.prefetch,
                 "SHARED": True},
                {"num_warps": dn.num_warps},
                {**experts, "stride_we": hidden * inter, "stride_wn": inter, "stride_wi": 1}),
    ]
    # The same with the next loop step's loads issued first (PairBlocks.prefetch).
    out += [Variant(f"{v.name}, prefetch", v.module, v.kernel, v.signature,
                    {**v.constexprs, "PREFETCH": True}, v.options, v.values)
            for v in out if not v.constexprs["PREFETCH"]]
    # a 16-token verify at batch 1: 128 pairs
    gate_up_values = {**experts, "num_pairs": 128, "stride_we": 2 * inter * hidden,
                      "stride_wn": hidden, "stride_wh": 1}
    down_values = {**experts, "num_pairs": 128, "stride_we": hidden * inter,
                   "stride_wn": inter, "stride_wi": 1}
    for dtype, precision in (("bf16", "tf32"), ("fp32", "ieee")):
        sorted_gate_up = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "pairs_ptr": "*i32",
                          "experts_ptr": "*i32", "h_ptr": f"*{dtype}", "num_pairs": I32,
                          "top_k": I32, "inter": I32, "hidden": I32, "stride_xt": I32,
                          "stride_xh": I32, "stride_we": I32, "stride_wn": I32,
                          "stride_wh": I32}
        sorted_down = {"h_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "pairs_ptr": "*i32",
                       "experts_ptr": "*i32", "y_ptr": f"*{dtype}", "num_pairs": I32,
                       "hidden": I32, "inter": I32, "stride_we": I32, "stride_wn": I32,
                       "stride_wi": I32}
        for label, sig, blocks, values in (
                ("gate_up", sorted_gate_up, moe_sorted.sorted_blocks(inter, hidden),
                 gate_up_values),
                ("down", sorted_down, moe_sorted.sorted_blocks(hidden, inter), down_values)):
            out.append(Variant(
                f"sorted {label} {dtype}", "target.kernels.moe_sorted",
                f"_{label}_kernel", sig,
                {"BLOCK_M": moe_sorted.BLOCK_M, "BLOCK_N": blocks.block_n,
                 "BLOCK_K": blocks.block_k, "UPCAST": False, "PRECISION": precision},
                {"num_warps": blocks.num_warps, "num_stages": blocks.num_stages}, values))
    align = {"ids_ptr": "*i64", "pairs": I32, "top_k": I32, "stride_it": I32,
             "stride_ik": I32, "starts_ptr": "*i32", "cursor_ptr": "*i32",
             "sorted_ptr": "*i32"}
    align_values = {"pairs": 1024, "top_k": 8, "stride_it": 8, "stride_ik": 1,
                    "max_blocks": 64 + 256}
    out += [
        Variant("sorted align: groups", "target.kernels.moe_sorted", "_groups_kernel",
                {**align, "block_expert_ptr": "*i32", "max_blocks": I32},
                {"BLOCK_M": moe_sorted.BLOCK_M, "BLOCK_E": 256,
                 "CHUNK": moe_sorted._ALIGN_CHUNK, "BLOCK_B": moe_sorted._ALIGN_BLOCKS},
                {"num_warps": 4}, align_values),
        Variant("sorted align: place", "target.kernels.moe_sorted", "_place_kernel", align,
                {"BLOCK": moe_sorted._ALIGN_CHUNK}, {"num_warps": 4}, align_values),
    ]
    return out


def _route_variants() -> list[Variant]:
    sig = {"logits_ptr": "*bf16", "weights_ptr": "*bf16", "ids_ptr": "*i64", "experts": I32,
           "stride_t": I32, "stride_e": I32}
    return [Variant("routing top-8 of 256", "target.kernels.moe_route", "_route_kernel", sig,
                    {"TOP_K": 8, "BLOCK_E": 256, "BLOCK_K": 8}, {"num_warps": 4},
                    {"experts": 256, "stride_t": 256, "stride_e": 1})]


def _penalty_variants() -> list[Variant]:
    sig = {"logits_ptr": "*fp32", "table_ptr": "*i32", "counts_ptr": "*i32",
           "prompt_ptr": "*i1", "params_ptr": "*fp32", "vocab": I32, "stride_logits": I32,
           "width": I32, "stride_counts": I32, "stride_prompt": I32}
    from target.kernels import penalties

    return [Variant("penalties, B = 16", "target.kernels.penalties", "_penalize_kernel", sig,
                    {"DRAFTS": 15, "HAS_PROMPT": True, "BLOCK": penalties.BLOCK_V},
                    {"num_warps": 4, "enable_fp_fusion": False},
                    {"vocab": 248320, "stride_logits": 248320, "width": 17,
                     "stride_counts": 248320, "stride_prompt": 248320})]


def _gdn_variants() -> list[Variant]:
    from target.kernels import gdn_slots

    names = ["q_ptr", "k_ptr", "v_ptr", "g_ptr", "beta_ptr", "state_ptr", "slots_ptr",
             "kept_ptr", "o_ptr", "tap_slots_ptr", "tap_starts_ptr", "tap_ends_ptr"]
    types = ["*bf16", "*bf16", "*bf16", "*fp32", "*bf16", "*fp32", "*i64", "*i64", "*bf16",
             "*i64", "*i64", "*i64"]
    sig = dict(zip(names, types, strict=True))
    sig.update({n: I32 for n in ("length", "v_heads", "group", "dv", "page", "stride_tap")})
    for prefix, count in (("q", 4), ("k", 4), ("v", 4), ("g", 3), ("b", 3), ("c", 4), ("o", 4)):
        dims = {4: ("s", "t", "h", "d"), 3: ("s", "t", "h")}[count]
        if prefix == "c":
            dims = ("n", "h", "k", "v")
        sig.update({f"stride_{prefix}{d}": I32 for d in dims})
    out = []
    launch = gdn_slots.LAUNCH
    # the commit as the captured rounds run it: with taps (the prefix cache's boundary slots)
    for label, length, kept, write, need, tap in (("decode", 1, False, True, True, False),
                                                  ("verify", 16, False, False, True, False),
                                                  ("commit", 16, True, True, False, True)):
        # q, k [S, L, 16, 128] contiguous; v a view of the conv output (8192 channels per
        # token); g, β [S, L, 32]; the cache [N, 32, 128, 128]; o [S, L, 32, 128]
        qk = {"s": length * 2048, "t": 2048, "h": 128, "d": 1}
        values = {"length": length, "v_heads": 32, "group": 2, "dv": 128, "page": 16,
                  "stride_tap": length,
                  **{f"stride_q{d}": v for d, v in qk.items()},
                  **{f"stride_k{d}": v for d, v in qk.items()},
                  **dict(zip(("stride_vs", "stride_vt", "stride_vh", "stride_vd"),
                             (length * 8192, 8192, 128, 1), strict=True)),
                  **dict(zip(("stride_gs", "stride_gt", "stride_gh"), (length * 32, 32, 1),
                             strict=True)),
                  **dict(zip(("stride_bs", "stride_bt", "stride_bh"), (length * 32, 32, 1),
                             strict=True)),
                  **dict(zip(("stride_cn", "stride_ch", "stride_ck", "stride_cv"),
                             (32 * 128 * 128, 128 * 128, 128, 1), strict=True)),
                  **dict(zip(("stride_os", "stride_ot", "stride_oh", "stride_od"),
                             (length * 4096, 4096, 128, 1), strict=True))}
        out.append(Variant(f"gdn slots {label}", "target.kernels.gdn_slots",
                           "_recurrent_slots_kernel", sig,
                           {"DK": 128, "BLOCK_V": launch.block_v, "HAS_KEPT": kept,
                            "WRITE_STATE": write, "NEED_OUTPUT": need, "TAP": tap},
                           {"num_warps": launch.warps}, values))
    conv = {"Seq": "*bf16", "Cache": "*bf16", "Slots": "*i64", "Kept": "*i64",
            "TapSlots": "*i64", "TapStarts": "*i64", "TapEnds": "*i64", "n_fixed": I32,
            "channels": I32, "page": I32, "stride_tap": I32}
    conv.update({n: I32 for n in ("stride_qs", "stride_qc", "stride_ql", "stride_cn",
                                  "stride_cc", "stride_ck")})
    for label, length, per_seq in (("decode", 1, False), ("commit", 16, True)):
        # conv_seq [S, 8192, 3 + L] contiguous; the cache [N, 8192, 3]
        out.append(Variant(f"gdn conv commit {label}", "target.kernels.gdn_slots",
                           "_commit_conv_kernel", conv,
                           {"K_1": 3, "BLOCK_C": gdn_slots.CONV_BLOCK, "PER_SEQ": per_seq,
                            "TAP": per_seq},
                           {"num_warps": 4},
                           {"n_fixed": 0 if per_seq else 1, "channels": 8192, "page": 16,
                            "stride_tap": length,
                            "stride_qs": 8192 * (3 + length), "stride_qc": 3 + length,
                            "stride_ql": 1, "stride_cn": 8192 * 3, "stride_cc": 3,
                            "stride_ck": 1}))
    # the prologue (gdn_prologue): x a view of the input projection's [T, 12352] output (the
    # 8192 conv channels, then z 4096, b 32, a 32); the cache [N, 8192, 3]; weight [8192, 4]
    prologue = {n: "*bf16" for n in ("x_ptr", "cache_ptr")}
    prologue.update({"slots_ptr": "*i64", "w_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16",
                     "alog_ptr": "*fp32", "dtb_ptr": "*fp32", "q_ptr": "*bf16",
                     "k_ptr": "*bf16", "v_ptr": "*bf16", "g_ptr": "*fp32", "beta_ptr": "*bf16",
                     "seq_ptr": "*bf16", "width": I32, "key_dim": I32, "q_scale": "fp32"})
    for label, length in (("decode", 1), ("verify", 16)):
        strides = dict(stride_xs=12352 * length, stride_xl=12352, stride_cn=8192 * 3,
                       stride_cc=3, stride_ck=1, stride_wc=4, stride_wk=1, stride_at=12352,
                       stride_bt=12352, stride_qs=8192 * (3 + length), stride_qc=3 + length,
                       stride_qk=1)
        out.append(Variant(f"gdn prologue {label}", "target.kernels.gdn_prologue",
                           "_prologue_kernel", {**prologue, **{n: I32 for n in strides}},
                           {"K": 4, "DK": 128, "DV_GROUP": 256, "RATIO": 2, "BLOCK_K": 128,
                            "BLOCK_V": 256, "BLOCK_R": 2, "WRITE_STATE": length == 1},
                           {"num_warps": 4}, {"width": length, "key_dim": 2048, **strides}))
    # the gated output norm: o [T, 32, 128] contiguous; z a view of the same projection
    norm = {"o_ptr": "*bf16", "z_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
            "heads": I32, "dim": I32, "eps": "fp32", "stride_ot": I32, "stride_oh": I32,
            "stride_zt": I32, "stride_zh": I32}
    out.append(Variant("gdn gated norm", "target.kernels.gdn_prologue", "_gated_norm_kernel",
                       norm, {"BLOCK_D": 128}, {"num_warps": 1},
                       {"heads": 32, "dim": 128, "stride_ot": 4096, "stride_oh": 128,
                        "stride_zt": 12352, "stride_zh": 128}))
    return out


def _attention_variants(launches: list = ()) -> list[Variant]:
    """The attention's kernels at its two launch shapes (fixed and adaptive splits) and at
    `launches` (attention_triton.Launch: shapes a sweep would try)."""
    from target.kernels import attention_triton

    launch = attention_triton.LAUNCH
    split = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Tables": "*i32", "QFirst": "*i32",
             "KvLens": "*i32", "Acc": "*fp32", "Stat": "*fp32"}
    split.update({n: I32 for n in ("stride_qt", "stride_qh", "stride_kb", "stride_kp",
                                   "stride_kh", "stride_vb", "stride_vp", "stride_vh",
                                   "stride_tb")})
    split.update({"scale": "fp32"})
    split.update({n: I32 for n in ("width", "group", "rows", "n_heads", "n_tokens", "window")})
    merge = {"Acc": "*fp32", "Stat": "*fp32", "QFirst": "*i32", "KvLens": "*i32",
             "Out": "*bf16", "Lse": "*fp32"}
    merge.update({n: I32 for n in ("stride_ot", "stride_oh", "width", "n_heads", "n_tokens",
                                   "window")})
    # a 16-token verify at batch 1: q [16, 16 heads, 256]; the pages [N, 16, 2 kv heads, 256]
    sizes = {"width": 16, "n_heads": 16, "n_tokens": 16, "window": 0}
    out = []
    extra = [(f" {la.split},{la.block_m},{la.block_n},{la.warps},{la.stages},"
              f"{la.merge_chunk},{la.max_splits},{la.split_ratio},{la.small_rows}", la)
             for la in launches]
    for name, launch in (("", attention_triton.LAUNCH),
                         (", adaptive", attention_triton.ADAPTIVE_LAUNCH), *extra):
        out += [
            Variant(f"attention split{name}", "target.kernels.attention_triton",
                    "_split_kernel", split,
                    {"PAGE": 16, "D": 256, "BLOCK_D": 256, "BLOCK_M": launch.block_m,
                     "BLOCK_N": launch.block_n, "SPLIT": launch.split,
                     "MAX_SPLITS": launch.max_splits, "RATIO": launch.split_ratio,
                     "CAUSAL": True, "WINDOWED": False, "IEEE": False},
                    {"num_warps": launch.warps, "num_stages": launch.stages},
                    {**sizes, "stride_qt": 4096, "stride_qh": 256, "stride_kb": 8192,
                     "stride_kp": 512, "stride_kh": 256, "stride_vb": 8192, "stride_vp": 512,
                     "stride_vh": 256, "stride_tb": 64, "group": 8, "rows": 128}),
        ]
        # the merge one chunk a step (a table of 512 keys) and two (131,072 keys)
        for keys, form in ((512, ""), (131072, ", two chunks")):
            slots = attention_triton.split_bound(launch, keys)
            out.append(Variant(
                f"attention merge{name}{form}", "target.kernels.attention_triton",
                "_merge_kernel", merge,
                {"D": 256, "BLOCK_D": 256, "BLOCK_N": launch.block_n, "SPLIT": launch.split,
                 "MAX_SPLITS": launch.max_splits, "RATIO": launch.split_ratio,
                 "CHUNK": launch.merge_chunk, "ALL": attention_triton.merge_all(slots),
                 "PAIR": slots > launch.merge_chunk, "WINDOWED": False, "WITH_LSE": False},
                {"num_warps": 4}, {**sizes, "stride_ot": 4096, "stride_oh": 256}))
    # the prologue (qk_rope_triton): q the strided half of [T, 16 heads, 2·256], k and v
    # [T, 2, 256], caches [N, 16, 2, 256] viewed as slots
    prologue = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "qw_ptr", "kw_ptr")}
    prologue.update({"cos_ptr": "*fp32", "sin_ptr": "*fp32", "slot_ptr": "*i64",
                     "out_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16",
                     "num_q_heads": I32, "eps": "fp32"})
    strides = dict(stride_qt=8192, stride_qh=512, stride_kt=512, stride_kh=256,
                   stride_vt=512, stride_vh=256, stride_cos=64, stride_sin=64,
                   stride_ot=4096, stride_oh=256, stride_kcs=512, stride_kch=256,
                   stride_vcs=512, stride_vch=256)
    prologue.update({n: I32 for n in strides})
    out.append(Variant("attention prologue (q/k norm, RoPE, K/V write)",
                       "target.kernels.qk_rope_triton", "_qk_norm_rope_kernel", prologue,
                       {"DIM": 256, "BLOCK_D": 256, "ROTARY": 64},
                       {"num_warps": 1, "enable_fp_fusion": False},
                       {"num_q_heads": 16, **strides}))
    return out


def variants(attention_launches: list = ()) -> list[Variant]:
    return (_moe_variants() + _route_variants() + _gdn_variants() + _penalty_variants()
            + _attention_variants(attention_launches))


def compile_variant(v: Variant, arch: int, pdl: bool = False) -> dict:
    """Compile one variant for sm_{arch}; its figures, or the error. pdl: the kernel's PDL
    constexpr and Triton's launch_pdl option (target/kernels/pdl.py), for sm90 and later.
    The figures say whether the PTX holds griddepcontrol's wait (with pdl every kernel's
    first instruction of its own; without, none)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    t = time.perf_counter()
    row = {"name": v.name}
    try:
        fn = getattr(importlib.import_module(v.module), v.kernel)
        # (the table shares one dict of sizes among kernels: each takes the ones it has)
        values = {name: value for name, value in v.values.items() if name in fn.arg_names}
        ones = {name: 1 for name, value in values.items() if value == 1}
        signature = {**v.signature, **{c: "constexpr" for c in (*v.constexprs, *ones)}}
        aligned = [name for name, kind in v.signature.items() if kind.startswith("*")
                   or (name not in ones and values.get(name, 1) % 16 == 0)]
        attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
        constexprs = {**v.constexprs, **ones}
        options = dict(v.options)
        if "PDL" in fn.arg_names:  # every engine kernel's launch passes it
            signature["PDL"], constexprs["PDL"] = "constexpr", pdl
            if pdl:
                options["launch_pdl"] = True
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    except Exception as e:  # the point of the tool: report it
        row["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
        return row
    row["shared"] = compiled.metadata.shared
    row["gdc_wait"] = "griddepcontrol.wait" in compiled.asm["ptx"]
    row.update(_ptxas_figures(compiled.asm["ptx"], arch))
    row["seconds"] = round(time.perf_counter() - t, 2)
    return row


def _ptxas_figures(ptx: str, arch: int) -> dict:
    import triton.backends.nvidia as nvidia

    ptxas = os.path.join(os.path.dirname(nvidia.__file__), "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        suffix = "a" if arch >= 90 else ""
        out = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}{suffix}", f.name, "-o",
                              os.devnull], capture_output=True, text=True, timeout=300)
    finally:
        os.unlink(f.name)
    if out.returncode != 0:
        return {"error": f"ptxas: {out.stderr[-2000:]}"}
    regs = re.search(r"Used (\d+) registers", out.stderr)
    spill = re.search(r"(\d+) bytes spill stores", out.stderr)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_bytes": int(spill.group(1)) if spill else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability ×10 (90: H200)")
    p.add_argument("--shared-limit", type=int, default=SHARED_LIMIT)
    p.add_argument("--only", help="variants whose name contains this")
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--attention-launch", nargs="*", default=[],
                   metavar="SPLIT,BM,BN,WARPS,STAGES"
                           "[,CHUNK[,MAX_SPLITS[,SPLIT_RATIO[,SMALL_ROWS]]]]",
                   help="the attention's kernels at these launch shapes too (as "
                        "bench/round_attention.py --launch takes them)")
    p.add_argument("--pdl", action="store_true",
                   help="with the kernels' programmatic dependent launch on (KernelConfig.pdl)")
    args = p.parse_args(argv)
    from target.kernels.attention_triton import Launch

    launches = [Launch.parse(shape) for shape in args.attention_launch]
    rows = [compile_variant(v, args.arch, args.pdl) for v in variants(launches)
            if args.only is None or args.only in v.name]
    print(f"| kernel (sm_{args.arch}) | shared bytes | registers | spill bytes | s |")
    print("|---|---|---|---|---|")
    failed = False
    for r in rows:
        if "error" in r:
            failed = True
            print(f"| {r['name']} | ERROR: {r['error'].splitlines()[0][:200]} | | | |")
            continue
        over = r["shared"] > args.shared_limit
        failed |= over
        if r["gdc_wait"] != args.pdl:
            failed = True
            print(f"| {r['name']} | ERROR: griddepcontrol.wait {'not ' * args.pdl}in its PTX "
                  f"with pdl {'on' if args.pdl else 'off'} | | | |")
            continue
        print(f"| {r['name']} | {r['shared']}{' (over the limit)' if over else ''} | "
              f"{r['registers']} | {r['spill_bytes']} | {r['seconds']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
