"""``python -m tf_ipu.onnx model.onnx --ipu-version ipu1 --batch-sizes 1,2,4,8 --html report.html``

Compiles the model for each batch size on the device server (the embedded one unless
``--server`` or ``$TF_IPU_SERVER``), prints the tile model's estimate of each (latency,
throughput, peak tile memory, fits), and writes the HTML report of the largest batch that
fits, with the batch-size sweep plotted. Imports no TensorFlow.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _shapes(items: Sequence[str]) -> dict[str, object]:
    """``name=1,128`` (an input's shape) or ``seq=128`` (a symbolic dimension)."""
    out: dict[str, object] = {}
    for item in items:
        name, _, dims = item.partition("=")
        values = [int(d) for d in dims.split(",") if d.strip()]
        out[name] = values[0] if len(values) == 1 and "," not in dims else values
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tf_ipu.onnx", description=__doc__.splitlines()[0])
    p.add_argument("model", help="an .onnx file")
    p.add_argument("--ipu-version", default=None, help="ipu1, ipu2 or bow (default: the system's, else ipu2)")
    p.add_argument("--batch-sizes", default="1", help="comma-separated, e.g. 1,2,4,8,16")
    p.add_argument("--precision", default="fp32", choices=("fp32", "fp16"))
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--system", default=None, help="a named system whose IPUs run the replicas (c2, ...)")
    p.add_argument("--input-shape", action="append", default=[], metavar="NAME=DIMS",
                   help="an input's shape (x=1,128,3) or a symbolic dimension's size (seq=128)")
    p.add_argument("--html", default="", help="write the report (with the sweep) here")
    p.add_argument("--server", default=None, help="host:port of a device server")
    args = p.parse_args(argv)

    from tf_ipu.onnx import OnnxError, load
    from tf_ipu.onnx.device import close_all

    sizes = sorted({int(b) for b in args.batch_sizes.split(",") if b.strip()})
    reports, points = [], []
    try:
        for b in sizes:
            m = load(args.model, batch_size=b, input_shapes=_shapes(args.input_shape) or None,
                     precision=args.precision, ipu_version=args.ipu_version, replicas=args.replicas,
                     system=args.system, server=args.server, allow_out_of_memory=True)
            r = m.estimate
            latency = float(r.details.get("latency_s") or r.seconds)
            throughput = b / latency if latency else 0.0
            points.append({"batch_size": b, "latency_s": latency, "throughput": throughput,
                           "fits": r.fits, "peak_tile_bytes": r.peak_tile_bytes, "cycles": r.cycles,
                           "replicas": args.replicas, "all_reduce_share": r.all_reduce_share})
            reports.append(r)
            print(f"batch {b:>5}: {latency * 1e3:9.3f} ms  {throughput:12,.1f} items/s  "
                  f"peak tile {r.peak_tile_bytes:>9,} B of {r.tile_bytes_limit:,} B"
                  f"{'' if r.fits else '  DOES NOT FIT'}")
    except OnnxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        close_all()
    if reports:
        fitting = [r for r, pt in zip(reports, points, strict=True) if pt["fits"]] or reports
        chosen = fitting[-1]
        print(chosen.summary())
        if args.html:
            chosen.details["sweep"] = points
            print(f"report: {chosen.save_html(args.html)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
