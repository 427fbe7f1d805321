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


def test_prepare_with_a_mistyped_dataset_is_one_line_with_did_you_mean(capsys):
    """Not argparse's whole usage (#55): one line, the choices, the one it most likely means, status 2."""
    from flaxgpt.data import prepare, prepare_seq2seq

    with pytest.raises(SystemExit) as e:
        prepare.main(["--dataset", "shakespear", "--out_dir", "x"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "usage" not in err
    assert err.startswith("error: --dataset 'shakespear' is not one of shakespeare_char, shakespeare, text")
    assert "; did you mean shakespeare? (see flaxgpt prepare --help)" in err
    with pytest.raises(SystemExit):
        prepare_seq2seq.main(["--task", "revers", "--out_dir", "x"])
    assert "did you mean reverse?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        prepare.main(["--dataset", "shakespeare"])  # other usage errors: one line too
    err = capsys.readouterr().err
    assert err == "error: the following arguments are required: --out_dir (see flaxgpt prepare --help)\n"


def test_a_near_miss_model_name_offline_says_which_it_means(tmp_path, monkeypatch):
    from flaxgpt.hf import files

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConnectionError, match=r"did you mean gpt2-xl\? Else: downloading it needs") as e:
        files.resolve("gpt2-xxl", cache_dir=str(tmp_path))
    assert "\n" not in str(e.value)
    assert files.near_name("gpt2-small") == "did you mean gpt2?"
    assert files.near_name("gpt2-medium") is None and files.near_name("my/own-model") is None


def test_did_you_mean_is_one_lookup_and_one_phrase():
    """The one owner of every did-you-mean (#51): parser choices, config keys, section fields, model names."""
    assert errors.did_you_mean("shakespear", ["shakespeare_char", "shakespeare", "text"]) == (
        "did you mean shakespeare?"
    )
    assert errors.did_you_mean("zzzz", ["shakespeare", "text"]) == ""
    # a mapping suggests what each spelling stands for (a section's field -> its dotted key)
    assert errors.nearest("rnak", {"rank": "lora.rank", "alpha": "lora.alpha"}) == "lora.rank"
    # the cutoff is the caller's: model names ask for a closer match than a choice does
    assert errors.nearest("gpt2-xxxl", ["gpt2-xl"], cutoff=0.6) == "gpt2-xl"
    assert errors.nearest("gpt2-xxxl", ["gpt2-xl"], cutoff=0.9) is None
    assert errors.suggest("gpt2") == "did you mean gpt2?"
