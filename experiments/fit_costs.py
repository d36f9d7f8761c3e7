"""The command of `twell_jax.bench.fit_costs` (its docstring says what it fits and how to run it)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
from twell_jax.bench.fit_costs import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
