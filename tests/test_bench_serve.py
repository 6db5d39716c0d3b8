"""`kvflow bench serve`: its TTFT / TPOT / ITL / E2EL math on a synthetic timeline, its workloads,
and short runs against a kvflow server (completions and chat)."""
import csv
import json
import math

import numpy as np
import pytest

from kvflow.bench.datasets import (gamma_arrivals, make_prompt, random_lengths, sample_requests,
                                   trace_lengths)
from kvflow.bench.serve import RequestResult, calculate_metrics, result_from_events
from kvflow.cli import main
from kvflow.sim.workload import data_dir
from server_helpers import metric, metrics, running_server



def _completion_events(start, times, texts, usage=None):
    ev = [(t, {"choices": [{"index": 0, "text": x, "finish_reason": None}]})
          for t, x in zip(times, texts)]
    if usage is not None:
        ev.append((times[-1] + 0.5, {"choices": [], "usage": usage}))
    return ev


def test_metrics_on_a_synthetic_timeline():
    # Request A: sent at t=10, chunks at 10.2, 10.3, 10.5, 10.6; 4 tokens (usage); then a usage
    # chunk at 11.1 which must not move the end. TTFT 0.2, ITLs 0.1 0.2 0.1, E2EL 0.6,
    # TPOT (0.6 - 0.2) / 3.
    a = result_from_events(10.0, _completion_events(10.0, [10.2, 10.3, 10.5, 10.6],
                                                    ["a", "b", "c", "d"],
                                                    {"prompt_tokens": 7, "completion_tokens": 4}),
                           prompt_len=5, chat=False)
    assert a.success and a.generated_text == "abcd" and a.prompt_len == 7
    assert a.ttft == pytest.approx(0.2) and a.latency == pytest.approx(0.6)
    assert a.itl == pytest.approx([0.1, 0.2, 0.1])
    assert a.output_tokens == 4
    # Request B (chat): role chunk with the first token at 20.4, then 2 chunks holding 5 more
    # tokens (usage says 6): TTFT 0.4, ITLs 0.3 0.3, E2EL 1.0, TPOT (1.0 - 0.4) / 5.
    b_ev = [(20.4, {"choices": [{"delta": {"role": "assistant", "content": ""}}]}),
            (20.7, {"choices": [{"delta": {"content": "xy"}}]}),
            (21.0, {"choices": [{"delta": {}, "finish_reason": "length"}]}),
            (21.2, {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 6}})]
    b = result_from_events(20.0, b_ev, prompt_len=3, chat=True)
    assert b.ttft == pytest.approx(0.4) and b.latency == pytest.approx(1.0)
    assert b.itl == pytest.approx([0.3, 0.3]) and b.generated_text == "xy"
    failed = RequestResult(success=False, error="HTTP 400")
    m = calculate_metrics([a, b, failed], duration=2.0, percentiles=[50, 99])
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_input_tokens"] == 10 and m["total_output_tokens"] == 10
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(5.0)
    assert m["total_token_throughput"] == pytest.approx(10.0)
    assert m["mean_ttft_ms"] == pytest.approx(300.0)
    assert m["median_ttft_ms"] == pytest.approx(300.0)
    assert m["p99_ttft_ms"] == pytest.approx(200 + 0.99 * 200)
    tpots = [0.4 / 3 * 1000, 0.6 / 5 * 1000]
    assert m["mean_tpot_ms"] == pytest.approx(np.mean(tpots))
    assert m["p99_tpot_ms"] == pytest.approx(np.percentile(tpots, 99))
    itls = [100, 200, 100, 300, 300]
    assert m["mean_itl_ms"] == pytest.approx(200.0)
    assert m["median_itl_ms"] == pytest.approx(200.0)
    assert m["p50_itl_ms"] == pytest.approx(np.percentile(itls, 50))
    assert m["std_itl_ms"] == pytest.approx(np.std(itls))
    assert m["mean_e2el_ms"] == pytest.approx(800.0)
    assert m["p99_e2el_ms"] == pytest.approx(600 + 0.99 * 400)


def test_metrics_without_usage_and_single_token():
    # No usage from the server: the text is re-tokenized (here: a 1-token-per-char stand-in).
    class CharTok:
        def encode(self, s, add_special_tokens=False):
            return list(s)
    r = result_from_events(0.0, _completion_events(0.0, [0.1, 0.2, 0.4], ["ab", "c", ""]), 2,
                           chat=False)
    m = calculate_metrics([r], 1.0, [99], tokenizer=CharTok())
    assert m["total_output_tokens"] == 3
    assert m["mean_tpot_ms"] == pytest.approx((0.4 - 0.1) / 2 * 1000)
    # a one-token answer has a TTFT but no TPOT (as in vLLM)
    one = result_from_events(0.0, _completion_events(0.0, [0.3], ["x"], {"completion_tokens": 1}),
                             2, chat=False)
    m = calculate_metrics([one], 1.0, [99])
    assert m["mean_ttft_ms"] == pytest.approx(300) and m["mean_tpot_ms"] == 0
    # no chunk with choices, or an error event: a failed request
    assert not result_from_events(0.0, [], 2, chat=False).success
    err = result_from_events(0.0, [(0.1, {"error": {"message": "boom"}})], 2, chat=False)
    assert not err.success and "boom" in err.error


def test_arrivals_and_lengths():
    rng = np.random.default_rng(0)
    assert gamma_arrivals(5, math.inf, 1.0, rng).tolist() == [0.0] * 5
    arr = gamma_arrivals(4001, 4.0, 1.0, rng)
    assert arr[0] == 0 and np.all(np.diff(arr) >= 0)
    assert arr[-1] / 4000 == pytest.approx(0.25, rel=0.1)          # mean gap 1 / rate
    bursty = np.diff(gamma_arrivals(4001, 4.0, 0.25, rng))
    assert np.std(bursty) > 1.5 * np.std(np.diff(arr))             # shape < 1: burstier
    lens = random_lengths(1000, 100, 0.5, rng)
    assert lens.min() >= 50 and lens.max() <= 150 and len(set(lens.tolist())) > 50
    assert random_lengths(3, 100, 0.0, rng).tolist() == [100, 100, 100]


def test_azure_trace_scaled_to_max_model_len():
    with open(data_dir() / "splitwise_conv.csv") as f:
        rows = list(csv.DictReader(f))[:50]
    arr, prompt, out, scale = trace_lengths("azure-conv", 50, 256, None)
    assert 0 < scale < 1
    assert np.all(prompt + out <= 255) and prompt.min() >= 1 and out.min() >= 1
    t0 = float(rows[0]["arrived_at"])
    assert arr.tolist() == pytest.approx([float(r["arrived_at"]) - t0 for r in rows])
    longest = max(int(r["num_prefill_tokens"]) + int(r["num_decode_tokens"]) for r in rows)
    assert int((prompt + out).max()) >= round(longest * scale) - 2     # scaled, not clipped
    _, p1, _, s1 = trace_lengths("azure-code", 20, 100_000, 0.5)
    assert s1 == 0.5


def test_prompts_have_the_requested_length(tiny_tokenizer_dir):
    from tokenizers import Tokenizer as HF

    from kvflow.engine.tokenizer import Tokenizer
    tok = Tokenizer(HF.from_file(f"{tiny_tokenizer_dir}/tokenizer.json"))
    rng = np.random.default_rng(1)
    lens = [make_prompt(tok, n, rng)[1] for n in (5, 17, 64, 128)]
    assert all(abs(got - want) <= 2 for got, want in zip(lens, (5, 17, 64, 128))), lens
    reqs, info = sample_requests(tok, "random", 6, input_len=20, output_len=7,
                                 request_rate=2.0, seed=3)
    assert [r.expected_output_len for r in reqs] == [7] * 6
    assert reqs[0].arrival == 0 and all(b.arrival >= a.arrival for a, b in zip(reqs, reqs[1:]))
    again, _ = sample_requests(tok, "random", 6, input_len=20, output_len=7, request_rate=2.0,
                               seed=3)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]       # seeded
    with pytest.raises(ValueError, match="trace"):
        sample_requests(tok, "random", 2, request_rate="trace")


def test_trace_prompts_follow_the_trace(tiny_tokenizer_dir):
    from tokenizers import Tokenizer as HF

    from kvflow.engine.tokenizer import Tokenizer
    tok = Tokenizer(HF.from_file(f"{tiny_tokenizer_dir}/tokenizer.json"))
    arr, p, o, _ = trace_lengths("azure-conv", 5, 256, None)
    reqs, info = sample_requests(tok, "azure-conv", 5, request_rate="trace", max_model_len=256)
    assert [r.arrival for r in reqs] == pytest.approx(arr.tolist())
    assert [r.expected_output_len for r in reqs] == o.tolist()
    assert all(abs(r.prompt_len - n) <= 2 for r, n in zip(reqs, p.tolist()))
    assert info["length_scale"] < 1


@pytest.fixture(scope="module")
def server(tiny_llama):
    with running_server(tiny_llama, api_key="bench-key") as s:
        yield s


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_bench_serve_against_kvflow(server, tiny_llama, tmp_path, capsys, backend):
    before = metrics(server.url, server.api_key)
    out = tmp_path / "result.json"
    n, out_len = 12, 8
    rc = main(["bench", "serve", "--base-url", server.url, "--backend", backend,
               "--tokenizer", tiny_llama, "--api-key", "bench-key", "--dataset-name", "random",
               "--num-prompts", str(n), "--random-input-len", "16", "--random-output-len",
               str(out_len), "--request-rate", "50", "--max-concurrency", "4", "--ignore-eos",
               "--result-file", str(out), "--save-detailed"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "P99 TTFT (ms):" in printed
    r = json.loads(out.read_text())
    assert r["completed"] == n and r["failed"] == 0 and r["model"] == "tiny"
    assert r["total_output_tokens"] == n * out_len              # ignore_eos: exactly max_tokens
    assert r["output_lens"] == [out_len] * n
    assert r["max_concurrency"] == 4 and r["request_rate"] == 50
    for k in ("ttft", "e2el"):
        assert 0 < r[f"median_{k}_ms"] <= r[f"p99_{k}_ms"]
    # A stream hands over the latest output when its reader lags (as vLLM's does), so several
    # tokens can arrive in one chunk: per-token gaps may be 0, and a request may have no ITL.
    for k in ("tpot", "itl"):
        assert 0 <= r[f"median_{k}_ms"] <= r[f"p99_{k}_ms"]
    # Timing-independent: each request's first-token time plus its inter-chunk gaps is its
    # end-to-end latency, and it got at least one chunk and at most one per token (chat: plus the
    # role chunk before the first token, so up to out_len gaps).
    max_chunks = out_len + (backend == "openai-chat")
    for ttft, itl, e2el in zip(r["ttfts"], r["itls"], r["e2els"]):
        assert ttft > 0 and all(x >= 0 for x in itl) and len(itl) < max_chunks
        assert ttft + sum(itl) == pytest.approx(e2el)
    assert r["mean_e2el_ms"] >= r["mean_ttft_ms"]
    assert r["output_throughput"] == pytest.approx(n * out_len / r["duration"])
    # the server saw the same traffic: n requests + 1 warm-up of min(out_len, 4) tokens
    after = metrics(server.url, server.api_key)
    gen = metric(after, "vllm:generation_tokens_total") - metric(
        before, "vllm:generation_tokens_total")
    assert gen == n * out_len + 4
    prompt = metric(after, "vllm:prompt_tokens_total") - metric(before, "vllm:prompt_tokens_total")
    assert prompt == r["total_input_tokens"] + r["input_lens"][0]
    done = metric(after, "vllm:request_success_total", finished_reason="length") - metric(
        before, "vllm:request_success_total", finished_reason="length")
    assert done == n + 1


def test_bench_serve_reports_a_wrong_key(server, tiny_llama, capsys):
    rc = main(["bench", "serve", "--base-url", server.url, "--model", "tiny", "--max-model-len",
               "256", "--tokenizer", tiny_llama, "--api-key", "wrong", "--num-prompts", "2",
               "--random-input-len", "8", "--random-output-len", "2"])
    assert rc == 2
    assert "initial test request failed: HTTP 401" in capsys.readouterr().err


def test_bench_serve_azure_trace_lengths(server, tiny_llama, tmp_path):
    out = tmp_path / "azure.json"
    rc = main(["bench", "serve", "--base-url", server.url, "--tokenizer", tiny_llama,
               "--api-key", "bench-key", "--dataset-name", "azure-code", "--num-prompts", "6",
               "--request-rate", "inf", "--ignore-eos", "--no-warmup", "--result-file", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    _, _, out_lens, scale = trace_lengths("azure-code", 6, 256, None)   # 256: from /v1/models
    assert r["completed"] == 6 and r["length_scale"] == pytest.approx(scale)
    assert r["total_output_tokens"] == int(out_lens.sum())
