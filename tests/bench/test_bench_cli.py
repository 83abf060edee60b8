"""`pdserve bench` argument errors and an unreachable gateway: one line on stderr, exit code 2, no traceback."""
from __future__ import annotations

import socket

import pytest

from pdserve.cli import main


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as stop:  # argparse-detected errors leave through sys.exit
        return int(stop.code)


def _assert_one_line_error(capsys, fragment: str) -> None:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("pdserve bench: error:") and fragment in lines[0]
    assert "Traceback" not in err


@pytest.mark.parametrize("argv, fragment", [
    (["--num-prompts", "0"], "--num-prompts"),
    (["--range-ratio", "1.5"], "--range-ratio"),
    (["--request-rate", "0"], "--request-rate"),
    (["--request-rate", "fast"], "--request-rate"),
    (["--burstiness", "inf"], "--burstiness"),
    (["--max-concurrency", "-1"], "--max-concurrency"),
    (["--concurrency-sweep", "1,x"], "--concurrency-sweep"),
    (["--concurrency-sweep", "1,4", "--max-concurrency", "2"], "not allowed with"),
    (["--slo", "ttft=5"], "--slo"),
    (["--slo", "ttft_ms=-5"], "positive"),
    (["--gpus", "0"], "--gpus"),
    (["--gpu-price", "-2.5"], "--gpu-price"),
    (["--temperature", "-1"], "--temperature"),
    (["--stream-interval", "0"], "--stream-interval"),
    (["--backend", "openai", "--stream-interval", "4"], "gRPC-only"),
    (["--dataset", "/nonexistent/prompts.jsonl"], "no such file"),
    (["--plot", "out.svg"], ".png"),
    (["--bogus-option", "3"], "unrecognized arguments: --bogus-option 3"),
])
def test_bad_arguments_exit_2_with_one_line(capsys, argv, fragment):
    """Every invalid value is reported on one stderr line naming the option, with exit code 2."""
    assert _exit_code(["bench", "--gateway", "127.0.0.1:1", *argv]) == 2
    _assert_one_line_error(capsys, fragment)


def test_bad_dataset_contents_exit_2(tmp_path, capsys):
    """A malformed JSONL file is an argument error too (after the gateway answered or not: checked first)."""
    path = tmp_path / "bad.jsonl"
    path.write_text("{oops\n")
    free = _free_port()
    assert _exit_code(["bench", "--gateway", f"127.0.0.1:{free}", "--dataset", str(path),
                       "--connect-timeout", "0.3"]) == 2
    _assert_one_line_error(capsys, "")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_unreachable_gateway_exit_2_quickly(capsys):
    """Nothing listening: a one-line 'no gateway answered' error within the connect timeout."""
    port = _free_port()
    assert _exit_code(["bench", "--gateway", f"127.0.0.1:{port}", "--connect-timeout", "0.5"]) == 2
    _assert_one_line_error(capsys, f"no gateway answered at 127.0.0.1:{port}")
