"""Secrets stay on this machine: everything recorded or printed passes through here first.

Two kinds of secret reach a config or a command line:
- credentials in a URL: `tracking.uri=http://user:pass@host:5000` (also when it comes from
  `${oc.env:VAR}`), shown as `http://user:***@host:5000`, or `http://***@host` for a bare token;
- the value of a key whose last path component names a secret (`HF_TOKEN`, `api_key`,
  `password`, `secret`, `*_key`): `hydra.job.env_set.HF_TOKEN=abc` is shown as `...HF_TOKEN=***`.
  The rule matches whole `_`-separated words at the end of the name, so `algo.low_range`,
  `rollout.max_tokens` or `monkey` are left alone.

MLflow params and tags, the config.yaml artifact, `bapo config`, the plan and summary tables,
error lines and tracking warnings use these functions; the connection itself still uses the real
URI. The functions are pure and idempotent (masking twice gives the same text). Over-masking is
preferred to a leak: a URL's user info is everything up to its last `@`. Log records are masked
as they are made (`mask_log_records`): Hydra's launchers log each job's overrides as typed.
"""

from __future__ import annotations

import logging
import re
from typing import Any

MASK = "***"
# the last word of a secret key's name (`HF_TOKEN`, `api_key`); `max_tokens` is not one
SECRET_WORDS = ("token", "password", "passwd", "secret", "key", "apikey", "credentials")
_SECRET_NAME = re.compile(rf"(?:^|[_-])(?:{'|'.join(SECRET_WORDS)})$")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
# `http://`, `http\://` (as Hydra prints an override), or a bare `//` (OmegaConf reads
# `{http://u:p@h}` as a dict and its error quotes `'//u:p@h'`)
_SCHEME = r"(?:[A-Za-z][A-Za-z0-9+.\-]*\\?:)?//"
# a URL: its scheme, then everything up to whitespace (its user info: up to the last `@`)
_URL = re.compile(rf"(?P<scheme>{_SCHEME})(?P<rest>\S*)")
# name=value pairs (overrides, query strings); the value is quoted, or ends at whitespace or `&`
_ASSIGN = re.compile(r"""(?P<name>[\w.+~/\-]+)=(?P<value>'[^']*'|"[^"]*"|[^\s&]*)""")
_UNSET = ("", "None", "null")  # an empty secret is shown as it is: nothing is hidden there


def is_secret_name(key: str) -> bool:
    """True when the key's last component (after `.` or `/`) names a secret: `HF_TOKEN`,
    `tracking.api_key`, `apiKey`, `db_password`; not `max_tokens`, `low_range`, `keyboard`."""
    last = re.split(r"[./]", key.lstrip("+~"))[-1]
    return bool(_SECRET_NAME.search(_CAMEL.sub("_", last).lower()))


def _mask_url(m: re.Match[str]) -> str:
    rest = m.group("rest")
    info, at, host = rest.rpartition("@")
    if not at:
        return m.group(0)
    user, colon, password = info.partition(":")
    keep_user = colon and user and password and not re.search(r"[/?#]", user)
    shown = f"{user}:{MASK}" if keep_user else MASK  # a bare token (`https://TOKEN@host`): all
    return f"{m.group('scheme')}{shown}@{host}"


def _mask_assign(m: re.Match[str]) -> str:
    if not is_secret_name(m.group("name")) or m.group("value") in _UNSET:
        return m.group(0)
    return f"{m.group('name')}={MASK}"


def text(value: str) -> str:
    """Any text with URL credentials and secret `name=value` values masked."""
    return _ASSIGN.sub(_mask_assign, _URL.sub(_mask_url, value))


def params(values: dict[str, Any]) -> dict[str, str]:
    """Flat `{dotted key: value}` (MLflow params or tags): secret keys masked, values' URLs too."""
    return {
        k: MASK if is_secret_name(k) and str(v) not in _UNSET else text(str(v))
        for k, v in values.items()
    }


def tree(node: Any, secret: bool = False) -> Any:
    """A nested dict/list (a config as a container) with secrets masked; everything under a
    secret-named key is masked."""
    if isinstance(node, dict):
        return {k: tree(v, secret or is_secret_name(str(k))) for k, v in node.items()}
    if isinstance(node, list | tuple):
        return [tree(v, secret) for v in node]
    if secret and node is not None and str(node) not in _UNSET:
        return MASK
    return text(node) if isinstance(node, str) else node


def override(line: str) -> str:
    """One Hydra override as typed: a secret key's whole value masked, else `text`."""
    name, eq, value = line.partition("=")
    if eq and is_secret_name(name) and value not in _UNSET:
        return f"{name}={MASK}"
    return text(line)


def overrides(lines: list[str]) -> list[str]:
    return [override(line) for line in lines]


def mask_log_records() -> None:
    """Mask every log record this process makes from now on, whoever logs it and wherever it
    goes (Hydra reconfigures the handlers, not the record factory). Idempotent."""
    previous = logging.getLogRecordFactory()
    if getattr(previous, "bapo_masked", False):
        return

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: logging reports it when the record is emitted
            return record
        masked = text(message)
        if masked != message:
            record.msg, record.args = masked, None
        return record

    factory.bapo_masked = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)
