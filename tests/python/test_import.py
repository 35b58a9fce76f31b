"""Importing moka in a fresh interpreter, before anything imports torch."""
import os
import subprocess
import sys


def test_moka_imports_first_in_a_fresh_interpreter():
    # The extension and torch share libnccl.so.2: whichever loads first decides which copy both get.
    code = "import moka.torch, torch; moka.torch.MoE(8, 4, 2, 1)(torch.randn(2, 8)); print('ok')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env=os.environ.copy())
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
