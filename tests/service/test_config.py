"""kvstore-server's settings as an operator gives them: flags over KVSTORE_*
variables over a TOML config file over defaults; a bad file is one line and
exit 2; every flag documented in docs/operations.md; --version; human byte
sizes; JSON log lines."""
import io
import json
import logging
import os
import re
import subprocess
import sys

import pytest

from kvstore.service import buildinfo, cli, logs, settings

from helpers import ROOT


def parse(argv: list[str], environ: dict | None = None, config: str | None = None, tmp_path=None):
    if config is not None:
        path = tmp_path / "kvstore.toml"
        path.write_text(config)
        argv = ["--config", str(path), *argv]
    p = cli.parser()
    settings.apply(p, argv, environ or {})
    return p.parse_args(argv)


def test_flags_over_environment_over_file_over_defaults(tmp_path):
    toml = 'workers = 3\nmax-pool-bytes = "1GiB"\nlog_level = "debug"\nno-doorbell = true\nredis-timeout = 1\n'
    a = parse([], config=toml, tmp_path=tmp_path)
    assert (a.workers, a.max_pool_bytes, a.log_level, a.no_doorbell, a.redis_timeout) == (3, 2**30, "DEBUG", True, 1.0)
    assert a.max_streams == cli.DEFAULT_MAX_STREAMS                      # not in the file: the default
    env = {"KVSTORE_WORKERS": "5", "KVSTORE_NO_DOORBELL": "false", "KVSTORE_MAX_POOL_BYTES": "512MB"}
    a = parse([], env, config=toml, tmp_path=tmp_path)
    assert (a.workers, a.no_doorbell, a.max_pool_bytes, a.log_level) == (5, False, 512 * 10**6, "DEBUG")
    a = parse(["--workers", "7", "--max-pool-bytes", "40GiB"], env, config=toml, tmp_path=tmp_path)
    assert (a.workers, a.max_pool_bytes) == (7, 40 * 2**30)


def test_a_switch_in_the_file_takes_what_the_environment_takes(tmp_path):
    for value, want in (("true", True), ("1", True), ('"yes"', True), ('"on"', True),
                        ("false", False), ("0", False), ('"no"', False), ('"off"', False)):
        assert parse([], config=f"lmdb-sync = {value}\n", tmp_path=tmp_path).lmdb_sync is want, value


def test_config_path_from_the_environment(tmp_path):
    path = tmp_path / "k.toml"
    path.write_text("lease-timeout = 4.5\n")
    assert parse([], {"KVSTORE_CONFIG": str(path)}).lease_timeout == 4.5


def run_server(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(ROOT, "server.py"), *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("toml, fragment", [
    ('sockett = "/tmp/x.sock"\n', "unknown key 'sockett'"),
    ("[server]\nport = 1\n", "unknown key 'server'"),
    ('port = "eighty"\n', "port: invalid int value: 'eighty'"),
    ("no-doorbell = 2\n", "no-doorbell: expected a switch value: true/1/yes/on or false/0/no/off, got 2"),
    ('lmdb-sync = "maybe"\n', "lmdb-sync: expected a switch value: true/1/yes/on or false/0/no/off, got 'maybe'"),
    ('log-format = "xml"\n', "log-format: 'xml' is not one of text, json"),
    ('max-pool-bytes = "lots"\n', "max-pool-bytes: not a byte size: 'lots'"),
    ("port = \n", "not TOML"),
])
def test_a_bad_config_file_is_one_line_naming_the_key(tmp_path, toml, fragment):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    r = run_server("--config", str(path), "--socket", str(tmp_path / "kv.sock"))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"kvstore-server: error: --config {path}") and fragment in lines[0], lines[0]
    assert not os.path.exists(tmp_path / "kv.sock")


def test_a_bad_environment_value_names_the_variable(tmp_path):
    r = run_server("--socket", str(tmp_path / "kv.sock"), env={"KVSTORE_WORKERS": "many"})
    assert r.returncode == 2 and "KVSTORE_WORKERS: invalid int value: 'many'" in r.stderr, r.stderr


def test_every_flag_is_documented_in_operations_md():
    doc = open(os.path.join(ROOT, "docs", "operations.md")).read()
    assert cli.flags_markdown() in doc, "docs/operations.md's settings table is stale: " \
                                        "python -m kvstore.service.cli prints the current one"
    for key in settings.settings(cli.parser()):
        assert f"`--{key}" in doc and f"`{settings.env_name(key)}`" in doc, key


def test_version_of_both_commands():
    want = re.compile(rf"^kvstore-(server|admin) {re.escape(buildinfo.version())} \(commit [0-9a-f]{{12}}(\+dirty)?\)$"
                      if buildinfo.commit() else rf"^kvstore-(server|admin) {re.escape(buildinfo.version())} ")
    for cmd in ([os.path.join(ROOT, "server.py")], ["-m", "kvstore.tools.admin"]):
        r = subprocess.run([sys.executable, *cmd, "--version"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and want.match(r.stdout.strip()), r.stdout + r.stderr


def test_max_pool_bytes_takes_human_sizes():
    assert parse(["--max-pool-bytes", "1.5GiB"]).max_pool_bytes == 3 * 2**29
    assert parse(["--max-pool-bytes", "1073741824"]).max_pool_bytes == 2**30


def test_json_logs_are_one_object_per_line():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter())
    log = logging.getLogger("kvstore.test.json")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("two\nlines and a \"quote\"")
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed")
    finally:
        log.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    first, second = map(json.loads, lines)
    assert (first["level"], first["logger"], first["message"]) == ("WARNING", "kvstore.test.json",
                                                                  "two\nlines and a \"quote\"")
    assert first["time"].endswith("+00:00")
    assert second["message"] == "failed" and "ValueError: boom" in second["exception"]


def test_setup_takes_levels_in_any_case():
    root = logging.getLogger()
    saved = root.level, list(root.handlers)
    try:
        logs.setup("warning", "json")
        assert root.level == logging.WARNING and isinstance(root.handlers[0].formatter, logs.JsonFormatter)
    finally:
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]


def test_kvstore_socket_as_a_target_is_the_daemons_path_too():
    """KVSTORE_SOCKET=unix:///path names /path for the daemon as for its clients
    (argparse applies a flag's type to an environment default as to the flag)."""
    assert parse([], {"KVSTORE_SOCKET": "unix:///tmp/x/kv.sock"}).socket == "/tmp/x/kv.sock"
    assert parse(["--socket", "unix:///tmp/y.sock"]).socket == "/tmp/y.sock"
    assert parse([], {"KVSTORE_SOCKET": "/tmp/z.sock"}).socket == "/tmp/z.sock"
