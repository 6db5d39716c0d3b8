"""The README's scheduler example runs and says what the README claims it says."""
import re
from pathlib import Path


def test_readme_example_runs_as_described(capsys):
    text = (Path(__file__).parent.parent / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "{'a': 32} {'a': [0, 1]}"
    # b's first 32 tokens hit a's two cached blocks: only 8 tokens left to compute.
    assert lines[1] == "{'a': 8, 'b': 8} {'a': [0, 1, 2], 'b': [0, 1, 3]}"
    assert lines[-2:] == ["a finished: length", "b finished: length"]
