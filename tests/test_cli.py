"""`kvflow generate` / `kvflow chat` through kvflow.cli.main on the tiny llama checkpoint."""
import pytest
import torch

from kvflow.cli import build_parser, main


@pytest.fixture(autouse=True)
def _restore_threads():
    # --num-threads sets torch's thread count process-wide; put it back for later tests.
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def engine(model) -> list[str]:
    return ["--model", model, "--dtype", "float32", "--num-threads", "1", "--max-model-len", "64"]


def test_generate_prints_the_completion(tiny_llama, capsys):
    rc = main(["generate", "hello world", *engine(tiny_llama), "--max-tokens", "5"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert out.endswith("\n") and out.strip("\n")      # some text (random model: any text)
    assert "5 tokens" in err and "tok/s" in err             # the timing report goes to stderr


def test_generate_matches_the_python_api(tiny_llama, capsys):
    from kvflow import LLM, SamplingParams
    llm = LLM(tiny_llama, dtype="float32", num_threads=1, max_model_len=64)
    exp = [o.outputs[0].text for o in llm.generate(
        ["hello world", "The cat sees"], SamplingParams(temperature=0.0, max_tokens=6),
        use_tqdm=False)]
    assert main(["generate", "hello world", "The cat sees", *engine(tiny_llama),
                 "--max-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert out == "".join(t + "\n" for t in exp)            # greedy by default, one per prompt


def test_generate_with_sampling_flags(tiny_llama, capsys):
    args = ["generate", "The cat", *engine(tiny_llama), "--max-tokens", "4",
            "--temperature", "0.8", "--top-p", "0.9", "--top-k", "20", "--stop", "zzz"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0                                   # --seed 0 by default: repeatable
    assert capsys.readouterr().out == first


def test_chat_one_message(tiny_llama, capsys):
    rc = main(["chat", "hi", "there", *engine(tiny_llama), "--max-tokens", "5",
               "--system", "Be brief."])
    out, err = capsys.readouterr()
    assert rc == 0 and out.endswith("\n")
    assert "tok/s" in err


def test_chat_interactive_reads_until_an_empty_line(tiny_llama, capsys, monkeypatch):
    lines = iter(["hi", "and again", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", *engine(tiny_llama), "--max-tokens", "3"]) == 0
    out, err = capsys.readouterr()
    assert out.count("\n") >= 2 and err.count("tok/s") == 2


def test_chat_interactive_stops_on_eof(tiny_llama, capsys, monkeypatch):
    def eof(prompt=""):
        raise EOFError
    monkeypatch.setattr("builtins.input", eof)
    assert main(["chat", *engine(tiny_llama)]) == 0


def test_missing_model_path_is_a_clean_error(tmp_path, capsys):
    missing = str(tmp_path / "no-such-model")
    rc = main(["generate", "hello", "--model", missing, "--max-tokens", "2"])
    out, err = capsys.readouterr()
    assert rc != 0
    assert missing in err and "Traceback" not in err + out
    assert main(["chat", "hi", "--model", missing]) != 0
    assert missing in capsys.readouterr().err


def test_bad_values_are_clean_errors(tiny_llama, capsys):
    assert main(["generate", "hi", *engine(tiny_llama), "--max-tokens", "0"]) != 0
    assert "max_tokens" in capsys.readouterr().err
    assert main(["generate", "hi", *engine(tiny_llama), "--temperature", "-1"]) != 0
    assert "temperature" in capsys.readouterr().err


def test_zero_block_size_is_a_clean_error(tiny_llama, capsys):
    assert main(["generate", "hi", *engine(tiny_llama), "--block-size", "0"]) != 0
    assert "block_size" in capsys.readouterr().err


def test_argparse_errors_exit_with_usage(capsys):
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["generate"])                                  # no prompt
    assert e.value.code == 2 and "usage" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "x", "--dtype", "float64"])


def test_parser_maps_flags_to_engine_args():
    from kvflow.cli import engine_kwargs
    from kvflow.engine.llm_engine import EngineArgs
    args = build_parser().parse_args(["generate", "x", "--no-enable-prefix-caching",
                                      "--block-size", "8", "--policy", "priority"])
    kw = engine_kwargs(args)
    assert set(kw) <= set(EngineArgs.__dataclass_fields__)
    assert kw["enable_prefix_caching"] is False and kw["block_size"] == 8
    assert kw["policy"] == "priority" and kw["enable_chunked_prefill"] is True


def test_simulate_subcommand_is_mounted(tmp_path):
    import json
    assert main(["simulate", "--scenario", "long-short", "--model", "Llama-3-8B", "--gpu",
                 "h100", "--policy", "vllm", "--plots", "", "--output", str(tmp_path)]) in (0, None)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary


def test_every_engine_arg_is_a_flag_with_its_default():
    import dataclasses

    from kvflow.engine.arg_utils import EngineArgs
    for cmd in (["generate", "x"], ["chat"], ["serve"]):
        args = build_parser().parse_args(cmd)
        assert EngineArgs.from_cli_args(args) == EngineArgs()
    args = build_parser().parse_args(["serve", "--watermark", "0.2", "--no-enable-chunked-prefill",
                                      "--num-blocks", "64"])
    got = EngineArgs.from_cli_args(args)
    assert (got.watermark, got.enable_chunked_prefill, got.num_blocks) == (0.2, False, 64)
    flags = build_parser().parse_args(["generate", "x"])
    assert all(hasattr(flags, f.name) for f in dataclasses.fields(EngineArgs))


def test_building_the_command_line_loads_no_torch_and_no_import_circle():
    import subprocess
    import sys
    code = ("import sys\nimport kvflow.server.cli\nassert 'kvflow.cli' not in sys.modules\n"
            "from kvflow.cli import build_parser\nbuild_parser().parse_args(['serve'])\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            # the server's HTTP pieces load on use (kvflow/server/http_common.py)
            "web = {'fastapi', 'starlette', 'pydantic', 'uvicorn', 'httpx'} & set(sys.modules)\n"
            "assert not web, web\n")
    subprocess.run([sys.executable, "-c", code], check=True)
