"""Control flow: ONNX If -> the IR's ``conditional``, Loop -> ``while`` (docs/ir.md).

    If(cond) then/else          cond known at load: the branch is imported inline
                                else: conditional(pred, (captured of then), (captured of else))
    Loop(M, cond, v...)         while over (i, M, cond, v..., captured..., scan buffers...)
      body(i, cond, v...)       -> (cond', v'..., scan...)

Subgraphs read values of the enclosing graph by name: those that are not host constants are
passed in (``Importer.subgraph``). Scan outputs need a trip count known at load and no
condition input (a for loop), so that their length is static.
"""

from __future__ import annotations

import numpy as np

from tf_ipu.onnx.context import Ctx
from tf_ipu.onnx.ir_builder import Val
from tf_ipu.onnx.registry import register


@register("If", attrs=("then_branch", "else_branch"))
def if_(ctx: Ctx) -> list[Val]:
    cond = ctx.input(0)
    then_g, else_g = ctx.attrs["then_branch"].g, ctx.attrs["else_branch"].g
    env = ctx.imp.current_env
    if cond.const is not None:
        graph = then_g if bool(ctx.one_value(cond.const, "condition (input 0)")) else else_g
        inner = dict(env)
        ctx.imp.import_nodes(graph, ctx.comp, inner, ctx.opset)
        return [inner[o.name] for o in graph.output]
    c = ctx.comp
    pred = c.reshape(c.convert(cond, np.bool_), [])
    then_c, then_cap, _, then_out = ctx.imp.subgraph(ctx, then_g, env, "then")
    else_c, else_cap, _, else_out = ctx.imp.subgraph(ctx, else_g, env, "else")
    if len(then_out) != len(else_out):
        raise ctx.refuse("the branches have different numbers of outputs")
    for k, (t, e) in enumerate(zip(then_out, else_out, strict=True)):
        if t.shape != e.shape or t.dtype != e.dtype:
            raise ctx.refuse(f"output {k} is {t.dtype}{list(t.shape)} in then_branch and "
                             f"{e.dtype}{list(e.shape)} in else_branch (static shapes must agree)")
    then_c.root(then_c.tuple(then_out))
    else_c.root(else_c.tuple(else_out))
    shapes = [(v.dtype, v.shape) for v in then_out]
    r = c.tuple_op("conditional", [pred, c.tuple(then_cap), c.tuple(else_cap)], shapes,
                   called=[then_c.cid, else_c.cid])
    return [c.gte(r, k, d, s) for k, (d, s) in enumerate(shapes)]


@register("Loop", attrs=("body",))
def loop(ctx: Ctx) -> list[Val]:
    c = ctx.comp
    body = ctx.attrs["body"].g
    env = ctx.imp.current_env
    trip = ctx.inputs[0] if ctx.has(0) else None
    cond = ctx.inputs[1] if ctx.has(1) else None
    init = [ctx.input(i) for i in range(2, len(ctx.inputs))]
    n_carried = len(init)
    n_scan = len(body.output) - 1 - n_carried
    if n_scan < 0:
        raise ctx.refuse("the body has fewer outputs than loop-carried values")
    trip_count = None if trip is None or trip.const is None else int(ctx.one_value(trip.const, "trip count (input 0)"))
    if n_scan and (trip_count is None or cond is not None):
        raise ctx.refuse("scan outputs need a trip count known at load and no condition input "
                         "(their length must be static)")
    i0 = c.constant(np.int64(0), np.int64)
    m = c.reshape(c.convert(trip, np.int64), []) if trip is not None else c.constant(
        np.int64(np.iinfo(np.int64).max), np.int64)
    k0 = c.reshape(c.convert(cond, np.bool_), []) if cond is not None else c.constant(np.bool_(True), np.bool_)
    carried = [c.use(v) for v in init]
    # Body outputs' shapes are needed for the scan buffers: import the body once to learn them.
    leading = [Val(np.dtype(np.int64), ()), Val(np.dtype(np.bool_), ()), *init]
    probe_c, cap, cap_names, probe_out = ctx.imp.subgraph(ctx, body, env, "body", leading)
    scan_shapes = [(v.dtype, (trip_count or 0, *v.shape)) for v in probe_out[1 + n_carried:]]
    for k, (v, o) in enumerate(zip(init, probe_out[1:1 + n_carried], strict=True)):
        if v.shape != o.shape or v.dtype != o.dtype:
            raise ctx.refuse(f"loop-carried value {k} changes from {v.dtype}{list(v.shape)} to "
                             f"{o.dtype}{list(o.shape)} in the body (shapes must be loop-invariant)")
    scans = [c.scalar(0, d, s) for d, s in scan_shapes]
    state = [i0, m, k0, *carried, *cap, *scans]
    state_vals = [Val(v.dtype, v.shape) for v in state]
    # the body computation: parameter = the whole state tuple
    bc = probe_c
    # re-bind: the probe computation took (i, cond, v..., captured...) as its tuple parameter;
    # the while body takes the whole state, so a wrapper computation adapts the two.
    wrap = ctx.imp.mb.computation(ctx.imp.mb.unique(f"{ctx.node.name or 'Loop'}_step"))
    s = wrap.tuple_parameter(0, state_vals)
    i, mm, _k = s[0], s[1], s[2]
    vs = s[3:3 + n_carried]
    caps = s[3 + n_carried:3 + n_carried + len(cap)]
    bufs = s[3 + n_carried + len(cap):]
    args = wrap.tuple([i, _k, *vs, *caps])
    outs_shapes = [(v.dtype, v.shape) for v in probe_out]
    bc.root(bc.tuple(probe_out))
    call = wrap.tuple_op("call", [args], outs_shapes, called=[bc.cid])
    res = [wrap.gte(call, k, d, sh) for k, (d, sh) in enumerate(outs_shapes)]
    k_next = wrap.reshape(wrap.convert(res[0], np.bool_), []) if cond is not None else _k
    new_bufs = []
    for buf, val in zip(bufs, res[1 + n_carried:], strict=True):
        upd = wrap.reshape(val, [1, *val.shape])
        zero = wrap.constant(np.int64(0), np.int64)
        new_bufs.append(wrap.op("dynamic-update-slice", [buf, upd, i] + [zero] * val.rank, buf.dtype, buf.shape))
    one = wrap.constant(np.int64(1), np.int64)
    wrap.root(wrap.tuple([wrap.binary("add", i, one), mm, k_next, *res[1:1 + n_carried], *caps, *new_bufs]))
    cnd = ctx.imp.mb.computation(ctx.imp.mb.unique(f"{ctx.node.name or 'Loop'}_cond"))
    cs = cnd.tuple_parameter(0, state_vals)
    cnd.root(cnd.op("and", [cnd.compare("LT", cs[0], cs[1]), cs[2]], np.bool_, ()))
    tup = c.tuple(state)
    w = c.tuple_op("while", [tup], [(v.dtype, v.shape) for v in state], called=[cnd.cid, wrap.cid])
    finals = [c.gte(w, 3 + k, v.dtype, v.shape) for k, v in enumerate(init)]
    base = 3 + n_carried + len(cap)
    finals += [c.gte(w, base + k, d, sh) for k, (d, sh) in enumerate(scan_shapes)]
    return finals
