"""bench/python_overhead.py --smoke: the measurements a GPU run reports (host time, a stack of
layers, compiled against eager) run on the CPU backend and print well-formed JSON lines."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "python_overhead.py"


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "overhead.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(BENCH), "--smoke", "--out", str(out)], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    printed = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert printed == [json.loads(line) for line in out.read_text().splitlines()]
    return {row["measure"]: row for row in printed}


def positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_every_measurement_of_the_smoke_run_reports_without_error(rows):
    assert set(rows) == {"host", "host_per_layer", "stack", "compile_op", "compile_block", "parts"}
    for row in rows.values():
        assert "error" not in row, row
        assert row["device"] == "cpu" and row["shape"] == "tiny"


def test_the_stack_reports_its_depth_times_and_ratios(rows):
    stack = rows["stack"]
    assert (stack["depth"], stack["tokens_per_rank"], stack["runs"]) == (4, 64, 2)
    assert len(stack["stack_runs_ms"]) == len(stack["layer_runs_ms"]) == 2
    assert all(positive(stack[key]) for key in ("stack_fwdbwd_ms", "layer_fwdbwd_ms", "stack_over_depth_layers"))
    # One entry per layer; the busiest expert has at least the mean of the routes.
    assert len(stack["routes_max_over_mean"]) == 4 and all(r >= 1 for r in stack["routes_max_over_mean"])
    assert "stack_over_depth_cpp" not in stack  # the C++ comparison needs --moka on a GPU


def test_the_compiled_runs_report_beside_eager(rows):
    op, block = rows["compile_op"], rows["compile_block"]
    for row in (op, block):
        assert row["backend"] == "aot_eager"
        assert positive(row["compiled_over_eager"])
    assert all(positive(op[key]) for key in ("eager_fwdbwd_ms", "compiled_fwdbwd_ms", "experts_compiled_over_eager"))
    assert (block["tokens_per_rank"], block["seq"]) == (64, 8)
    assert positive(block["eager_step_ms"]) and positive(block["compiled_step_ms"]) and positive(block["compile_s"])
    # On the CPU the compiled block computes the same bits as eager.
    assert block["first_output_max_abs_diff"] == 0.0


def test_the_parts_report_the_module_beside_the_experts_and_the_routing(rows):
    parts = rows["parts"]
    for step in ("module", "experts_uniform", "experts_routed", "route"):
        assert positive(parts[f"{step}_fwdbwd_ms"]), step
    assert positive(parts["module_over_experts"])
    assert parts["routed_max_over_mean"] >= 1 and parts["uniform_max_over_mean"] >= 1
