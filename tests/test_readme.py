"""The README's examples run and say what the README claims they say."""
import re
from pathlib import Path


def test_readme_example_runs_as_described(capsys):
    text = (Path(__file__).parent.parent / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    code = next(b for b in blocks if "Scheduler(" in b)
    exec(compile(code, "README.md", "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "{'a': 32} {'a': [0, 1]}"
    # b's first 32 tokens hit a's two cached blocks: only 8 tokens left to compute.
    assert lines[1] == "{'a': 8, 'b': 8} {'a': [0, 1, 2], 'b': [0, 1, 3]}"
    assert lines[-2:] == ["a finished: length", "b finished: length"]


def test_readme_offline_example_runs(monkeypatch, tiny_llama, capsys):
    # The offline example with a tiny checkpoint in place of the default model.
    import kvflow
    text = (Path(__file__).parent.parent / "README.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "LLM(" in b)
    real = kvflow.LLM
    monkeypatch.setattr(kvflow, "LLM", lambda *a, **k: real(tiny_llama))
    exec(compile(code, "README.md", "exec"), {})
    assert capsys.readouterr().out.strip()
