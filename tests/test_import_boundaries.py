"""The core is pure Python: importing it (and kvflow's top level) must not load torch."""
import subprocess
import sys


def test_core_does_not_import_torch():
    code = ("import sys, kvflow, kvflow.core; from kvflow import SamplingParams; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_lazy_top_level_names_resolve():
    import kvflow
    from kvflow.engine import LLM
    assert kvflow.LLM is LLM
