"""Secrets in what the launcher records: which names are secret, and how a command line
is masked (resilient_train/observe/jobdir.py: one function for job.json and the report),
shell strings, URLs' passwords and programs' -p included."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from resilient_train.observe.jobdir import SECRET_MASK, is_secret_name, mask_command


@pytest.mark.parametrize("name", [
    "token", "API_KEY", "api-key", "apiKey", "APIKey", "HFToken", "HF_TOKEN", "WANDB_API_KEY",
    "AWS_SECRET_ACCESS_KEY", "RESILIENT_TRAIN_JOB_SECRET", "password", "db.password",
    "DB_PASSWD", "clientSecret", "authtoken", "apikey", "access-key", "pad_token_id",
    "auth", "basic-auth", "OAUTH",
    "monkey",   # a compound ending in "key": masked, harmlessly
])
def test_secret_names(name: str) -> None:
    assert is_secret_name(name)


@pytest.mark.parametrize("name", [
    "keep-last", "keep_last", "tokenizer", "max_tokens", "max-new-tokens", "keyword",
    "KEYTAB", "PWD", "PATH", "seed", "secretary", "passenger", "lr", "author", "authority",
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


@pytest.mark.parametrize("argv, masked", [
    # Inside a shell string: the same rule for its words, the rest of it kept as written.
    (["bash", "-c", "python t.py --token=abc && echo done"],
     ["bash", "-c", "python t.py --token=*** && echo done"]),
    (["sh", "-c", "cd /app && HF_TOKEN=abc python t.py --api-key 'a b' --lr 1"],
     ["sh", "-c", "cd /app && HF_TOKEN=*** python t.py --api-key *** --lr 1"]),
    # A whole argument that is a secret assignment is its value, spaces and all.
    (["env", "API_KEY=a b", "t"], ["env", "API_KEY=***", "t"]),
    (["bash", "-c", "sh -c 'python t.py --password=\"p w\"'"],      # a string in a string
     ["bash", "-c", "sh -c 'python t.py --password=***'"]),
    # --auth is a secret name too.
    (["t", "--auth=user:pw", "--basic-auth", "pw"], ["t", "--auth=***", "--basic-auth", "***"]),
    # A URL's password, wherever it is; a secret in its query.
    (["git", "clone", "https://oauth2:glpat-123@gitlab.com/r.git"],
     ["git", "clone", "https://oauth2:***@gitlab.com/r.git"]),
    (["t", "--db=postgres://me:pw@db:5432/x", "DATABASE_URL=mysql://me:pw@h/db"],
     ["t", "--db=postgres://me:***@db:5432/x", "DATABASE_URL=mysql://me:***@h/db"]),
    (["bash", "-c", "pip install git+https://me:pw@host/r.git && python t.py"],
     ["bash", "-c", "pip install git+https://me:***@host/r.git && python t.py"]),
    (["t", "--data", "https://h/x?access_token=abc&page=2"],
     ["t", "--data", "https://h/x?access_token=***&page=2"]),
    # -p where the program takes its password so: separate or attached.
    (["mysql", "-u", "root", "-p", "pw", "db"], ["mysql", "-u", "root", "-p", "***", "db"]),
    (["/usr/bin/mysqldump", "-ppw", "db"], ["/usr/bin/mysqldump", "-p***", "db"]),
    (["bash", "-c", "sshpass -p pw rsync -a src h:dst; mkdir -p out"],
     ["bash", "-c", "sshpass -p *** rsync -a src h:dst; mkdir -p out"]),
    (["env", "X=1", "redis-cli", "-a", "pw", "ping"], ["env", "X=1", "redis-cli", "-a", "***",
                                                     "ping"]),
])
def test_mask_command_inside_strings_urls_and_password_flags(argv: list[str],
                                                             masked: list[str]) -> None:
    assert mask_command(argv) == masked
    assert mask_command(masked) == masked


@pytest.mark.parametrize("argv", [
    # -p elsewhere: mkdir's parents, ssh's port, a script's print frequency.
    ["bash", "-c", "mkdir -p out && python t.py -p 10"],
    ["ssh", "-p", "2222", "host"],
    ["python", "main.py", "-p", "10", "--url", "https://host/x?page=2"],
    ["git", "clone", "https://me@host/r.git"],          # a user, no password
    ["bash", "-c", "echo 'a  b' \"c\" | tr a b > out.txt"],
    ["t", "--author", "me"],
])
def test_what_is_not_a_secret_is_left_exactly_as_written(argv: list[str]) -> None:
    assert mask_command(argv) == argv


def test_an_env_value_is_masked_by_its_name_or_a_urls_password() -> None:
    from resilient_train.observe.jobdir import mask_env

    assert mask_env({"HF_TOKEN": "hf-1", "DATABASE_URL": "postgres://me:pw@h/db",
                     "MODE": "fast"}) == {
        "HF_TOKEN": "***", "DATABASE_URL": "postgres://me:***@h/db", "MODE": "fast"}


SECRETS = ("TOK1", "PW1", "PW2", "AUTH1", "PW3", "PW4")


def test_job_json_holds_none_of_a_commands_secrets(tmp_path: Path) -> None:
    """What the issue found verbatim in job.json, through a real launch."""
    job_dir = tmp_path / "job"
    command = ["bash", "-c", "exit 0  # python t.py --token=TOK1 https://me:PW1@h; mysql -pPW2",
               "bash", "--auth=AUTH1", "DATABASE_URL=postgres://me:PW3@h/db", "sshpass", "-p",
               "PW4"]
    done = subprocess.run([sys.executable, "-m", "resilient_train.cli.main", "launch", "--job-dir",
                           str(job_dir), "--quiet", "--", *command],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    text = (job_dir / "job.json").read_text(encoding="utf-8")
    assert not [s for s in SECRETS if s in text]
    recorded = json.loads(text)["job_spec"]
    assert recorded["command"] == [
        "bash", "-c", "exit 0  # python t.py --token=*** https://me:***@h; mysql -p***",
        "bash", "--auth=***", "DATABASE_URL=postgres://me:***@h/db", "sshpass", "-p", "***"]
    assert recorded["platform"]["pools"][0]["command"] == recorded["command"]
    # Exported, the stars would be the platform's command: refused, as for any masked one.
    export = subprocess.run([sys.executable, "-m", "resilient_train.cli.main", "export",
                             "--from-job", str(job_dir), "--image", "local/x:1"],
                            capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert export.returncode == 2, export.stdout + export.stderr
    assert "masks secrets (workerpool0 command)" in export.stderr
