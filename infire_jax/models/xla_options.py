"""XLA options of the programs that run once over every weight at load (a `dummy:` model's draw, the
CPU panels' repacking).

They are compiled at XLA's default LLVM optimization (-O2) even where XLA_FLAGS lowers it
(`--xla_backend_optimization_level=0` compiles a start's many step programs faster, and the test suite
sets it): each is a small program, quick to compile either way, that runs over hundreds of megabytes,
and at -O0 a 135M model's draw took 6.5 s longer (docs/PERFORMANCE.md).
"""

from __future__ import annotations

ONCE_OVER_WEIGHTS = {"xla_backend_optimization_level": 2}
