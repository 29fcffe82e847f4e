"""Where kvstore-server's settings come from, highest first: command-line
flags, environment variables (KVSTORE_<FLAG>, e.g. KVSTORE_MAX_POOL_BYTES),
a TOML config file (--config PATH or KVSTORE_CONFIG), the defaults.

A config file is one flat table whose keys are the flags' names without the
dashes (`max-pool-bytes = "40GiB"`; `max_pool_bytes` is read too). Values
are TOML strings, integers, floats or booleans (switches such as
`no-doorbell` take true/false); each goes through the flag's own parser, so
it takes exactly what the flag takes. An unknown key or a value of the wrong
kind is one line on stderr and exit status 2, before anything starts.

The layers are applied as argparse defaults, so a flag given on the command
line wins, and every value, whichever layer it came from, then passes the
same checks (cli.check_args)."""
from __future__ import annotations

import argparse
import os
import tomllib

ENV_PREFIX = "KVSTORE_"
CONFIG_ENV = "KVSTORE_CONFIG"
# Not settings: how to read the others, or what to print instead of starting.
NOT_SETTINGS = ("help", "version", "config")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def settings(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Config-file key (the long flag without its dashes) -> its action."""
    return {a.option_strings[-1][2:]: a for a in p._actions
            if a.option_strings and a.dest not in NOT_SETTINGS}


def env_name(key: str) -> str:
    return ENV_PREFIX + key.upper().replace("-", "_")


def is_switch(action: argparse.Action) -> bool:
    return isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))


def _convert(action: argparse.Action, value, where: str):
    """A value from a file or the environment, as the flag would parse it.
    ValueError (saying where) if it does not fit."""
    if is_switch(action):
        if isinstance(value, str):
            low = value.strip().lower()
            if low in _TRUE + _FALSE:
                value = low in _TRUE
        elif type(value) is int and value in (0, 1):     # as "1" / "0" from the environment
            value = bool(value)
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected a switch value: true/1/yes/on or false/0/no/off, got {value!r}")
        return value if isinstance(action, argparse._StoreTrueAction) else not value
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"{where}: expected a value for {action.option_strings[-1]}, got {value!r}")
    if action.type is None:
        if not isinstance(value, str):
            raise ValueError(f"{where}: expected a string, got {value!r}")
    else:
        try:
            value = action.type(value if isinstance(value, str) else str(value))
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"{where}: {e}") from None
        except (TypeError, ValueError):     # worded as argparse words it for the flag
            name = getattr(action.type, "__name__", repr(action.type))
            raise ValueError(f"{where}: invalid {name} value: {value!r}") from None
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{where}: {value!r} is not one of {', '.join(map(str, action.choices))}")
    return value


def load_file(p: argparse.ArgumentParser, path: str) -> dict[str, object]:
    """A config file -> {dest: value}. ValueError naming the file and key."""
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--config {path}: not TOML: {e}") from None
    known = settings(p)
    out = {}
    for key, value in table.items():
        action = known.get(key.replace("_", "-"))
        if action is None:
            raise ValueError(f"--config {path}: unknown key {key!r} (keys are kvstore-server's flags without "
                             "the dashes; docs/operations.md lists them)")
        out[action.dest] = _convert(action, value, f"--config {path}: {key}")
    return out


def from_env(p: argparse.ArgumentParser, environ) -> dict[str, object]:
    """KVSTORE_<FLAG> variables that are set -> {dest: value}."""
    out = {}
    for key, action in settings(p).items():
        name = env_name(key)
        if environ.get(name, "") != "":
            out[action.dest] = _convert(action, environ[name], name)
    return out


def apply(p: argparse.ArgumentParser, argv: list[str] | None, environ=None) -> None:
    """Make the config file's and the environment's values p's defaults,
    the environment over the file; p.error (one line, exit 2) on a bad one."""
    environ = os.environ if environ is None else environ
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    path = known.config or environ.get(CONFIG_ENV) or None
    try:
        layered = load_file(p, path) if path else {}
        layered.update(from_env(p, environ))
    except ValueError as e:
        p.error(str(e))
    p.set_defaults(**layered)
