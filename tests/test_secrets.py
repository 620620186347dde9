"""Secrets in what the launcher records: which names are secret, and how a command line
is masked (resilient_train/observe/jobdir.py: one function for job.json and the report)."""

from __future__ import annotations

import pytest

from resilient_train.observe.jobdir import SECRET_MASK, is_secret_name, mask_command


@pytest.mark.parametrize("name", [
    "token", "API_KEY", "api-key", "apiKey", "APIKey", "HFToken", "HF_TOKEN", "WANDB_API_KEY",
    "AWS_SECRET_ACCESS_KEY", "RESILIENT_TRAIN_JOB_SECRET", "password", "db.password",
    "DB_PASSWD", "clientSecret", "authtoken", "apikey", "access-key", "pad_token_id",
    "monkey",   # a compound ending in "key": masked, harmlessly
])
def test_secret_names(name: str) -> None:
    assert is_secret_name(name)


@pytest.mark.parametrize("name", [
    "keep-last", "keep_last", "tokenizer", "max_tokens", "max-new-tokens", "keyword",
    "KEYTAB", "PWD", "PATH", "seed", "secretary", "passenger", "lr",
])
def test_names_that_are_not_secret(name: str) -> None:
    assert not is_secret_name(name)


@pytest.mark.parametrize("argv, masked", [
    (["python", "t.py", "--token=abc"], ["python", "t.py", "--token=***"]),
    (["t", "--api-key", "abc", "--lr", "0.1"], ["t", "--api-key", "***", "--lr", "0.1"]),
    (["t", "-password", "abc"], ["t", "-password", "***"]),
    (["t", "--secret="], ["t", "--secret=***"]),
    (["t", "--hf_token", "-dash-start"], ["t", "--hf_token", "***"]),   # a value may start with -
    (["env", "API_KEY=abc", "python", "t.py"], ["env", "API_KEY=***", "python", "t.py"]),
    (["t", "db.password=abc", "+trainer.api_key=x"], ["t", "db.password=***",
                                                      "+trainer.api_key=***"]),
    # A secret option with no value before the next long option, or at the end: nothing to mask.
    (["t", "--token", "--verbose", "--password"], ["t", "--token", "--verbose", "--password"]),
    # Not secrets: left exactly as they were.
    (["t", "--keep-last", "3", "--tokenizer", "gpt2", "--max-tokens=512", "seed=1"],
     ["t", "--keep-last", "3", "--tokenizer", "gpt2", "--max-tokens=512", "seed=1"]),
    (["python", "-c", "token = 'x'; print(token)"], ["python", "-c", "token = 'x'; print(token)"]),
])
def test_mask_command(argv: list[str], masked: list[str]) -> None:
    assert mask_command(argv) == masked
    assert mask_command(masked) == masked   # masking a masked record changes nothing
    assert SECRET_MASK == "***"
