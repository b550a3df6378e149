"""Run one ``vidsparse.bench`` command with VSA's gate handed to the op as a tensor, as it was
before the gate went as a ``GateProjection`` (the op then keeps the gate for the backward):
the other arm of the projection's A/B, in the same session::

    PYTHONPATH=src python benchmarks/tuning/bench_gate_tensor.py -- \\
        e2e --train --compile blocks --methods vsa --vsa-sparsities 0.875 \\
        --out out/e2e_train_compiled_gate_tensor.json

``VSAGate.projection`` answers None, which is what it answers for a hooked module: the
integration then calls the gate module and passes its output. The JSON the command writes
(its ``--out``) records ``gate_as: "tensor"`` in its ``meta``.
"""

from __future__ import annotations

import sys

from bench_with_override import record_in_meta


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise SystemExit(__doc__)
    command = argv[argv.index("--") + 1 :]
    from vidsparse.bench.runner import main as bench_main
    from vidsparse.nn import VSAGate

    VSAGate.projection = lambda self, hidden_states, dtype: None
    print("VSAGate.projection -> None: the gate goes to the op as a tensor", flush=True)
    code = bench_main(command)
    record_in_meta(command, "gate_as", "tensor")
    return code


if __name__ == "__main__":
    sys.exit(main())
