"""flaxgpt.errors.run_cli: the one wrapper that turns a command's bad input into one line and status 1."""

import pytest

from flaxgpt import errors


def test_bad_input_is_one_line_and_status_1(capsys):
    def main(argv):
        raise ValueError(f"--n {argv[0]} must be >= 1")

    assert errors.run_cli(main, ["-2"]) == 1
    assert capsys.readouterr().err == "error: --n -2 must be >= 1\n"
    assert errors.run_cli(lambda _: open("/no/such/file"), None) == 1
    assert capsys.readouterr().err.startswith("error: [Errno 2] No such file or directory")


def test_status_and_results_pass_through():
    assert errors.run_cli(lambda argv: 3, []) == 3
    assert errors.run_cli(lambda argv: {"loss": 1.0}, []) == 0  # a result means success
    assert errors.run_cli(lambda argv: None) == 0


def test_only_the_commands_errors_are_caught(capsys):
    class PrepareError(Exception):
        pass

    def prepare(argv):
        raise PrepareError("no input")

    assert errors.run_cli(prepare, errors=(PrepareError,)) == 1
    assert capsys.readouterr().err == "error: no input\n"
    with pytest.raises(ValueError):  # not this command's: a bug keeps its traceback
        errors.run_cli(lambda _: int("x"), errors=(PrepareError,))
    assert errors.run_cli(prepare, errors=(PrepareError,), describe=lambda e: f"prepare: {e}") == 1
    assert capsys.readouterr().err == "error: prepare: no input\n"
