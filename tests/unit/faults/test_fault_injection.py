"""The test-only fault injection (tests/faults/) reaches a fresh ``python`` process and patches a
module when it is imported, not before."""

import subprocess
import sys

from tests.conftest import ENV, ROOT, fault_env


def test_a_fault_patches_its_module_on_import_in_a_subprocess():
    code = (
        "import sys; assert 'rlhf.errors' not in sys.modules; import rlhf.errors as e; "
        "print(e.INJECTED)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**ENV, **fault_env("selftest", "hello")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "hello"
