"""What the offline tools' command lines share: --help that shows every default,
numbers refused out of range as argparse refuses ones it cannot parse, and a
--target checked before the work that needs it."""
from __future__ import annotations

import argparse
import math
from typing import Callable


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)" after each option's help, except where there
    is none to show (None or an empty list: the help says what leaving the
    option out does)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default == []:
            return action.help
        return super()._get_help_string(action)


def bounded(kind: type, low: float, above: bool = False) -> Callable[[str], float]:
    """An argparse type: the text as `kind`, refused if below low (or at it, with
    above) or not finite, so that argparse's error names the flag (exit 2) as it
    does for text `kind` cannot parse, instead of a later call failing on the value."""
    def parse(text: str):
        v = kind(text)
        if not math.isfinite(v) or v < low or (above and v == low):
            raise argparse.ArgumentTypeError(f"must be {'>' if above else '>='} {low}, got {text}")
        return v
    parse.__name__ = kind.__name__      # argparse's "invalid float value" for text kind refuses
    return parse


def reachable(p: argparse.ArgumentParser, target: str) -> None:
    """--target refused (argparse's error, exit 2) where no daemon answers there: found
    before the model loads, not after minutes of work."""
    import grpc

    from kvstore.client import KVStoreClient
    try:
        with KVStoreClient(target, heartbeat=False, timeout=10, session_id="") as kv:     # no lease to lapse
            kv.stats()
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            p.error(f"--target: no daemon answers at {target} ({e.details()}); start one (make serve, or "
                    "python server.py)")
        p.error(f"--target: {target} refused the tool: {e.code().name}: {e.details()}")
    except (ValueError, OSError) as e:
        p.error(f"--target {target}: {e}")
